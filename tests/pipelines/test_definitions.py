"""The Dagster definitions: load, materialise a whole iteration on `micro`, lineage across iterations,
blocking checks, MLflow, schedule and sensor."""

import json
from pathlib import Path
from urllib.parse import urlparse

import dagster as dg
import pytest

import configs
from assets import ALL_ASSETS, ALL_CHECKS, ITERATIONS, TemperResource
from pipelines.definitions import defs, make_resources, next_iteration_on_evaluation, recurring_iterations

FAST = ["train.max_steps=6", "train.batch_size=4", "envs.n_train=4", "envs.n_eval=2", "envs.probes=false",
        "loop.steps=1", "opd.steps=1", "sao.value_pretrain_steps=1", "sao.min_domain_reward=0"]


def test_definitions_load_and_validate():
    dg.Definitions.validate_loadable(defs)
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {"env_specs", "verified_envs", "warm_start", "rollout_batches", "rewards", "sao_experts",
                    "opd_student", "evaluation", "policy", "scaling"}
    assert defs.resolve_job_def("iteration").partitions_def == ITERATIONS
    assert {s.name for s in defs.sensors} == {"recurring_iterations", "next_iteration_on_evaluation",
                                              "mark_failed_iterations"}
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():  # owners, kinds and a code version on every asset
        spec = graph.get(key)
        assert spec.owners == ["team:post-training"] and "python" in spec.kinds and len(spec.code_version) == 12


def test_lineage_is_the_data_flow():
    """Each asset's declared upstream assets are exactly the same-iteration results its body reads (parsed from
    its source: `_upstream(context, "<asset>")`), so the lineage graph in the UI is the real data flow."""
    import ast
    import inspect

    import assets.iteration as it

    tree = ast.parse(inspect.getsource(it))
    reads = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and any("asset" in ast.unparse(d) and "check" not in ast.unparse(d)
                                                   for d in fn.decorator_list):
            reads[fn.name] = {c.args[1].value for c in ast.walk(fn) if isinstance(c, ast.Call)
                              and ast.unparse(c.func) == "_upstream" and isinstance(c.args[1], ast.Constant)}
            assert "_load" not in ast.unparse(fn)  # no side-file reads
            if any(isinstance(c, ast.Call) and ast.unparse(c.func) == "_handed_off" for c in ast.walk(fn)):
                reads[fn.name].add("policy")  # what iteration N−1 hands off, from the `policy` records
    import importlib

    sc = importlib.import_module("assets.scaling")  # (the package's `scaling` is the asset)
    body = ast.parse(inspect.getsource(sc.scaling_body)).body[0]
    reads["scaling"] = {c.args[1].value for c in ast.walk(body) if isinstance(c, ast.Call)
                        and ast.unparse(c.func) == "_upstream" and isinstance(c.args[1], ast.Constant)}
    graph = defs.resolve_asset_graph()
    declared = {k.to_user_string(): {p.to_user_string() for p in graph.get(k).parent_keys}
                for k in graph.get_all_asset_keys()}
    assert declared.pop("policy") == set()  # materialised by evaluation[N−1] (a cycle if declared), read in N
    # the hand-off drawn as a partition dependency: policy[N] → env_specs[N] and warm_start[N], iteration by iteration
    pol = graph.get(dg.AssetKey("policy"))
    assert pol.partitions_def == graph.get(dg.AssetKey("warm_start")).partitions_def
    for child in ("env_specs", "warm_start"):
        m = graph.get_partition_mapping(dg.AssetKey(child), dg.AssetKey("policy"))
        assert isinstance(m, dg.IdentityPartitionMapping), (child, m)
    assert set(reads) == set(declared)
    assert declared == reads
    assert declared["sao_experts"] == {"rewards", "warm_start", "verified_envs"}


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        yield inst


