"""Every configuration error at launch, and sensors that cannot stall.

Before this: the sensors took the largest partition key + 1, so partitions left by failed launches made both skip
forever ("iteration 94 has not been evaluated yet") and a non-numeric key raised ValueError; `kind: sglang` without
URLs and `pipes: k8s` without an image failed at step 4 and step 2 after three tries each; `temper run --iteration 5`
with no iteration 4 added the partition and ran two steps; the Launchpad accepted a bad override string."""

import argparse
import logging
import uuid
from pathlib import Path

import dagster as dg
import pytest

import assets.iteration as iteration
from assets import ALL_ASSETS, ITERATIONS, RolloutBackend, TemperResource
from pipelines.definitions import defs, make_resources, next_iteration_on_evaluation, recurring_iterations

MICRO = {"resources": {"temper": {"config": {"preset": "micro", "overrides": ["loop.steps=3"]}}}}


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        yield inst


def _conf(root: Path, **extra) -> dict:
    return {"resources": {"temper": {"config": {**MICRO["resources"]["temper"]["config"], "run_root": str(root)}},
                          **extra}}


def _evaluate(instance, it: int, root: Path, conf: dict | None = None) -> str:
    """Iteration `it` of `root` evaluated and handed off, by a run on `conf` (stands in for the real evaluation)."""
    @dg.asset(name="evaluation", partitions_def=ITERATIONS)
    def stub(context, temper: TemperResource):
        context.log_event(dg.AssetMaterialization("policy", metadata={
            "iteration": it, "checkpoint": f"{root}/iteration-{it:04d}/student", "run_root": str(root)}))

    if str(it) not in instance.get_dynamic_partitions(ITERATIONS.name):
        instance.add_dynamic_partitions(ITERATIONS.name, [str(it)])
    res = dg.materialize([stub], partition_key=str(it), instance=instance, resources={"temper": TemperResource()},
                         run_config=conf or _conf(root))
    assert res.success
    return res.run_id


def _launched(instance, it: str, root: Path, status: dg.DagsterRunStatus, conf: dict | None = None) -> None:
    """What a launch of iteration `it` left: its partition and a run of the iteration job in `status`."""
    if it not in instance.get_dynamic_partitions(ITERATIONS.name):
        instance.add_dynamic_partitions(ITERATIONS.name, [it])
    instance.add_run(dg.DagsterRun(job_name="iteration", run_id=str(uuid.uuid4()), run_config=conf or _conf(root),
                                   tags={"dagster/partition": it}, status=status))


def _sense(sensor, instance, cursor=None):
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    ctx.log.addHandler(handler)
    return sensor(ctx), " ".join(" ".join(lines).split()), ctx


