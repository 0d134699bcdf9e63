"""Crash accounting against hand counts: per-family shares, the strict threshold, the early stop only once failing is
certain, and the knob refused out of range with its key named."""

import pytest

import configs
from rollout.crashes import CrashedShareExceeded, CrashTally, check_crashes, crash_metrics, crash_report
from rollout.types import Segment, Trajectory


def _t(family: str, status: str = "completed", error: str | None = None, verifier: dict | None = None) -> Trajectory:
    return Trajectory(f"t-{family}", "e", family, "code", "h", "v", 1, [Segment([], [], [], [])], 0.0, status,
                      verifier or {}, error=error)


def _batch(family: str, n: int, crashed: int = 0, aborted: int = 0, error: str = "OSError: sandbox exploded"):
    return ([_t(family, "crashed", error) for _ in range(crashed)]
            + [_t(family, "aborted", "EngineFault: the engine aborted the request") for _ in range(aborted)]
            + [_t(family, "truncated" if i % 2 else "completed") for i in range(n - crashed - aborted)])


def test_the_report_counts_each_family_over_its_own_episodes():
    verdict = {"checks": [{"name": "answer", "passed": False, "detail": "ok"},
                          {"name": "hidden", "passed": False, "detail": "no ready line", "crashed": True}]}
    trajs = (_batch("kv-lookup", 10, crashed=1, aborted=1)
             + _batch("calc-chain", 4)
             + _batch("set-const", 5, crashed=1)
             + [_t("set-const", "crashed", "verifier crashed", verdict)])  # set-const: 2 of 6
    rep = crash_report(trajs)
    assert rep == {
        "episodes": 20, "crashed": 3, "aborted": 1, "share": 0.15, "aborted_share": 0.05,
        "families": {
            "calc-chain": {"episodes": 4, "crashed": 0, "aborted": 0, "share": 0.0, "aborted_share": 0.0},
            "kv-lookup": {"episodes": 10, "crashed": 1, "aborted": 1, "share": 0.1, "aborted_share": 0.1,
                          "causes": {"OSError: sandbox exploded": 1, "EngineFault: the engine aborted the request": 1}},
            "set-const": {"episodes": 6, "crashed": 2, "aborted": 0, "share": round(2 / 6, 6), "aborted_share": 0.0,
                          "causes": {"OSError: sandbox exploded": 1,
                                     "verifier crashed (check hidden: no ready line)": 1}}}}
    # truncated and completed episodes are the agent's outcomes: never counted as lost
    assert crash_report(_batch("kv-lookup", 3))["share"] == 0.0
    assert crash_metrics(rep) == {"crashed_share": 0.15, "crashed_share_calc-chain": 0.0,
                                  "crashed_share_kv-lookup": 0.1, "crashed_share_set-const": round(2 / 6, 6)}
    # carried across a resumed stage: the same counts and causes
    assert CrashTally.from_state(CrashTally(trajs).state()).report() == rep


def test_a_family_above_the_threshold_fails_with_its_share_and_cause_named():
    # 1 crash in 20 is 5%: at the threshold, not above it
    ok = _batch("kv-lookup", 20, crashed=1) + _batch("calc-chain", 80)
    assert check_crashes(ok, 0.05, "rollout_batches")["families"]["kv-lookup"]["share"] == 0.05
    # 2 in 20 is above, though the stage as a whole lost 2 of 100 (2%): each family is judged on its own
    bad = _batch("kv-lookup", 20, crashed=2, error="RecursionError: maximum recursion depth exceeded") \
        + _batch("calc-chain", 80)
    with pytest.raises(CrashedShareExceeded) as e:
        check_crashes(bad, 0.05, "rollout_batches")
    msg = str(e.value)
    assert msg.startswith("rollout_batches: the crashed share of kv-lookup is above loop.max_crashed_share 0.05")
    assert "kv-lookup: 2 of 20 episodes (10.0%: 2 crashed)" in msg
    assert "'RecursionError: maximum recursion depth exceeded' ×2" in msg
    assert "calc-chain" not in msg  # the family that lost nothing is not blamed
    assert e.value.report["families"]["kv-lookup"]["crashed"] == 2
    # aborted episodes (engine faults) are reported in their own column, not held to the threshold: 1 crashed and
    # 5 aborted of 20 passes at 5%; a second crash fails, and the message names the aborted ones too
    rep = check_crashes(_batch("kv-lookup", 20, crashed=1, aborted=5), 0.05, "evaluation (student)")
    assert rep["families"]["kv-lookup"]["aborted_share"] == 0.25 and rep["share"] == 0.05
    with pytest.raises(CrashedShareExceeded, match=r"2 crashed, and 5 aborted by the engine"):
        check_crashes(_batch("kv-lookup", 20, crashed=2, aborted=5), 0.05, "evaluation (student)")
    # no threshold: counted only; threshold 0: any loss fails
    assert check_crashes(bad, None, "x")["crashed"] == 2
    with pytest.raises(CrashedShareExceeded):
        check_crashes(_batch("kv-lookup", 100, crashed=1), 0.0, "x")


def test_part_of_a_stage_fails_only_once_failing_is_certain():
    tally = CrashTally(_batch("kv-lookup", 10, crashed=5))
    # 5 lost of the 100 the stage will run is 5%: the stage could still pass, so it goes on ...
    assert tally.check(0.05, "opd", planned=100)["crashed"] == 5
    # ... though the family's share so far (50%) is far above the threshold
    tally.add(_batch("calc-chain", 10, crashed=1))
    with pytest.raises(CrashedShareExceeded, match=r"opd: 6 of the 100 episodes this stage runs already crashed"):
        tally.check(0.05, "opd", planned=100)  # 6 of 100: above 5% whatever the other 80 do
    # once the tally is complete each family is judged
    done = CrashTally(_batch("kv-lookup", 10, crashed=1) + _batch("calc-chain", 10))
    with pytest.raises(CrashedShareExceeded, match="kv-lookup: 1 of 10"):
        done.check(0.05, "opd", planned=20)


@pytest.mark.parametrize("bad", ["1.5", "-0.01"])
def test_the_knob_is_refused_out_of_range_with_its_key_named(bad):
    assert configs.load("tiny").loop.max_crashed_share == 0.05
    assert configs.load("micro", ["loop.max_crashed_share=0"]).loop.max_crashed_share == 0.0
    with pytest.raises(configs.ConfigError, match=r"loop\.max_crashed_share"):
        configs.load("micro", [f"loop.max_crashed_share={bad}"])
