"""The scaling curve: ScaleRL's sigmoid by hand, its fit recovering known parameters, the bootstrap's intervals, the
chain of handed-off policies read from a run root, and the forecast check."""

import json
import math

import numpy as np
import pytest

from stages.scaling import bootstrap, chain_points, curve_table, fit_curve, scaling, sigmoid_curve


def test_the_curve_by_hand():
    r0, a, b, c_mid = 0.3, 0.8, 1.5, 100.0
    assert sigmoid_curve([0.0], r0, a, b, c_mid)[0] == r0
    assert sigmoid_curve([c_mid], r0, a, b, c_mid)[0] == pytest.approx((r0 + a) / 2)
    # at C = 2 C_mid: R0 + (A − R0) / (1 + 2^−B)
    assert sigmoid_curve([200.0], r0, a, b, c_mid)[0] == pytest.approx(r0 + 0.5 / (1 + 2 ** -1.5))
    assert sigmoid_curve([1e12], r0, a, b, c_mid)[0] == pytest.approx(a, abs=1e-6)


def test_the_fit_recovers_known_parameters():
    r0, a, b, c_mid = 0.30, 0.75, 1.3, 4.0e4
    c = [1e4, 3e4, 6e4, 1.2e5]
    r = list(sigmoid_curve(c, r0, a, b, c_mid))
    f = fit_curve(c, r, r0)
    assert f["A"] == pytest.approx(a, abs=2e-3) and f["B"] == pytest.approx(b, rel=1e-2)
    assert f["C_mid"] == pytest.approx(c_mid, rel=1e-2) and f["rss"] < 1e-10
    with pytest.raises(ValueError, match="needs 3 points"):
        fit_curve(c[:2], r[:2], r0)


def test_the_bootstrap_intervals_cover_the_fit_and_the_prediction_is_wider():
    r0, a, b, c_mid = 0.30, 0.70, 1.0, 3.0e4
    c = [2e4, 4e4, 6e4]
    n = [240, 240, 240]
    k = [round(240 * float(x)) for x in sigmoid_curve(c, r0, a, b, c_mid)]
    res = bootstrap(c, k, n, 72, 240, 8e4, draws=200, seed=1)
    assert res["draws"] == 200
    assert res["A_ci95"][0] <= res["A"] <= res["A_ci95"][1]
    fc = res["forecast"]
    assert fc["pass@1"] == pytest.approx(float(sigmoid_curve([8e4], 0.3, res["A"], res["B"], res["C_mid"])[0]))
    lo, hi = fc["ci95"]
    plo, phi = fc["prediction_ci95"]
    assert plo <= lo <= hi <= phi and (phi - plo) > (hi - lo)  # a measurement adds its own binomial noise
    assert bootstrap(c, k, n, 72, 240, 8e4, draws=20, seed=1) == bootstrap(c, k, n, 72, 240, 8e4, draws=20, seed=1)


