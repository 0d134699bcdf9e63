"""A materialisation is a function of its inputs. Before this, `sao_experts` reused any `experts/<domain>/result.json`
whatever the config: re-materialising it with `loop.steps=3` returned the 1-step experts in 97 ms and said nothing.
Now each asset records the inputs its result was computed from (the config it reads, its parents' data versions, its
code version) next to the result: unchanged inputs reuse it and say so, changed ones clear the stage's working files
and recompute, and a repaired or retried step on the same inputs resumes from what the earlier attempt kept."""

import ast
import json
from pathlib import Path

import dagster as dg
import pytest

import assets.iteration as iteration
from assets import ALL_ASSETS, ITERATIONS, TemperResource
from pipelines.definitions import make_resources

ROOT = Path(__file__).resolve().parents[2]
STAGE_OF = {"sao_experts": "sao_expert"}  # asset → its stage function, where the names differ


def _config_paths(tree: ast.Module, name: str, seen: set[str]) -> set[str]:
    """The config paths stage function `name` reads (`cfg.section` passed on whole, or `cfg.section.leaf`), through
    the module's functions it hands `cfg` to; `under_torchrun` re-runs the same stage, so it reads nothing more."""
    fns = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    if name in seen:
        return set()
    seen.add(name)
    parent = {c: n for n in ast.walk(fns[name]) for c in ast.iter_child_nodes(n)}
    out: set[str] = set()
    for n in ast.walk(fns[name]):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "cfg":
            up = parent.get(n)
            leaf = isinstance(up, ast.Attribute) and up.value is n
            called = leaf and isinstance(parent.get(up), ast.Call) and parent[up].func is up  # cfg.envs.model_copy()
            out.add(f"{n.attr}.{up.attr}" if leaf and not called else n.attr)
        if isinstance(n, ast.Call) and any(isinstance(a, ast.Name) and a.id == "cfg"
                                           for a in [*n.args, *(k.value for k in n.keywords)]):
            callee = ast.unparse(n.func)
            if callee == "under_torchrun":
                continue
            assert callee in fns, f"{name} hands the whole config to {callee}: key on every section"
            out |= _config_paths(tree, callee, seen)
    return out


def test_each_stage_is_keyed_on_every_config_path_it_reads():
    from stages.inputs import CONFIG_READS

    # every stage module's functions in one tree (stages/ holds one module per stage or group of stages)
    tree = ast.Module(body=[n for f in sorted((ROOT / "stages").glob("*.py")) for n in ast.parse(f.read_text()).body],
                      type_ignores=[])
    for asset, declared in CONFIG_READS.items():
        if asset == "rewards":  # takes no config: the asset passes envs.mine_every
            continue
        read = _config_paths(tree, STAGE_OF.get(asset, asset), set())
        missing = {p for p in read if not any(p == d or p.startswith(d + ".") for d in declared)}
        assert not missing, f"{asset} reads {sorted(missing)} but its input key does not hold them"
    assert "loop.steps" in _config_paths(tree, "sao_expert", set()) | {"loop"}


def test_a_memo_reuses_resumes_and_clears(tmp_path):
    from stages.inputs import Memo, result_id

    inputs = {"config": {"loop": {"steps": 1}}, "upstream": {"rewards": "a"}, "code_version": "c1"}
    work = tmp_path / "experts"
    m = Memo(tmp_path, "sao_experts", inputs, [work])
    assert m.reusable() is None and m.prepare("run-1") == []
    (work / "math").mkdir(parents=True)
    (work / "math" / "state").write_text("step 2")  # what a killed attempt kept
    again = Memo(tmp_path, "sao_experts", json.loads(json.dumps(inputs)), [work])
    assert again.prepare("run-1") == [] and (work / "math" / "state").read_text() == "step 2"  # it resumes from it
    rid = again.save({"math": {"steps": 1, "seconds": 3.0}}, "run-1")
    assert rid == result_id({"math": {"steps": 1, "seconds": 9.9}})  # how long it took is not what it computed
    got, rec = Memo(tmp_path, "sao_experts", inputs, [work]).reusable()
    assert got == {"math": {"steps": 1, "seconds": 3.0}} and rec["run_id"] == "run-1"
    changed = {**inputs, "config": {"loop": {"steps": 3}}}
    m3 = Memo(tmp_path, "sao_experts", changed, [work])
    assert m3.reusable() is None
    assert m3.prepare("run-2") == ["config.loop.steps: 1 → 3"]
    assert not work.exists() and not (tmp_path / "sao_experts.json").exists()
    assert Memo(tmp_path, "sao_experts", inputs, [work]).reusable() is None  # the old key's record is gone too


