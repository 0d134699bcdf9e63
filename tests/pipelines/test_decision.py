"""The champion decision reads the validation set, paired, and never the held-out set."""

from dataclasses import dataclass
from math import comb

import pytest

from stages.decision import validation_decision, warm_rewards_from_gate


@dataclass
class Spec:
    id: str
    domain: str


@dataclass
class Traj:
    reward: float


def _runner(rewards: dict[str, dict[str, float]], calls: list):
    def run(ckpt, specs, who):
        calls.append((ckpt, who, [s.id for s in specs]))
        return {"trajectories": [Traj(rewards[ckpt][s.id]) for s in specs]}
    return run


def test_the_decision_pairs_student_and_warm_start_on_validation_and_reuses_the_gate_s_outcomes():
    val = [Spec(f"t{i}", "math" if i % 2 else "code") for i in range(14)]
    # the student solves t0..t11, the warm start only t10..t13: 10 gained, 2 lost
    student = {f"t{i}": float(i < 12) for i in range(14)}
    warm = {f"t{i}": float(i >= 10) for i in range(14)}
    calls: list = []
    known = {k: v for k, v in warm.items() if k in ("t0", "t1", "t2", "t13")}  # what OPD's gate already played
    d = validation_decision(val, "/ckpt/s", "/ckpt/w", known, _runner({"/ckpt/s": student, "/ckpt/w": warm}, calls),
                            lambda m: None)
    # the warm start plays only the 10 tasks the gate did not
    assert calls[0] == ("/ckpt/s", "val:student", [s.id for s in val])
    assert calls[1][:2] == ("/ckpt/w", "val:warm_start") and sorted(calls[1][2]) == sorted(
        s.id for s in val if s.id not in known)
    assert (d["gained"], d["lost"], d["n"], d["warm_start_reused"]) == (10, 2, 14, 4)
    # exact McNemar by hand: two-sided binomial tail of min(10, 2) in 12 flips at 1/2
    p = min(1.0, 2 * sum(comb(12, k) for k in range(3)) / 2**12)
    assert d["p_value"] == pytest.approx(p) and d["significant"] is (p < 0.05)
    assert d["pass@1_after"] == pytest.approx(12 / 14) and d["pass@1_before"] == pytest.approx(4 / 14)
    assert d["set"] == "validation"
    assert d["better"] and d["domains_fell"] == []


def test_a_student_that_gains_overall_but_loses_a_domain_significantly_is_not_better():
    # code: 20 gained, 0 lost; math: 0 gained, 8 lost (two-sided p = 2 / 2**8 < 0.05): 20 / 8 overall
    val = [Spec(f"c{i}", "code") for i in range(20)] + [Spec(f"m{i}", "math") for i in range(8)]
    student = {**{f"c{i}": 1.0 for i in range(20)}, **{f"m{i}": 0.0 for i in range(8)}}
    warm = {**{f"c{i}": 0.0 for i in range(20)}, **{f"m{i}": 1.0 for i in range(8)}}
    d = validation_decision(val, "/s", "/w", {}, _runner({"/s": student, "/w": warm}, []), lambda m: None)
    assert (d["gained"], d["lost"]) == (20, 8) and d["domains_fell"] == ["math"] and not d["better"]
    # one math task fewer lost (7 of 7: p = 2 / 2**7 = 0.016) still falls; a loss of 5 of 5 (p = 0.0625) does not
    for n, falls in ((7, True), (5, False)):
        v = val[:20] + val[20:20 + n]
        d = validation_decision(v, "/s", "/w", {}, _runner({"/s": student, "/w": warm}, []), lambda m: None)
        assert (d["domains_fell"] == ["math"]) is falls and d["better"] is (not falls)


def test_a_student_that_gains_no_more_tasks_than_it_loses_is_not_better():
    val = [Spec(f"t{i}", "code") for i in range(6)]
    student = {f"t{i}": float(i < 3) for i in range(6)}
    warm = {f"t{i}": float(i >= 3) for i in range(6)}
    d = validation_decision(val, "/s", "/w", {}, _runner({"/s": student, "/w": warm}, []), lambda m: None)
    assert (d["gained"], d["lost"]) == (3, 3) and not d["better"] and not d["significant"]


def test_a_student_equal_to_its_warm_start_is_played_once_and_is_no_gain():
    val = [Spec(f"t{i}", "code") for i in range(4)]
    calls: list = []
    d = validation_decision(val, "/c/x", "/c/x", {}, _runner({"/c/x": {s.id: 1.0 for s in val}}, calls), print)
    assert len(calls) == 1 and d["gained"] == d["lost"] == 0 and not d["significant"] and not d["better"]


def test_only_the_gate_s_outcomes_of_the_same_checkpoint_are_reused(tmp_path):
    (tmp_path / "w").mkdir()
    opd = {"gate": {"code": {"warm_ckpt": str((tmp_path / "w").resolve()), "warm_rewards": {"a": 1.0}},
                    "math": {"warm_ckpt": str((tmp_path / "other").resolve()), "warm_rewards": {"b": 0.0}},
                    "reasoning": {"teaches": True}}}
    assert warm_rewards_from_gate(opd, str(tmp_path / "w") + "/") == {"a": 1.0}
    assert warm_rewards_from_gate({}, str(tmp_path / "w")) == {}