def _stats(before: tuple[int, int], after: tuple[int, int]) -> dict:
    def side(k, n):
        return {"pass@1": k / n, "k": k, "n": n, "ci95": [0.0, 1.0]}

    return {"all": {"before": side(*before), "after": side(*after)},
            "math": {"before": side(before[0] // 2, before[1] // 2), "after": side(after[0] // 2, after[1] // 2)}}


def _iteration(root, it: int, before, after, moved: bool, sao_tokens: dict, opd_tokens: int,
               better: bool | None = None) -> None:
    d = root / f"iteration-{it:04d}"
    d.mkdir(parents=True)
    (d / "evaluation.json").write_text(json.dumps({"stats": _stats(before, after),
                                                   "registered": {"champion_moved": moved},
                                                   "decision": {"better": moved if better is None else better}}))
    (d / "sao_experts.json").write_text(json.dumps({k: {"trained_tokens": v} for k, v in sao_tokens.items()}))
    (d / "opd_student.json").write_text(json.dumps({"trained_tokens": opd_tokens}))


def test_the_chain_follows_the_hand_off_and_sums_the_compute(tmp_path):
    _iteration(tmp_path, 1, (80, 240), (110, 240), True, {"code": 100, "math": 50}, 30)
    _iteration(tmp_path, 2, (110, 240), (100, 240), False, {"math": 40}, 20)  # no gain: its warm start goes on
    _iteration(tmp_path, 3, (110, 240), (130, 240), True, {"code": 10}, 0)
    (tmp_path / "iteration-0005").mkdir()  # iteration 4 never ran: the chain stops there
    pts = chain_points(tmp_path, 5)
    assert [p["iteration"] for p in pts] == [0, 1, 2, 3]
    assert [p["k"] for p in pts] == [80, 110, 110, 130]
    assert [p["tokens"] for p in pts] == [0, 180, 240, 250]
    assert [p["policy"] for p in pts] == ["base", "student", "warm_start", "student"]
    assert pts[2]["domain"]["math"]["k"] == 55  # the warm start's per-domain figures, not the student's
    assert [p["policy"] for p in chain_points(tmp_path, 5, rule="student")] == ["base", "student", "student", "student"]


def test_the_chain_follows_the_rule_it_is_given(tmp_path):
    # iteration 1 was better on validation but no champion; iteration 2 the champion but not better
    _iteration(tmp_path, 1, (80, 240), (90, 240), False, {"code": 10}, 0, better=True)
    _iteration(tmp_path, 2, (90, 240), (120, 240), True, {"code": 10}, 0, better=False)
    assert [p["policy"] for p in chain_points(tmp_path, 2, rule="better")] == ["base", "student", "warm_start"]
    assert [p["policy"] for p in chain_points(tmp_path, 2, rule="champion")] == ["base", "warm_start", "student"]
    assert [p["k"] for p in chain_points(tmp_path, 2, rule="better")] == [80, 90, 90]


def test_the_forecast_made_before_an_iteration_is_checked_against_it(tmp_path):
    r0, a, b, c_mid = 0.30, 0.70, 1.2, 400.0
    cum = [0, 200, 400, 600, 800]
    ks = [round(240 * float(sigmoid_curve([c], r0, a, b, c_mid)[0])) for c in cum]
    for it in range(1, 5):
        _iteration(tmp_path, it, (ks[it - 1], 240), (ks[it], 240), True, {"code": 200}, 0)
    res = scaling(tmp_path, 4, active_params=1000, draws=60)
    assert [p["flops"] for p in res["points"]] == [6.0 * 1000 * c for c in cum]
    prev = bootstrap(cum[1:4], ks[1:4], [240] * 3, ks[0], 240, 800, draws=60)  # the fit on iterations 1–3
    ch = res["check"]
    assert ch["iteration"] == 4 and ch["forecast"] == pytest.approx(prev["forecast"]["pass@1"])
    assert ch["measured"] == ks[4] / 240 and ch["within"]  # points on the curve fall inside its interval
    assert ch["prediction_ci95"] == pytest.approx(prev["forecast"]["prediction_ci95"])
    assert res["fit"]["forecast"]["compute"] == pytest.approx(1000.0)  # one more iteration's mean compute
    table = curve_table(res)
    assert "| 4 | student | 800 |" in table and "within its 95% prediction interval" in table
    # an iteration far off the curve is outside
    _iteration(tmp_path, 5, (ks[4], 240), (20, 240), True, {"code": 200}, 0)
    assert scaling(tmp_path, 5, active_params=1000, draws=60)["check"]["within"] is False


def test_too_few_iterations_have_no_fit(tmp_path):
    _iteration(tmp_path, 1, (80, 240), (110, 240), True, {"code": 100}, 0)
    _iteration(tmp_path, 2, (110, 240), (120, 240), True, {"code": 100}, 0)
    res = scaling(tmp_path, 2, active_params=10)
    assert res["fit"] is None and res["check"] is None
    assert "needs 3 iterations" in curve_table(res)
    assert not math.isnan(np.mean([p["pass@1"] for p in res["points"]]))