def test_a_recorded_result_is_not_reused_when_it_or_its_checkpoint_changed(tmp_path):
    from stages.inputs import Memo

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "temper.json").write_text(json.dumps({"checksum": "aaa"}))
    m = Memo(tmp_path, "warm_start", {"k": 1})
    m.prepare()
    m.save({"checkpoint": str(ck), "source": "sft"})
    assert Memo(tmp_path, "warm_start", {"k": 1}).reusable() is not None
    (ck / "temper.json").write_text(json.dumps({"checksum": "bbb"}))  # rewritten at the same path
    assert Memo(tmp_path, "warm_start", {"k": 1}).reusable() is None
    m.save({"checkpoint": str(ck), "source": "sft"})
    (tmp_path / "warm_start.json").write_text(json.dumps({"checkpoint": str(ck), "source": "base"}))  # edited
    assert Memo(tmp_path, "warm_start", {"k": 1}).reusable() is None
    # a directory holding working files but no record of their inputs is not resumed from
    (tmp_path / "w").mkdir()
    fresh = Memo(tmp_path / "other", "warm_start", {"k": 1}, [tmp_path / "w"])
    assert fresh.prepare() == ["working files without a record of their inputs"] and not (tmp_path / "w").exists()


@pytest.fixture
def instance(tmp_path):
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        inst.add_dynamic_partitions(ITERATIONS.name, ["1"])
        yield inst


def _report(instance, asset: str, result: dict) -> None:
    instance.report_runless_asset_event(dg.AssetMaterialization(
        asset, partition="1", metadata={"result": dg.MetadataValue.json(result)}))


def test_sao_experts_recompute_on_changed_config_or_upstream_and_reuse_otherwise(instance, tmp_path, monkeypatch):
    """`sao_experts` alone, its stage stubbed (the result says how many steps the config asked for): changed
    `loop.steps` gives the new result, an unchanged re-run the recorded one with `reused` in its metadata, a new
    warm start recomputes; a repaired run keeps the experts its failed attempt finished."""
    calls: list[tuple[str, int]] = []
    fail_on: set[str] = set()

    def stage(context, pipes, temper, sandbox, trainer, name, materialize=True, mlflow_stage=None, **kw):
        if kw["domain"] in fail_on:
            raise dg.Failure("killed", allow_retries=False)
        steps = temper.config().loop.steps
        calls.append((kw["domain"], steps))
        Path(kw["out"]).mkdir(parents=True, exist_ok=True)
        return {"checkpoint": kw["out"] + "/checkpoint", "steps": steps, "domain": kw["domain"], "init": kw["checkpoint"]}, None

    monkeypatch.setattr(iteration, "_stage", stage)
    monkeypatch.setattr(iteration, "_track", lambda *a, **k: {})
    _report(instance, "verified_envs", {"domains": ["code", "math"], "rl": "/nowhere"})
    _report(instance, "warm_start", {"checkpoint": "/ws/1"})
    _report(instance, "rewards", {"domains": {}, "quarantined": []})

    def run(steps: int):
        res = dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.keys("sao_experts"), partition_key="1",
                             instance=instance, raise_on_error=False, resources=make_resources(TemperResource(
                                 preset="micro", overrides=[f"loop.steps={steps}"], run_root=str(tmp_path / "runs"))))
        mats = res.get_asset_materialization_events()
        return res, (mats[0].materialization if mats else None)

    fail_on.add("math")  # the first attempt dies after the code expert finished
    res, _ = run(1)
    assert not res.success and calls == [("code", 1)]
    fail_on.clear()
    res, m = run(1)  # repaired on the same inputs: the code expert is kept, only math computes
    assert res.success and calls == [("code", 1), ("math", 1)]
    assert m.metadata["code_steps"].value == m.metadata["math_steps"].value == 1

    res, m = run(3)  # the issue: this returned the 1-step experts
    assert calls[2:] == [("code", 3), ("math", 3)]
    assert m.metadata["math_steps"].value == 3 and m.metadata["reused"].value is False
    assert "config.loop.steps: 1 → 3" in m.metadata["recomputed_because"].value
    recorded = json.loads((tmp_path / "runs" / "iteration-0001" / "sao_experts.json").read_text())
    assert recorded["math"]["steps"] == 3
    first = res.run_id

    res, m = run(3)  # unchanged: the recorded result, said so
    assert len(calls) == 4 and m.metadata["reused"].value is True and m.metadata["reused_from_run"].value == first
    assert m.metadata["result"].value == recorded and m.metadata["math_steps"].value == 3
    assert any("reusing the result computed by run" in (e.message or "") for e in instance.all_logs(res.run_id))
    from stages.inputs import result_id

    assert m.tags["dagster/data_version"] == result_id(recorded)  # what its children's keys hold

    _report(instance, "warm_start", {"checkpoint": "/ws/2"})  # a new warm start upstream
    res, m = run(3)
    assert calls[4:] == [("code", 3), ("math", 3)] and m.metadata["result"].value["math"]["init"] == "/ws/2"