def test_failed_launches_do_not_stall_the_sensors(instance, tmp_path):
    root, other = (tmp_path / "root").resolve(), (tmp_path / "other").resolve()
    run1 = _evaluate(instance, 1, root)
    # failed launches since: iteration 2 twice, 3 and 94 once (partitions without evaluations), a key typed in the UI
    _launched(instance, "2", root, dg.DagsterRunStatus.FAILURE)
    _launched(instance, "2", root, dg.DagsterRunStatus.CANCELED)
    _launched(instance, "3", root, dg.DagsterRunStatus.FAILURE)
    _launched(instance, "94", root, dg.DagsterRunStatus.FAILURE)
    instance.add_dynamic_partitions(ITERATIONS.name, ["abc"])
    out, logged, _ = _sense(recurring_iterations, instance)
    assert [r.partition_key for r in out.run_requests] == ["2"]  # after the last evaluated one, not after 94
    req = out.run_requests[0]
    assert req.run_config["resources"]["temper"]["config"]["overrides"] == ["loop.steps=3"]  # iteration 1's config
    assert req.tags["temper/config_from"] == run1 and req.run_key.endswith("-try-3")  # a new key: it is launched
    assert out.dynamic_partitions_requests == []  # partition 2 exists already
    assert "[3, 94] were never evaluated in run root" in logged and "skipped" in logged
    assert "['abc'] are not iteration numbers" in logged and "2 earlier run(s)" in logged

    _launched(instance, "2", other, dg.DagsterRunStatus.STARTED)  # another run root's iteration 2 is no reason to wait
    assert [r.partition_key for r in _sense(recurring_iterations, instance)[0].run_requests] == ["2"]
    _launched(instance, "2", root, dg.DagsterRunStatus.STARTED)  # this one's is
    skip = _sense(recurring_iterations, instance)[0]
    assert isinstance(skip, dg.SkipReason) and "iteration 2 of run root" in skip.skip_message and "in flight" in \
        skip.skip_message

    _evaluate(instance, 2, root)  # once 2 is evaluated, 3 is next (its partition, left by a failed launch, is reused)
    for sensor in (recurring_iterations, next_iteration_on_evaluation):
        out = _sense(sensor, instance)[0]
        assert [r.partition_key for r in out.run_requests] == ["3"] and out.dynamic_partitions_requests == []
    out, _, ctx = _sense(next_iteration_on_evaluation, instance)
    assert isinstance(_sense(next_iteration_on_evaluation, instance, ctx.cursor)[0], dg.SkipReason)  # once per hand-off


def test_a_sensor_refuses_a_carried_config_that_no_longer_passes(instance, tmp_path, monkeypatch):
    import configs

    root = (tmp_path / "root").resolve()
    _evaluate(instance, 1, root)
    parts = instance.get_dynamic_partitions(ITERATIONS.name)
    monkeypatch.setattr(configs, "PRESET_DIR", tmp_path / "presets")  # the preset is gone since iteration 1 ran
    out, logged, _ = _sense(recurring_iterations, instance)
    assert isinstance(out, dg.SkipReason) and "iteration 2 of run root" in out.skip_message
    assert "preset 'micro' not found" in out.skip_message and "not launched" in logged
    assert instance.get_dynamic_partitions(ITERATIONS.name) == parts  # nothing created


def test_launch_check_names_every_problem():
    from assets.launch import LaunchRefused, check_run_config, iteration_number

    with pytest.raises(LaunchRefused) as e:
        check_run_config({"resources": {"temper": {"config": {"preset": "micro", "overrides": ["loop.steps"]}},
                                        "rollout": {"config": {"kind": "sglang"}},
                                        "pipes": {"config": {"kind": "k8s", "stages": ["sao_experts"]}}}})
    msg = str(e.value)
    for want in ("override 'loop.steps': expected key.path=value", "kind 'sglang' needs `urls`",
                 "kind 'k8s' needs `image`", "['sao_experts'], which are not stages"):
        assert want in msg, (want, msg)
    check_run_config({"resources": {"rollout": {"config": {"kind": "sglang", "launch": True}},
                                    "pipes": {"config": {"kind": "k8s", "image": "temper:1", "stages": ["sao_expert"]}}}})
    check_run_config({})
    assert iteration_number("12") == 12
    for key in ("abc", "0", "-1", "01", "1.5", ""):
        with pytest.raises(LaunchRefused, match="not an iteration number"):
            iteration_number(key)


@pytest.mark.parametrize("bad, why", [
    ({"temper": {"config": {"preset": "micro", "overrides": ["loop.steps"]}}}, "expected key.path=value"),
    ({"temper": {"config": {"preset": "micro", "overrides": ["loop.stepz=3"]}}}, "did you mean `loop.steps`"),
    ({"rollout": {"config": {"kind": "sglang"}}}, "needs `urls`"),
    ({"pipes": {"config": {"kind": "k8s"}}}, "needs `image`"),
])
def test_the_launchpad_refuses_a_bad_config_before_a_run_exists(instance, bad, why):
    """The Launchpad checks a run config with Dagster's own validation; the resources' launch check runs in it, so
    launching (here: `execute_in_process`, which validates first like a launch) creates no run."""
    job = defs.resolve_job_def("iteration")
    with pytest.raises(dg.DagsterError) as e:
        dg.validate_run_config(job, {"resources": bad})
    assert why in str(e.value) + str(getattr(e.value, "user_exception", ""))
    instance.add_dynamic_partitions(ITERATIONS.name, ["1"])
    with pytest.raises(dg.DagsterError):
        job.execute_in_process(run_config={"resources": bad}, instance=instance, partition_key="1")
    assert instance.get_runs() == []
    dg.validate_run_config(job, {"resources": {"temper": {"config": {"preset": "micro", "overrides": ["loop.steps=3"]}},
                                               "rollout": {"config": {"kind": "sglang", "urls": ["http://a:1"]}}}})


