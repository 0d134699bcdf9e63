"""Each run root keeps its own lineage. The Dagster instance (`runs/dagster_home`) and its iteration partitions are
shared by every run root, so before this a `temper run --run-root NEW` went on from another root's last iteration and
took that root's student as its warm start (seen here: a micro run's hand-off became another run's parent). Now the
next iteration is counted in the run root itself, the warm start takes only its own root's N−1, and a hand-off of
another model than the preset's is refused with a message."""

import dagster as dg
import pytest
import torch

import configs
import stages
from assets.iteration import POLICY_KEY, _handed_off
from model import Transformer, save_checkpoint
from pipelines.run_cli import next_iteration


def test_the_next_iteration_is_counted_in_the_run_root(tmp_path):
    root = tmp_path / "root"
    assert next_iteration(root) == (1, False)  # a fresh run root starts at 1, whatever the instance holds
    (root / "iteration-0001").mkdir(parents=True)
    assert next_iteration(root) == (1, True)  # started, no evaluation: repaired, not skipped
    (root / "iteration-0001" / "evaluation.json").write_text("{}")
    assert next_iteration(root) == (2, False)
    (root / "iteration-0002").mkdir()
    (root / "iteration-0002" / "evaluation.json").write_text("{}")
    (root / "iteration-notes").mkdir()  # not an iteration
    assert next_iteration(root) == (3, False)
    assert next_iteration(tmp_path / "other") == (1, False)


class _Context:
    def __init__(self, instance):
        self.instance = instance


def _record(instance, iteration: int, root, student: str, warm: str, champion: bool, with_root: bool = True):
    meta = {"iteration": iteration, "checkpoint": dg.MetadataValue.path(student),
            "warm_start": dg.MetadataValue.path(warm), "champion": champion}
    if with_root:
        meta["run_root"] = dg.MetadataValue.path(str(root))
    instance.report_runless_asset_event(dg.AssetMaterialization(POLICY_KEY, metadata=meta))


def test_the_warm_start_takes_its_own_run_roots_hand_off(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with dg.DagsterInstance.ephemeral() as instance:
        ctx = _Context(instance)
        _record(instance, 1, a, f"{a}/iteration-0001/opd/checkpoint", f"{a}/base", champion=True)
        _record(instance, 1, b, f"{b}/iteration-0001/opd/checkpoint", f"{b}/base", champion=False)  # the newest
        assert _handed_off(ctx, "2", "champion", a)[0] == f"{a}/iteration-0001/opd/checkpoint"
        assert _handed_off(ctx, "2", "champion", b)[0] == f"{b}/base"  # not a's student, though a's is a champion
        _record(instance, 2, a, f"{a}/iteration-0002/opd/checkpoint", f"{a}/x", champion=True)
        with pytest.raises(dg.Failure, match=r"iteration 2 ran in .*/a only: each run root keeps its own lineage"):
            _handed_off(ctx, "3", "champion", b)  # b has no iteration 2: a's is not its parent
        assert _handed_off(ctx, "1", "champion", b) == (None, "none")
        # a record written before `run_root` was kept: its root is read off the student's path
        _record(instance, 3, a, f"{a}/iteration-0003/opd/checkpoint", f"{a}/y", champion=True, with_root=False)
        assert _handed_off(ctx, "4", "champion", a)[0] == f"{a}/iteration-0003/opd/checkpoint"
        with pytest.raises(dg.Failure, match="ran in"):
            _handed_off(ctx, "4", "champion", b)


def test_a_hand_off_of_another_model_is_refused_with_the_keys(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(Transformer(configs.load("micro").model), tmp_path / "micro")
    envs = {"train": None}
    with pytest.raises(ValueError, match=r"another model than this preset's \(hidden_size: 64 there, 128 here"):
        stages.warm_start(configs.load("tiny"), envs, tmp_path / "ws", str(tmp_path / "micro"))
    got = stages.warm_start(configs.load("micro"), envs, tmp_path / "ws", str(tmp_path / "micro"))
    assert got["checkpoint"] == str(tmp_path / "micro") and got["source"] == "previous iteration"


def test_a_base_checkpoint_of_another_model_is_refused_with_the_keys():
    from pathlib import Path

    base = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-base"  # tiny's shipped base, on micro
    with pytest.raises(ValueError, match=r"base.checkpoint .* another model than this preset's \(hidden_size: 128 there"):
        stages.warm_start(configs.load("micro", [f"base.checkpoint={base}"]), {"train": None}, Path("/nonexistent"),
                          None)


def test_a_base_trained_on_another_recipe_than_the_presets_is_refused_at_launch_and_at_each_stage(tmp_path):
    """The held-out set is kept disjoint from the preset's `base` recipe; a base whose card records another recipe
    would leave its training tasks in the held-out set, so the launch check, `env_specs` and `warm_start` refuse it
    and name the keys. The shipped base's card matches tiny's recipe."""
    import json
    import shutil
    from pathlib import Path

    from assets.launch import LaunchRefused, check_run_config
    from stages.warm import check_recipe, recipe_mismatch

    shipped = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-base"
    tiny = configs.load("tiny")
    card = json.loads((shipped / "card.json").read_text())
    assert recipe_mismatch(card, tiny.base) == []
    check_recipe(tiny.base)
    moved = card["recipe"]["phase2"]["add_patterns"][:]
    card["recipe"]["data_seed"] += 1
    card["recipe"]["phase2"]["add_patterns"] = [*moved, "calc-chain?horizon=9"]
    assert recipe_mismatch(card, tiny.base) == [
        f"base.data_seed: {tiny.base.data_seed + 1} on the card, {tiny.base.data_seed} here",
        "base.curriculum / base.phase2.add_patterns: only on the card ['calc-chain?horizon=9'], only here []"]
    card["recipe"]["data_seed"] -= 1
    card["recipe"]["phase2"]["add_patterns"] = moved
    first = card["recipe"]["curriculum"][0]["patterns"]
    card["recipe"]["curriculum"][0]["patterns"] = first[::-1]  # the same patterns, drawn with each other's seeds
    assert recipe_mismatch(card, tiny.base) == [
        "base.curriculum / base.phase2.add_patterns: the same patterns in another order (a pattern's data seed is its "
        "place)"]
    card["recipe"]["curriculum"][0]["patterns"] = first
    card["recipe"]["phase2"]["add_patterns"] = [*moved, "calc-chain?horizon=9"]
    other = tmp_path / "other-base"
    shutil.copytree(shipped, other)
    (other / "card.json").write_text(json.dumps(card))
    cfg = configs.load("tiny", [f"base.checkpoint={other}"])
    with pytest.raises(LaunchRefused, match=r"trained on another .*only on the card \['calc-chain\?horizon=9'\]"):
        check_run_config({"resources": {"temper": {"config": {"preset": "tiny",
                                                                "overrides": [f"base.checkpoint={other}"]}}}})
    with pytest.raises(ValueError, match="set these keys to its card's recipe"):
        stages.env_specs(cfg, tmp_path / "envs")
    assert not (tmp_path / "envs").exists()  # refused before any set was written
    with pytest.raises(ValueError, match=r"trained on another \(base.curriculum .*set these keys to its card's recipe"):
        stages.warm_start(cfg, {"train": None}, tmp_path / "ws", None)
