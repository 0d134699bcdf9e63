"""The frontier curriculum: the probe's figures by hand, the mix it chooses (saturated rungs give way, the frontier
is tried, the rest follows the signal), and the RL set it draws, disjoint from the held-out set."""

from collections import Counter

import pytest

import configs
import stages
from envs.config import CurriculumConfig
from envs.dataset import read_dataset
from envs.generator import task_content
from stages.curriculum import choose_mix, interleave, pattern_figures
from stages.env_sets import HeldOutLeak, build_sets
from trainers.sft import pattern_key


def fig(sampled: float, signal: float, mixed: float = 0.0) -> dict:
    return {"tasks": 10, "samples": 2, "sampled": sampled, "mixed": mixed, "signal": signal,
            "solved_any": min(1.0, 2 * sampled)}


def test_pattern_figures_by_hand():
    # 3 tasks, 2 samples: one mixed, one always, one never. Unbiased per-task variance c(k-c)/(k(k-1)): 1/2, 0, 0
    f = pattern_figures([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    assert f == {"tasks": 3, "samples": 2, "sampled": 0.5, "mixed": 1 / 3, "signal": 1 / 6, "solved_any": 2 / 3}
    # 4 samples, 2 successes: variance 2·2/(4·3) = 1/3 (the unbiased estimate of p(1-p) = 1/4 is n/(n-1) of it)
    assert pattern_figures([[1, 1, 0, 0]])["signal"] == pytest.approx(1 / 3)
    assert pattern_figures([[0.4, 0.6]])["sampled"] == 0.5  # reward >= 0.5 solves


def test_the_mix_follows_the_signal_and_saturated_rungs_give_way():
    ladder = ["a?horizon=1", "a?horizon=2", "a?horizon=3", "a?horizon=4", "b?horizon=1", "b?horizon=2"]
    figures = {ladder[0]: fig(0.95, 0.02), ladder[1]: fig(0.4, 0.3, 0.6), ladder[2]: fig(0.0, 0.0),
               ladder[3]: fig(0.0, 0.0), ladder[4]: fig(0.2, 0.1, 0.2), ladder[5]: fig(0.3, 0.0)}
    cc = CurriculumConfig(enabled=True, frontier_share=0.05, min_tasks=4)
    mix, why = choose_mix(figures, ladder, 100, cc)
    assert [why[p]["choice"] for p in ladder] == ["saturated", "signal", "frontier", "out of reach", "signal",
                                                  "constant per task"]
    # fixed shares: max(4, 5% of 100) = 5 each (frontier, constant per task); 90 left: 4 each, then 82 by signal
    # 0.3 : 0.1 -> 4 + 61.5 and 4 + 20.5 -> 65 and 24, the one left over to the larger remainder (a tie: b first)
    assert mix == {"a?horizon=2": 65, "a?horizon=3": 5, "b?horizon=1": 25, "b?horizon=2": 5}
    assert sum(mix.values()) == 100
    assert why["a?horizon=1"]["tasks"] == 0 and why["a?horizon=4"]["tasks"] == 0


def test_retained_saturated_rungs_keep_their_tasks_out_of_the_signal_budget():
    ladder = ["a?horizon=1", "a?horizon=2", "a?horizon=3", "a?horizon=4", "b?horizon=1", "b?horizon=2"]
    figures = {ladder[0]: fig(0.95, 0.02), ladder[1]: fig(0.4, 0.3, 0.6), ladder[2]: fig(0.0, 0.0),
               ladder[3]: fig(0.0, 0.0), ladder[4]: fig(0.2, 0.1, 0.2), ladder[5]: fig(1.0, 0.0)}
    cc = CurriculumConfig(enabled=True, frontier_share=0.05, min_tasks=4, retain_tasks=6)
    mix, why = choose_mix(figures, ladder, 100, cc)
    assert [why[p]["choice"] for p in ladder] == ["saturated", "signal", "frontier", "out of reach", "signal",
                                                  "saturated"]
    # the two saturated rungs keep 6 each; the frontier max(4, 5) = 5; 100 - 12 - 5 = 83 by signal 0.3 : 0.1:
    # 4 + 75 x 3/4 = 60.25 and 4 + 75 x 1/4 = 22.75 -> 60 and 22, the one left over to the larger remainder (b)
    assert mix == {"a?horizon=1": 6, "a?horizon=2": 60, "a?horizon=3": 5, "b?horizon=1": 23, "b?horizon=2": 6}
    assert "retain_tasks" in why["b?horizon=2"]["why"] and why["b?horizon=2"]["tasks"] == 6
    # off (the default), the same figures give the saturated rungs nothing
    mix0, _ = choose_mix(figures, ladder, 100, CurriculumConfig(enabled=True, frontier_share=0.05, min_tasks=4))
    assert "a?horizon=1" not in mix0 and sum(mix0.values()) == 100
    # with nothing but saturated rungs the fallback's even mix is unchanged: retention only rides beside a signal
    mix, why = choose_mix({p: fig(1.0, 0.0) for p in ladder[:2]}, ladder[:2], 20, cc)
    assert mix == {"a?horizon=1": 10, "a?horizon=2": 10} and {w["choice"] for w in why.values()} == {"fallback"}
    # only frontier rungs besides the retained ones: they share what retention leaves
    mix, _ = choose_mix({ladder[0]: fig(1.0, 0.0), ladder[1]: fig(0.0, 0.0)}, ladder[:2], 40, cc)
    assert mix == {"a?horizon=1": 6, "a?horizon=2": 34}


def test_the_frontier_is_the_first_unsolved_rung_above_a_reached_one():
    ladder = ["a?horizon=1", "a?horizon=2", "a?horizon=3"]
    cc = CurriculumConfig(enabled=True)
    _, why = choose_mix({ladder[0]: fig(0.0, 0.0), ladder[1]: fig(0.0, 0.0), ladder[2]: fig(0.5, 0.2, 0.4)},
                        ladder, 40, cc)
    assert [why[p]["choice"] for p in ladder] == ["out of reach", "out of reach", "signal"]
    _, why = choose_mix({ladder[0]: fig(1.0, 0.0), ladder[1]: fig(0.0, 0.0), ladder[2]: fig(0.0, 0.0)}, ladder, 40, cc)
    # the easy rung saturates, so the next one is tried; with nothing else to learn from, it holds the whole set
    assert [why[p]["choice"] for p in ladder] == ["saturated", "frontier", "out of reach"]


def test_no_signal_anywhere_falls_back_to_an_even_mix_and_a_small_set_is_an_error():
    ladder = ["a?horizon=1", "a?horizon=2", "b?horizon=1"]
    cc = CurriculumConfig(enabled=True)
    mix, why = choose_mix({p: fig(0.0, 0.0) for p in ladder}, ladder, 31, cc)
    assert mix == {"a?horizon=1": 10, "a?horizon=2": 10, "b?horizon=1": 11}  # ties: the later name
    assert {w["choice"] for w in why.values()} == {"fallback"}
    # only a frontier: it holds the whole set (and with two, they split it)
    mix, why = choose_mix({ladder[0]: fig(1.0, 0.0), ladder[1]: fig(0.0, 0.0), ladder[2]: fig(0.0, 0.0)},
                          [ladder[0], ladder[2], ladder[1]], 30, cc)
    assert mix == {"a?horizon=2": 30} and why["b?horizon=1"]["choice"] == "out of reach"
    mix, _ = choose_mix({ladder[0]: fig(1.0, 0.0), ladder[1]: fig(0.0, 0.0), ladder[2]: fig(0.3, 0.0)}, ladder, 31, cc)
    assert mix == {"a?horizon=2": 16, "b?horizon=1": 15}
    with pytest.raises(ValueError, match="envs.n_rl = 6 is too small"):
        choose_mix({p: fig(0.5, 0.25, 0.5) for p in ladder}, ladder, 6, cc)


def test_a_curriculum_that_cannot_share_the_rl_set_out_is_refused_at_launch():
    # 12 rungs: fixed shares take at most 12 x 5% = 60%, min_tasks 4 x 12 = 48 must fit the other 40%: n_rl >= 120
    configs.load("tiny", ["envs.n_rl=120"])
    with pytest.raises(configs.ConfigError, match=r"envs.n_rl = 119 is too small .* at least 120"):
        configs.load("tiny", ["envs.n_rl=119"])
    with pytest.raises(configs.ConfigError, match=r"envs.curriculum.frontier_share = 0.1: 12 patterns"):
        configs.load("tiny", ["envs.curriculum.frontier_share=0.1"])
    configs.load("tiny", ["envs.n_rl=4", "envs.curriculum.enabled=false"])  # off: no constraint
    # retained rungs count like min_tasks: 8 x 12 / 40% = 240
    configs.load("tiny", ["envs.curriculum.retain_tasks=8"])
    with pytest.raises(configs.ConfigError, match=r"envs.n_rl = 239 is too small .* at least 240 .*retain_tasks = 8"):
        configs.load("tiny", ["envs.n_rl=239", "envs.curriculum.retain_tasks=8"])
    # at the bound, the worst case (every rung fixed but one, the rest at min_tasks) fits exactly
    cc = configs.load("tiny", ["envs.n_rl=120"]).envs.curriculum
    ladder = [f"a?horizon={i}" for i in range(12)]
    figures = {p: fig(0.3, 0.0) for p in ladder[:11]} | {ladder[11]: fig(0.5, 0.2, 0.4)}
    mix, _ = choose_mix(figures, ladder, 120, cc)
    assert sum(mix.values()) == 120 and min(mix.values()) >= cc.min_tasks


def test_interleave_spreads_each_pattern_and_keeps_its_order():
    out = interleave({"a": ["a0", "a1", "a2", "a3"], "b": ["b0", "b1"]})
    assert out == ["a0", "b0", "a1", "a2", "b1", "a3"]


def test_the_rl_set_draws_the_mix_and_the_probe_is_checked_against_the_held_out_set():
    cfg = configs.load("tiny", ["envs.n_eval=24", "envs.n_val=24", "envs.n_rl=30", "envs.curriculum.enabled=false"])
    mix = {"calc-chain?horizon=1": 20, "set-const?horizon=2": 10}
    sets = build_sets(cfg.envs, cfg.base, lambda excluded: (mix, {"curriculum-probe": []}))
    assert Counter(pattern_key(s) for s in sets["rl"]) == mix
    held = {task_content(s) for s in sets["eval"]}
    assert not held & {task_content(s) for s in sets["rl"]}
    # a probe set that holds a held-out task is refused
    with pytest.raises(HeldOutLeak, match="curriculum-probe"):
        build_sets(cfg.envs, cfg.base, lambda excluded: (mix, {"curriculum-probe": [sets["eval"][3]]}))
    # the callback is told what the RL set must not hold: the held-out and validation tasks
    seen = {}
    build_sets(cfg.envs, cfg.base, lambda excluded: (seen.update(x=excluded) or mix, {}))
    assert seen["x"] == held | {task_content(s) for s in sets["val"]}


def test_env_specs_probes_the_policy_and_records_its_choice(tmp_path):
    """The shipped base on three rungs of one family: one it reaches, two above. The figures are the probe's own."""
    ladder = ["calc-chain?horizon=1", "calc-chain?horizon=3", "set-const?horizon=1"]
    cfg = configs.load("tiny", ["envs.n_eval=6", "envs.n_val=6", "envs.n_rl=24", "envs.curriculum.probe_tasks=3",
                                "envs.curriculum.min_tasks=2", f"envs.rl_patterns={ladder!r}".replace("'", '"')])
    out = stages.env_specs(cfg, tmp_path / "e", iteration=1)
    cur = out["curriculum"]
    assert cur["policy"].endswith("tiny-base") and cur["probe_episodes"] == 3 * 2 * 3
    assert set(cur["figures"]) == set(ladder) and all(f["tasks"] == 3 for f in cur["figures"].values())
    rl = read_dataset(out["rl"])
    assert len(rl) == 24 and Counter(pattern_key(s) for s in rl) == Counter(cur["mix"])
    for p, c in cur["choice"].items():
        assert c["tasks"] == cur["mix"].get(p, 0)
        if cur["figures"][p]["sampled"] >= cfg.envs.curriculum.saturated:
            assert c["choice"] == "saturated" and c["tasks"] == 0
    assert (tmp_path / "e" / "curriculum.json").exists()
