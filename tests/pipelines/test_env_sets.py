"""Held out means held out: every set's seeds are hashed from its purpose, and the held-out set shares no task (by
content) with the base recipe's demonstrations, the validation, SFT and RL sets, or itself."""

from collections import Counter

import pytest

import configs
import stages
from envs.dataset import read_dataset
from envs.families import get_family
from envs.generator import data_seed, generate, generate_disjoint, parse_pattern, task_content
from stages.env_sets import HeldOutLeak, base_recipe_contents, build_sets, check_disjoint


def test_seeds_differ_by_purpose_and_the_base_recipe_keeps_its_own():
    assert len({data_seed(p, 7, "calc-chain?horizon=1", 0) for p in ("held-out", "validation", "rl", "sft")}) == 4
    assert data_seed("rl", 7, "calc-chain?horizon=1", 0) != data_seed("rl", 7, "calc-chain?horizon=1", 1)
    assert data_seed("rl", 7, "calc-chain?horizon=1", 0) != data_seed("rl", 7, "calc-chain?horizon=2", 0)
    # without a purpose: the formula the shipped base's recipe was drawn with (trainers/base.py), unchanged
    legacy = generate(["set-const?horizon=1"], 3, 7)
    name, knobs = parse_pattern("set-const?horizon=1")
    assert [s.spec_hash for s in legacy] == [get_family(name).make(7 * 1_000_003 + i, knobs).spec_hash for i in range(3)]


def test_the_old_seeds_leaked_base_data_into_the_held_out_set_and_the_new_ones_do_not():
    """The instrument catches the leak the review found: with plain seeds, tiny's `envs.eval_seed` (10,007) is the
    base recipe's data seed of its careless one-constant edits (7 + 1000 × 10). (The held-out patterns of the time.)"""
    cfg = configs.load("tiny", ['envs.eval_patterns=["kv-lookup?horizon=1&keys=2", "kv-lookup?horizon=2&keys=1", '
                                '"calc-chain?horizon=1", "calc-chain?horizon=2", "set-const?horizon=1", '
                                '"set-const?horizon=2"]'])
    base = base_recipe_contents(cfg.base)
    old = generate(cfg.envs.held_out_patterns, cfg.envs.n_eval, cfg.envs.eval_seed)
    leaked = [s for s in old if task_content(s) in base]
    assert len(leaked) >= 40 and {s.family for s in leaked} >= {"set-const"}
    sets = build_sets(cfg.envs, cfg.base)
    assert len(sets["eval"]) == cfg.envs.n_eval and not {task_content(s) for s in sets["eval"]} & base
    assert Counter(s.family for s in sets["eval"]) == Counter(s.family for s in old)  # the same mix of patterns


def test_every_set_of_an_iteration_is_disjoint_from_the_held_out_set(tmp_path):
    cfg = configs.load("tiny", ["envs.n_eval=120", "envs.n_val=120", "envs.n_rl=120", "envs.n_train=60",
                                "envs.curriculum.enabled=false"])  # (the curriculum's RL set: test_curriculum.py)
    for it in (1, 2):
        out = stages.env_specs(cfg, tmp_path / f"e{it}", iteration=it)
        got = {k: read_dataset(out[k]) for k in ("eval", "val", "rl", "train")}
        assert {k: len(v) for k, v in got.items()} == {"eval": 120, "val": 120, "rl": 120, "train": 60}
        held = {task_content(s) for s in got["eval"]}
        assert len(held) == 120  # no task twice
        for k in ("val", "rl", "train"):
            assert not held & {task_content(s) for s in got[k]}, k
        assert not {task_content(s) for s in got["val"]} & {task_content(s) for s in got["rl"]}
        assert not held & base_recipe_contents(cfg.base)
        assert out["skipped"]["eval"] >= 0 and set(out["skipped"]) == {"eval", "val", "rl", "train"}


def test_a_skipped_task_is_replaced_by_its_pattern_s_next_draw():
    pats = ["calc-chain?horizon=1", "set-const?horizon=1"]
    first, _ = generate_disjoint(pats, 10, 3, "rl")
    banned = {task_content(s) for s in first[:4]}
    again, skipped = generate_disjoint(pats, 10, 3, "rl", banned)
    assert skipped >= 4 and len(again) == 10
    assert not banned & {task_content(s) for s in again}
    assert [s.family for s in again] == [s.family for s in first]  # the cycle of patterns is kept
    assert {task_content(s) for s in first[4:]} <= {task_content(s) for s in again}  # the rest kept, moved up
    with pytest.raises(ValueError, match="distinct tasks"):  # a task space smaller than asked is an error
        generate_disjoint(["kv-lookup?horizon=1&keys=1"], 10, 3, "rl", max_tries=1,
                          exclude={task_content(s) for s in generate_disjoint(["kv-lookup?horizon=1&keys=1"], 10, 3,
                                                                               "rl")[0]})


def test_check_disjoint_names_the_sets_and_the_task():
    a = generate(["calc-chain?horizon=1"], 3, 1, "held-out")
    b = generate(["calc-chain?horizon=1"], 3, 1, "rl")
    check_disjoint({"eval": a, "rl": b})
    with pytest.raises(HeldOutLeak, match=r"the rl and eval sets share a task"):
        check_disjoint({"eval": a, "rl": [*b, a[1]]})
    with pytest.raises(HeldOutLeak, match=r"the eval set holds task .* twice"):
        check_disjoint({"eval": [*a, a[0]]})