def _run(instance, tmp_path, iteration, overrides=FAST):
    instance.add_dynamic_partitions(ITERATIONS.name, [iteration])
    res = TemperResource(preset="micro", overrides=overrides, run_root=str(tmp_path / "runs"))
    return dg.materialize(ALL_ASSETS + ALL_CHECKS, partition_key=iteration, instance=instance,
                          resources=make_resources(res), raise_on_error=False)


@pytest.mark.slow
def test_two_iterations_lineage_and_mlflow(instance, tmp_path):
    r1 = _run(instance, tmp_path, "1")
    assert r1.success
    mats = {e.asset_key.to_user_string(): e for e in r1.get_asset_materialization_events()}
    assert set(mats) >= {"env_specs", "verified_envs", "warm_start", "evaluation"}
    student1 = mats["opd_student"].materialization.metadata["checkpoint"].value
    # results travel as materialisation metadata, reported by the Pipes child, with absolute paths
    ws_meta = mats["warm_start"].materialization.metadata
    assert isinstance(ws_meta["checkpoint"], dg.PathMetadataValue) and Path(ws_meta["checkpoint"].value).is_absolute()
    assert ws_meta["result"].value["checkpoint"] == ws_meta["checkpoint"].value
    assert mats["evaluation"].materialization.metadata["result"].value["student"] == student1
    r2 = _run(instance, tmp_path, "2", FAST + ["envs.sandbox=docker"])  # iteration 2 runs agent code in Docker
    assert r2.success
    ve2 = {e.asset_key.to_user_string(): e for e in r2.get_asset_materialization_events()}["verified_envs"]
    assert ve2.materialization.metadata["sandbox"].value == "docker"
    assert mats["verified_envs"].materialization.metadata["sandbox"].value == "bwrap"
    ws2 = {e.asset_key.to_user_string(): e for e in r2.get_asset_materialization_events()}["warm_start"]
    parent = ws2.materialization.metadata["parent_checkpoint"].value
    recs = instance.fetch_materializations(dg.AssetKey("policy"), limit=10).records
    assert [r.asset_materialization.metadata["iteration"].value for r in recs] == [2, 1]  # newest first
    rec1 = recs[1].asset_materialization.metadata
    assert rec1["checkpoint"].value == str(Path(student1).resolve())
    assert rec1["warm_start"].value == str(Path(ws_meta["checkpoint"].value).resolve())
    # iteration 2 starts from iteration 1's student if it was better on validation (`hand_off: better`), else from
    # iteration 1's warm start
    moved1 = mats["evaluation"].materialization.metadata["champion_moved"].value
    better1 = mats["evaluation"].materialization.metadata["result"].value["decision"]["better"]
    assert rec1["champion"].value == moved1 and rec1["better"].value == better1
    assert Path(parent).resolve() == Path(student1 if better1 else ws_meta["checkpoint"].value).resolve()
    assert ws2.materialization.metadata["hand_off"].value.startswith("its student" if better1 else "its warm start")
    assert recs[1].run_id == r1.run_id  # recorded by iteration 1's run (its evaluation)
    # as partition N+1 of `policy` (the partition iteration 2's warm start depends on), naming where it came from
    assert [r.asset_materialization.partition for r in recs] == ["3", "2"]
    assert rec1["for_iteration"].value == 2 and rec1["source_partition"].value == "evaluation[1]"
    assert rec1["source_run"].value == r1.run_id
    assert Path(rec1["handed_off"].value) == Path(parent).resolve()
    assert instance.has_dynamic_partition("iteration", "3")  # evaluation[2] made the partition it hands off to
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{(tmp_path / 'runs').resolve() / 'mlflow.db'}")
    exp = client.get_experiment_by_name("temper")
    runs = client.search_runs([exp.experiment_id], "tags.temper_kind = 'iteration'")
    assert len(runs) == 2 and all("pass_at_1_after" in r.data.metrics for r in runs)
    assert all(r.info.status == "FINISHED" for r in runs)
    sig = [json.loads((tmp_path / "runs" / f"iteration-000{i}" / "evaluation.json").read_text())["decision"]["significant"]
           for i in (1, 2)]
    try:
        champ = client.get_model_version_by_alias("temper-student", "champion")
    except Exception:  # noqa: BLE001 - mlflow's not-found error
        champ = None
    assert (champ is not None) == any(sig)  # the alias moves only on a significant improvement on validation
    versions = client.search_model_versions("name = 'temper-student'")
    assert len(versions) == 2  # every student is registered from models:/<id>, a LoggedModel with a copy of its weights
    for v in versions:
        lm = client.get_logged_model(v.tags["logged_model_id"])
        assert v.source == f"models:/{lm.model_id}"
        where = Path(urlparse(lm.artifact_location).path)
        assert where.is_absolute() and (where / "model.safetensors").is_file()
        assert lm.source_run_id == v.run_id and str(lm.status).endswith("READY")
        src = client.get_run(lm.source_run_id)  # trained by the iteration's OPD stage run
        it = src.data.tags["temper_iteration"]
        assert src.data.tags["temper_stage"] == "opd_student"
        ev_it = json.loads((tmp_path / "runs" / f"iteration-000{it}" / "evaluation.json").read_text())
        held = {m.key: m for m in lm.metrics if m.dataset_name == f"iteration-{it}-held_out"}
        assert held["pass_at_1"].value == pytest.approx(ev_it["pass@1_after"])
        assert [held["pass_at_1_ci95_lo"].value, held["pass_at_1_ci95_hi"].value] == ev_it["stats"]["all"]["after"]["ci95"]
        digests = {d.dataset.name: d.dataset.digest for d in src.inputs.dataset_inputs}
        assert held["pass_at_1"].dataset_digest == digests[f"iteration-{it}-held_out"]
        assert f"iteration-{it}-rl_verified" in digests
    # each expert scored on its own held-out domain is a LoggedModel too, with that pass@1
    experts = [m for m in client.search_logged_models([exp.experiment_id]) if m.name.startswith("temper-expert-")]
    want = sorted((f"temper-expert-{d}", round(s["pass@1"], 6)) for i in (1, 2) for d, s in json.loads(
        (tmp_path / "runs" / f"iteration-000{i}" / "evaluation.json").read_text())["teacher_stats"].items())
    assert sorted((e.name, round(next(m.value for m in e.metrics if m.key == f"pass_at_1_{e.name.split('-')[-1]}"), 6))
                  for e in experts) == want
    it_run = runs[0]
    assert it_run.data.tags["dagster_partition"] == it_run.data.tags["temper_iteration"]
    assert it_run.data.tags["dagster_run_id"] in {r1.run_id, r2.run_id}
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert it_run.data.tags["mlflow.source.git.commit"].removesuffix("+dirty") == head
    logged = json.loads(Path(urlparse(client.download_artifacts(it_run.info.run_id, "config/config.json",
                                                                str(tmp_path / "dl"))).path).read_text())
    assert logged["loop"]["steps"] == 1 and logged["model"]["hidden_size"] == configs.load("micro").model.hidden_size
    inputs = {d.dataset.name: d for d in client.get_run(it_run.info.run_id).inputs.dataset_inputs}
    held = inputs[f"iteration-{it_run.data.tags['temper_iteration']}-held_out"]
    assert held.dataset.source.endswith("/envs/eval") and held.tags[0].value == "evaluation"
    stages = client.search_runs([exp.experiment_id], "tags.temper_kind = 'stage' and tags.temper_iteration = '1'")
    assert {r.data.tags["temper_stage"] for r in stages} >= {"env_specs", "verified_envs", "warm_start", "rollout_batches",
                                                             "rewards", "opd_student", "evaluation"}
    parent = runs[0].info.run_id if runs[0].data.tags["temper_iteration"] == "1" else runs[1].info.run_id
    assert all(r.data.tags["mlflow.parentRunId"] == parent for r in stages)  # nested under iteration 1's run
    sft = next(r for r in stages if r.data.tags["temper_stage"] == "warm_start")
    loss = client.get_metric_history(sft.info.run_id, "sft_loss")
    assert len(loss) == mats["warm_start"].materialization.metadata["sft_steps"].value > 1  # one point per step
    assert [m.step for m in loss] == list(range(len(loss)))
    # logged live by the Pipes child as it trained, before the parent logged the stage's summary afterwards
    done = client.get_metric_history(sft.info.run_id, "sft_steps")[0].timestamp
    assert all(m.timestamp < done for m in loss) and loss == sorted(loss, key=lambda m: m.timestamp)
    sao = [r for r in stages if r.data.tags["temper_stage"].startswith("sao_expert_")]
    assert sao and all(len(client.get_metric_history(r.info.run_id, "batch_reward")) == 1 for r in sao)  # loop.steps=1
    plotted = {k for k, e in mats.items() if any(m == "plot" or m.endswith("_plot") for m in e.materialization.metadata)}
    assert plotted == set(mats) - {"policy"}, f"no plot on {set(mats) - plotted}"  # every stage carries one
    assert all(r.info.status == "FINISHED" for r in stages)
    art = client.list_artifacts(sft.info.run_id, "plots")
    root = (tmp_path / "runs" / "mlartifacts").resolve()
    assert art and exp.artifact_location == root.as_uri()  # beside the db, not ./mlruns of the working directory
    local = Path(urlparse(sft.info.artifact_uri).path) / art[0].path
    assert local.is_file() and local.is_relative_to(root)

    from rich.console import Console

    from pipelines.run_cli import summary

    con = Console(record=True, width=200)
    out = summary(tmp_path / "runs" / "iteration-0001", {"warm_start": 1.5}, 9.0, con)
    text = con.export_text()
    ev = mats["evaluation"].materialization.metadata
    assert set(out["domain_after"]) == set(ev["domain_after"].value) and "warm_start" in text and "all" in text