def test_launching_from_the_launchpad_refuses_a_bad_config_and_creates_no_run(tmp_path):
    """The Launchpad's own path: the GraphQL launch mutation against a code server loading `pipelines/definitions.py`.
    A refused config answers with the reason and creates no run; a good one is queued (no daemon here runs it)."""
    from dagster_graphql.client.query import LAUNCH_PIPELINE_EXECUTION_MUTATION
    from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql, infer_job_selector

    queued = {"run_coordinator": {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator"}}
    root = Path(__file__).resolve().parents[2]
    with dg.instance_for_test(overrides=queued, temp_dir=str(tmp_path)) as inst:
        inst.add_dynamic_partitions(ITERATIONS.name, ["1"])
        with define_out_of_process_context(str(root / "pipelines" / "definitions.py"), "defs", inst) as ctx:
            def launch(resources):
                return execute_dagster_graphql(ctx, LAUNCH_PIPELINE_EXECUTION_MUTATION, variables={"executionParams": {
                    "selector": infer_job_selector(ctx, "iteration"), "runConfigData": {"resources": resources},
                    "mode": "default", "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "1"}]}}}
                ).data["launchPipelineExecution"]

            for bad, why in (({"rollout": {"config": {"kind": "sglang"}}}, "kind 'sglang' needs `urls`"),
                             ({"temper": {"config": {"overrides": ["loop.steps"]}}}, "expected key.path=value"),
                             ({"pipes": {"config": {"kind": "k8s"}}}, "kind 'k8s' needs `image`")):
                got = launch(bad)
                assert got["__typename"] == "PythonError" and why in str(got), str(got)[:2000]
            assert inst.get_runs() == []
            assert launch({"temper": {"config": {"preset": "micro"}}})["__typename"] == "LaunchRunSuccess"
            assert [r.status for r in inst.get_runs()] == [dg.DagsterRunStatus.QUEUED]


def _cli(tmp_path, monkeypatch, iteration=None, overrides=()):
    from pipelines.run_cli import cmd_run

    monkeypatch.chdir(tmp_path)
    return cmd_run(argparse.Namespace(preset="micro", override=list(overrides), iteration=iteration, servers=0,
                                      run_root=str(tmp_path / "runs" / "pipeline"), log_level="ERROR"))


def _partitions(tmp_path):
    from pipelines.run_cli import _instance

    return _instance(tmp_path).get_dynamic_partitions(ITERATIONS.name)


def test_temper_run_refuses_a_missing_parent_and_a_bad_override_before_anything_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "unused"))
    assert _cli(tmp_path, monkeypatch, iteration=5) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "iteration 5 starts from what iteration 4 of run root" in said and "nothing has been evaluated" in said
    assert _cli(tmp_path, monkeypatch, overrides=["loop.steps"]) == 2
    assert "expected key.path=value" in " ".join(capsys.readouterr().out.split())
    assert _cli(tmp_path, monkeypatch, iteration=0) == 2
    assert _partitions(tmp_path) == []  # no partition (and no run) for a refused launch


def test_temper_runs_hint_is_the_exact_command_and_the_mlflow_link_comes_from_config(tmp_path, monkeypatch, capsys):
    """The closing hint repeats preset, overrides and run root; the MLflow link is the resource's `mlflow_ui`, which
    `make run` / `make ui` set from their MLFLOW_PORT. The run itself is stubbed (it fails at once)."""
    import pipelines.definitions as definitions

    seen = {}

    class Job:
        loggers: dict = {}

        def with_logger_defs(self, logger_defs):  # `temper run` adds its live board's and log file's logger
            return self

        def execute_in_process(self, run_config, instance, partition_key, raise_on_error, tags=None, run_id=None):
            seen["config"] = run_config
            (tmp_path / "runs" / "pipeline" / f"iteration-{int(partition_key):04d}").mkdir(parents=True, exist_ok=True)
            return argparse.Namespace(success=False, run_id="r1", all_events=[])

    monkeypatch.setattr(definitions, "defs", argparse.Namespace(resolve_job_def=lambda name: Job()))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "unused"))
    monkeypatch.setenv("TEMPER_MLFLOW_UI", "http://127.0.0.1:5123")
    monkeypatch.setattr("sys.argv", [".venv/bin/temper", "run"])
    assert _cli(tmp_path, monkeypatch, overrides=["loop.steps=3", "envs.patterns=[kv-lookup, calc-chain]"]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert seen["config"]["resources"]["temper"]["config"]["mlflow_ui"] == "http://127.0.0.1:5123"
    assert "MLflow http://127.0.0.1:5123" in said and "5000" not in said
    root = tmp_path / "runs" / "pipeline"
    assert (f"again: .venv/bin/temper run --preset micro -o loop.steps=3 -o 'envs.patterns=[kv-lookup, calc-chain]' "
            f"--run-root {root} reruns iteration 1") in said


def test_a_run_the_launchpad_started_on_a_bad_partition_fails_once_at_its_first_step(instance, tmp_path):
    """What the Launchpad cannot see when it checks a config (the partition): the first step refuses it, without
    retries, before anything is computed."""
    runs = tmp_path / "runs"
    res = TemperResource(preset="micro", run_root=str(runs))
    for key, why in (("abc", "not an iteration number"), ("3", "iteration 2 has not been evaluated there")):
        instance.add_dynamic_partitions(ITERATIONS.name, [key])
        out = dg.materialize(ALL_ASSETS, partition_key=key, instance=instance, resources=make_resources(res),
                             raise_on_error=False)
        assert not out.success and out.get_asset_materialization_events() == []
        failed = [e for e in out.all_events if e.event_type_value == "STEP_FAILURE"]
        assert [e.step_key for e in failed] == ["env_specs"] and why in str(failed[0].event_specific_data.error)
    assert not any(runs.glob("iteration-*"))


def test_a_config_error_in_a_step_fails_once(instance, tmp_path, monkeypatch):
    """A step given a config the launch check refuses (here `dg.materialize` with resources built in code) fails once,
    clearly: a `Failure` that is not retried, not three attempts of the long-step retry policy."""
    monkeypatch.setattr(iteration, "_stage", lambda *a, **k: pytest.fail("the stage ran"))
    instance.add_dynamic_partitions(ITERATIONS.name, ["1"])
    for name, result in (("verified_envs", {"rl": "/nowhere"}), ("warm_start", {"checkpoint": "/ws"})):
        instance.report_runless_asset_event(dg.AssetMaterialization(
            name, partition="1", metadata={"result": dg.MetadataValue.json(result)}))
    out = dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.keys("rollout_batches"), partition_key="1",
                         instance=instance, raise_on_error=False,
                         resources=make_resources(TemperResource(preset="micro", run_root=str(tmp_path / "runs")),
                                                  rollout=RolloutBackend(kind="sglang")))
    assert not out.success
    assert [e.event_type_value for e in out.all_events if e.step_key == "rollout_batches"
            and e.event_type_value in ("STEP_UP_FOR_RETRY", "STEP_FAILURE")] == ["STEP_FAILURE"]