def test_a_stage_recomputed_on_other_inputs_logs_into_its_own_mlflow_run(instance, tmp_path, monkeypatch):
    """An MLflow run's params cannot change, so a stage recomputed on changed inputs (here `loop.steps`, which
    changes the expert's `skipped` param) failed every retry with "Changing param values is not allowed" while it
    logged into the run of its earlier inputs. Each set of inputs now has its own stage run; a rerun on the same
    inputs reuses the result and adds none."""
    from store.tracking import Tracker

    def stage(context, pipes, temper, sandbox, trainer, name, materialize=True, mlflow_stage=None, **kw):
        steps = temper.config().loop.steps
        Path(kw["out"]).mkdir(parents=True, exist_ok=True)
        return {"checkpoint": kw["out"] + "/checkpoint", "steps": steps, "domain": kw["domain"],
                "init": kw["checkpoint"], "skipped": None if steps == 1 else "saturated"}, None

    monkeypatch.setattr(iteration, "_stage", stage)
    _report(instance, "verified_envs", {"domains": ["code"], "rl": "/nowhere"})
    _report(instance, "warm_start", {"checkpoint": "/ws/1"})
    _report(instance, "rewards", {"domains": {}, "quarantined": []})

    def run(steps: int) -> bool:
        return dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.keys("sao_experts"), partition_key="1",
                              instance=instance, raise_on_error=False, resources=make_resources(TemperResource(
                                  preset="micro", overrides=[f"loop.steps={steps}"],
                                  run_root=str(tmp_path / "runs")))).success

    tr = Tracker(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")

    def stage_runs():
        got = tr.client.search_runs([tr.experiment_id], "tags.temper_stage = 'sao_expert_code'",
                                    order_by=["attributes.start_time ASC"])
        return [(r.data.params.get("skipped"), r.data.params.get("steps") or r.data.metrics.get("steps"),
                 r.data.tags.get("temper_input_key")) for r in got]

    assert run(1)
    assert run(3)  # before: MlflowException, param 'skipped' changing from 'no' to 'saturated'
    runs = stage_runs()
    assert [(s, n) for s, n, _ in runs] == [("no", 1.0), ("saturated", 3.0)] and runs[0][2] != runs[1][2]
    assert run(3)  # the same inputs: the recorded result, no third run
    assert len(stage_runs()) == 2