def test_failing_triad_check_blocks_downstream(instance, tmp_path):
    res = _run(instance, tmp_path, "1", FAST + ["envs.n_train=0"])
    assert not res.success
    done = {e.asset_key.to_user_string() for e in res.get_asset_materialization_events()}
    assert done == {"env_specs", "verified_envs"}  # nothing after the blocking check ran
    checks = {e.event_specific_data.check_name: e.event_specific_data.passed
              for e in res.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert checks.get("triad_pass_rate") is False
    parts = {e.event_specific_data.partition for e in res.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert parts == {"1"}  # check records are partitioned like their asset: a history per iteration
    # the run-failure sensor leaves no MLflow run of the failed iteration RUNNING (UI and sensor launches too)
    from mlflow.tracking import MlflowClient

    from pipelines.definitions import mark_failed_iterations

    client = MlflowClient(f"sqlite:///{(tmp_path / 'runs').resolve() / 'mlflow.db'}")
    exp = client.get_experiment_by_name("temper").experiment_id

    def statuses():
        return {r.data.tags.get("temper_stage", "iteration"): r.info.status
                for r in client.search_runs([exp], "tags.temper_iteration = '1'")}

    assert statuses()["iteration"] == "RUNNING"
    failure = next(e for e in res.all_events if e.event_type_value in ("PIPELINE_FAILURE", "RUN_FAILURE"))
    ctx = dg.build_run_status_sensor_context(sensor_name="mark_failed_iterations", dagster_event=failure,
                                             dagster_instance=instance,
                                             dagster_run=instance.get_run_by_id(res.run_id)).for_run_failure()
    mark_failed_iterations(ctx)
    assert statuses()["iteration"] == "FAILED" and statuses()["env_specs"] == "FINISHED"


def test_recurring_and_evaluation_sensors_carry_the_previous_config(instance):
    """Both triggers add partition N+1 (sensors may; schedules may not) and launch it on iteration N's run config,
    once N has been evaluated (tests/pipelines/test_launch.py: failed launches in between)."""
    first = recurring_iterations(dg.build_sensor_context(instance=instance))
    assert [r.partition_key for r in first.run_requests] == ["1"] and first.run_requests[0].run_config == {}
    assert first.dynamic_partitions_requests[0].partition_keys == ["1"]
    instance.add_dynamic_partitions(ITERATIONS.name, ["1"])
    again = recurring_iterations(dg.build_sensor_context(instance=instance))  # no run came of it: the same request
    assert [r.run_key for r in again.run_requests] == [first.run_requests[0].run_key]  # (Dagster launches a key once)
    assert isinstance(next_iteration_on_evaluation(dg.build_sensor_context(instance=instance)), dg.SkipReason)

    @dg.asset(name="evaluation", partitions_def=ITERATIONS)
    def stub(context, temper: TemperResource):  # stands in for iteration 1's evaluation, run on a non-default config
        context.log_event(dg.AssetMaterialization("policy", metadata={  # and its hand-off record
            "iteration": 1, "checkpoint": "/x/student", "run_root": str(Path(temper.run_root).resolve())}))
        return 1

    conf = {"resources": {"temper": {"config": {"preset": "micro", "overrides": ["loop.steps=3"]}}}}
    assert dg.materialize([stub], partition_key="1", instance=instance, resources={"temper": TemperResource()},
                          run_config=conf).success
    for sensor in (recurring_iterations, next_iteration_on_evaluation):
        out = sensor(dg.build_sensor_context(instance=instance))
        assert [r.partition_key for r in out.run_requests] == ["2"]
        assert out.dynamic_partitions_requests[0].partition_keys == ["2"]
        assert out.run_requests[0].run_config["resources"]["temper"]["config"]["overrides"] == ["loop.steps=3"]
    assert instance.get_dynamic_partitions(ITERATIONS.name) == ["1"]  # evaluating a sensor adds nothing itself


def test_launch_refuses_a_bad_preset_and_bad_overrides():
    job = defs.resolve_job_def("iteration")
    with pytest.raises(dg.DagsterInvalidConfigError, match="not in enum type Preset got tiny2"):
        dg.validate_run_config(job, {"resources": {"temper": {"config": {"preset": "tiny2"}}}})
    for bad, why in ((["loop.stepz=3"], "did you mean `loop.steps`"), (["loop.steps=many"], "loop.steps"),
                     (["envs.patterns=[nope]"], "nope")):
        with pytest.raises(ValueError, match=why.replace("`", ".")):
            TemperResource(preset="micro", overrides=bad)
    assert TemperResource(preset="micro", overrides=["loop.steps=3"]).config().loop.steps == 3


def test_launchpad_checks_typed_settings_before_a_run_exists():
    """`settings` mirrors IterationConfig with typed leaves: the Launchpad's own validation (no user code runs
    there) refuses a wrong type, a misspelt key and an unknown enum value, each at its path; good values reach the
    stages' config, after the string overrides."""
    job = defs.resolve_job_def("iteration")

    def launch(settings):
        return dg.validate_run_config(job, {"resources": {"temper": {"config": {"preset": "micro",
                                                                                "settings": settings}}}})

    for settings, why in (({"loop": {"steps": "many"}}, r"settings:loop:steps.*not valid for expected type \"Int\""),
                          ({"loop": {"stepz": 3}}, r"unexpected config entry \"stepz\" at path .*settings:loop"),
                          ({"loop": {"mode": "asink"}}, r"settings:loop:mode not in enum type .* got asink"),
                          ({"envs": {"patterns": "kv-lookup"}}, r"settings:envs:patterns"),
                          ({"sao": {"exact_rows": "yes"}}, r"settings:sao:exact_rows")):
        with pytest.raises(dg.DagsterInvalidConfigError, match=why):
            launch(settings)
    launch({"loop": {"steps": 40, "mode": "sync"}, "envs": {"patterns": ["kv-lookup"]}, "sao": {"lr": 1e-3}})
    res = TemperResource(preset="micro", overrides=["loop.steps=3", "opd.steps=2"],
                         settings={"loop": {"steps": 40, "mode": "sync"}, "envs": {"patterns": ["kv-lookup"]}})
    cfg = res.config()
    assert (cfg.loop.steps, cfg.loop.mode, cfg.envs.patterns, cfg.opd.steps) == (40, "sync", ["kv-lookup"], 2)
    assert cfg.sao == configs.load("micro").sao  # unset leaves keep the preset's values
    # what the schema cannot express (ranges, cross-field rules) is refused when the resource is built
    with pytest.raises(ValueError, match="loop.steps"):
        TemperResource(preset="micro", settings={"loop": {"steps": -1}})


def test_temper_run_validates_first_and_repairs_a_failed_iteration(tmp_path, monkeypatch, capsys):
    """A bad override fails before any partition exists (with a did-you-mean); a failed iteration's MLflow runs
    end FAILED, and the next `temper run` reruns that iteration instead of burning a new number."""
    import argparse
    import os
    import subprocess
    import sys

    from pipelines.run_cli import cmd_run
    from store.tracking import Tracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", os.environ.get("DAGSTER_HOME", ""))

    def run(*overrides):
        return cmd_run(argparse.Namespace(preset="micro", override=[*FAST, *overrides], iteration=None,
                                          run_root=str(tmp_path / "runs" / "pipeline"), log_level="ERROR", servers=0))

    def partitions():
        return dg.DagsterInstance.get().get_dynamic_partitions(ITERATIONS.name)

    assert run("loop.stepz=3") == 2
    assert "did you mean `loop.steps`" in " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert run("loop.steps=many") == 2
    assert not (tmp_path / "runs" / "dagster_home").exists() or partitions() == []
    assert run("envs.n_train=0") == 1  # the blocking triad check fails
    assert partitions() == ["1"]
    tr = Tracker(f"sqlite:///{tmp_path / 'runs' / 'pipeline' / 'mlflow.db'}")
    runs = tr.client.search_runs([tr.experiment_id], "tags.temper_iteration = '1'")
    assert runs and {r.info.status for r in runs} <= {"FAILED", "FINISHED"} and \
        any(r.info.status == "FAILED" for r in runs)
    from pipelines.stale_runs import PID_TAG, run_tags

    instance = dg.DagsterInstance.get()
    (first,) = instance.get_runs()
    assert first.tags[PID_TAG] == str(os.getpid())  # each run names the process that executes it
    # a run whose process was killed mid-step (here: a pid that has exited) is closed before the next launch
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = instance.create_run_for_job(defs.resolve_job_def("iteration"), tags={**run_tags(), PID_TAG: str(gone.pid)},
                                        status=dg.DagsterRunStatus.STARTED)
    capsys.readouterr()
    assert run("envs.n_train=0") == 1
    assert partitions() == ["1"]
    said = " ".join(capsys.readouterr().out.split())
    assert "iteration 1 did not finish: running it again" in said
    assert f"run {stale.run_id} (iteration ?) lost its process {gone.pid}" in said
    assert instance.get_run_by_id(stale.run_id).status == dg.DagsterRunStatus.FAILURE


def test_dg_scaffold_adds_a_definition_the_project_loads(tmp_path):
    """`dg scaffold defs` writes into pipelines/defs/, and `load_from_defs_folder` picks the new file up."""
    import subprocess
    import sys
    import uuid

    root = Path(__file__).resolve().parents[2]
    name = f"zz_scaffold_probe_{uuid.uuid4().hex[:8]}"
    made = root / "pipelines" / "defs" / f"{name}.py"
    dg_bin = Path(sys.executable).parent / "dg"
    try:
        r = subprocess.run([str(dg_bin), "scaffold", "defs", "dagster.asset", f"{name}.py"], cwd=root,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert made.is_file()
        code = ("from pipelines.definitions import defs; "
                "print(sorted(k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()))")
        out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
        assert name in out.stdout and "warm_start" in out.stdout, out.stderr[-2000:]
    finally:
        made.unlink(missing_ok=True)


def test_no_room_below_pipelines_imports_it():
    """The stage functions live in `stages/`, above `assets/`; nothing outside `pipelines/` imports `pipelines`."""
    import ast

    root = Path(__file__).resolve().parents[2]
    bad = []
    for room in ("assets", "stages", "store", "trainers", "rollout", "envs", "model", "configs"):
        for f in (root / room).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                bad += [f"{f.relative_to(root)}: {m}" for m in mods if m.split(".")[0] == "pipelines"]
    assert bad == []


def test_a_stage_runs_in_a_docker_container_through_pipes(instance, tmp_path):
    """`pipes: {kind: docker}`: the warm start (the shipped base, checked against its card) runs in a container
    through dagster-docker's PipesDockerClient, reports its result and materialisation through Pipes, and the
    container is gone afterwards."""
    import docker

    from assets import StageRunner

    instance.add_dynamic_partitions(ITERATIONS.name, ["1"])
    res = TemperResource(preset="tiny", overrides=["envs.n_rl=4", "envs.n_eval=2", "envs.probes=false",
                                                           "envs.curriculum.enabled=false"],
                         run_root=str(tmp_path / "runs"))
    sel = dg.AssetSelection.keys("env_specs", "verified_envs", "warm_start")
    out = dg.materialize(ALL_ASSETS + ALL_CHECKS, selection=sel, partition_key="1", instance=instance,
                         resources=make_resources(res, pipes=StageRunner(kind="docker", stages=["warm_start"])))
    assert out.success
    logs = [e.message for e in instance.all_logs(out.run_id) if "pid" in (e.message or "")]
    ws = {e.asset_key.to_user_string(): e for e in out.get_asset_materialization_events()}["warm_start"]
    meta = ws.materialization.metadata
    assert meta["source"].value == "base" and meta["result"].value["checkpoint"] == meta["checkpoint"].value
    assert any("stage warm_start started in pid 1" in m for m in logs)  # PID 1: its own container
    assert any("stage verified_envs started in pid" in m and "pid 1\n" not in m for m in logs)
    left = docker.from_env().containers.list(all=True, filters={"label": f"temper.dagster_run={out.run_id}"})
    assert left == []


def test_k8s_stage_pods_render_and_validate(tmp_path):
    """`pipes: {kind: k8s}` builds each stage's pod with dagster-k8s's own builder (a kubernetes `V1Pod`): GPU stages
    request GPUs, the run root is the shared claim at the same path, and a misspelt field is refused before
    anything would be submitted."""
    from assets import StageRunner

    run = StageRunner(kind="k8s", image="registry.example/temper:1", run_root_claim="temper-runs",
                      node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
                      tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    cmd = ["/venv/bin/python", "-m", "stages.step", "sao_expert"]
    pod = run.pod("sao_expert", cmd, {"OMP_NUM_THREADS": "8"}, tmp_path)
    c = pod.spec.containers[0]
    assert c.image == "registry.example/temper:1" and c.command == ["python", "-m", "stages.step", "sao_expert"]
    assert c.resources.limits["nvidia.com/gpu"] == "1" and c.resources.requests["memory"] == "64Gi"
    assert c.volume_mounts[0].mount_path == str(tmp_path)
    assert pod.spec.volumes[0].persistent_volume_claim.claim_name == "temper-runs"
    assert pod.spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200"} and pod.spec.restart_policy == "Never"
    assert {e.name: e.value for e in c.env}["OMP_NUM_THREADS"] == "8"
    cpu_pod = run.pod("verified_envs", ["python", "-m", "stages.step", "verified_envs"], {}, tmp_path)
    assert "nvidia.com/gpu" not in cpu_pod.spec.containers[0].resources.limits  # validation needs no GPU
    bad = run.model_copy(update={"tolerations": [{"key": "x", "operatr": "Exists"}]})
    with pytest.raises(Exception, match="operatr"):
        bad.pod("sao_expert", cmd, {}, tmp_path)
    with pytest.raises(dg.Failure, match="needs `image`"):
        StageRunner(kind="k8s").pod("sao_expert", cmd, {}, tmp_path)
