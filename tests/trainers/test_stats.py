"""Evaluation statistics against hand computations."""


import pytest

from trainers.stats import binom_two_sided, compare, mcnemar_exact, significant_gain, summarize, wilson


def test_wilson_matches_the_closed_form_by_hand():
    # k = 5, n = 10, z = 1.96: centre (0.5 + 1.9208/10) / (1 + 3.8416/10) = 0.5; half-width
    # 1.96 * sqrt(0.025 + 3.8416/400) / 1.38416 = 0.26340
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.5 - 0.26340, abs=2e-4) and hi == pytest.approx(0.5 + 0.26340, abs=2e-4)
    # k = 0: the interval starts at 0 and is not degenerate (the normal approximation would give [0, 0])
    lo, hi = wilson(0, 40)
    assert lo == 0.0 and hi == pytest.approx(3.8415 / (40 + 3.8415), abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson(5, 4)


def test_exact_mcnemar_counts_flips_and_matches_the_binomial_by_hand():
    before = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0]
    after = [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0]
    t = mcnemar_exact(before, after)
    assert (t["gained"], t["lost"], t["both"], t["neither"]) == (8, 1, 2, 1)
    # 9 discordant pairs, 1 in the minority: p = 2 * (C(9,0) + C(9,1)) / 2^9
    assert t["p_value"] == pytest.approx(2 * (1 + 9) / 512)
    assert t["delta"] == pytest.approx(7 / 12)
    assert significant_gain(t)
    assert not significant_gain(mcnemar_exact(after, before))  # the same flips the other way are a loss
    # symmetric split: p = 1
    assert binom_two_sided(3, 6) == pytest.approx(1.0)
    assert binom_two_sided(0, 5) == pytest.approx(2 / 32)
    with pytest.raises(ValueError, match="pair the same tasks"):
        mcnemar_exact([1, 0], [1])


def test_compare_groups_and_overall():
    out = compare({"math": [0, 0, 1], "code": [1, 1]}, {"math": [1, 1, 1], "code": [1, 0]})
    assert out["math"]["test"]["gained"] == 2 and out["code"]["test"]["lost"] == 1
    assert out["all"]["before"]["k"] == 3 and out["all"]["after"]["k"] == 4 and out["all"]["test"]["n"] == 5
    s = summarize([1, 0, 0, 1])
    assert s["pass@1"] == 0.5 and s["ci95"][0] < 0.5 < s["ci95"][1]


def test_paired_delta_interval_by_hand():
    from trainers.stats import paired_delta_ci

    # 30 gained, 10 lost of 200: Δ = 0.1, var = (40 − 400/200)/200² = 38/40000, se = 0.030822
    lo, hi = paired_delta_ci(30, 10, 200)
    assert abs((lo + hi) / 2 - 0.1) < 1e-12 and abs((hi - lo) / 2 - 1.959964 * 0.0308221) < 1e-6
    # no flips: a point; all flips one way still has width from the count
    assert paired_delta_ci(0, 0, 50) == (0.0, 0.0)
    lo, hi = paired_delta_ci(5, 0, 100)
    assert lo > 0 and abs(hi + lo - 0.1) < 1e-12


def test_headroom_reads_greedy_and_sampled_rewards_by_hand(monkeypatch):
    """bench/headroom.py's figures for three tasks, k = 4 samples each, worked out by hand."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from headroom import headroom

    h = headroom([1.0, 0.0, 0.0], [[1, 1, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0]])
    assert h["n"] == 3 and h["greedy"] == pytest.approx(1 / 3) and h["greedy_ci"] == wilson(1, 3)
    assert h["sampled"] == pytest.approx(4 / 12)  # 3 + 0 + 1 successes in 12 samples
    assert h["pass_at_k"] == pytest.approx(2 / 3) and h["pass_at_k_ci"] == wilson(2, 3)  # tasks 1 and 3
    assert h["mixed"] == pytest.approx(2 / 3)  # tasks 1 and 3 both succeed and fail; task 2 never succeeds
    assert headroom([1.0], [[1, 1]])["mixed"] == 0.0  # always solved: nothing for one rollout to learn from


def test_math_levers_classifies_each_failure_by_hand(monkeypatch):
    """bench/math_levers.py's failure classes on a two-operation chain: 40, add 12, then multiply by 3 (= 156)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from math_levers import classify

    from envs.actions import Action

    hidden = {"start": 40, "steps": [["add", 12], ["mul", 3]]}

    def calls(*exprs, submit="156"):
        return [Action("calc", {"expr": e}) for e in exprs] + ([Action("submit", {"answer": submit})] if submit else [])

    assert classify(hidden, calls("40+12", "25*3")) == "copy"        # the chain is at 52, not 25
    assert classify(hidden, calls("40+12", "52+3")) == "operand"     # multiply, not add
    assert classify(hidden, calls("40+12", submit="52")) == "early"   # the careless way: one operation short
    assert classify(hidden, calls("40+12", "52*3", submit="165")) == "submit"  # right calls, wrong number sent
    assert classify(hidden, calls("40+12", "52*3", submit=None)) == "other"
    assert classify(hidden, calls("forty plus 12")) == "other"
