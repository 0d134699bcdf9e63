"""The champion decision of an iteration, on the validation set.

Whether a student is a significant gain over its warm start moves the `champion` alias; whether it is better (`better`)
or the champion decides the hand-off to the next iteration (`hand_off`). A decision that read the held-out set would
make every later held-out p-value exploratory (the set would have chosen the policies it then measures), so the decision
reads the validation set (`envs.n_val` tasks of the held-out patterns, fresh every iteration, none of them held out),
paired: the same test (exact McNemar on the tasks that flipped, `trainers.stats.significant_gain`) as the held-out
report.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path


def warm_rewards_from_gate(opd: dict, baseline: str) -> dict[str, float]:
    """The warm start's greedy rewards on validation tasks (spec id -> reward) from OPD's teacher gate, where the
    gate ran the same checkpoint as `baseline` (greedy episodes are deterministic, so they are the same outcomes)."""
    out: dict[str, float] = {}
    for g in (opd.get("gate") or {}).values():
        if isinstance(g, dict) and g.get("warm_ckpt") and Path(g["warm_ckpt"]) == Path(baseline).resolve():
            out.update(g.get("warm_rewards") or {})
    return out


def _flipped(test: dict) -> dict:
    """A paired test read the other way round: a significant gain of the flipped test is a significant loss."""
    return {**test, "gained": test["lost"], "lost": test["gained"]}


def validation_decision(val: list, student: str, baseline: str, warm_val: dict[str, float],
                        run: Callable, log: Callable[[str], None]) -> dict:
    """Student vs warm start on the validation tasks `val`: `run(ckpt, specs, who)` plays them greedily (evaluation's
    runner: every episode is stored, crashes counted). The warm start plays only the tasks `warm_val` lacks.

    Two verdicts: `significant` (a significant paired gain overall: what moves the `champion` alias) and `better`
    (more validation tasks gained than lost, and no domain lost significantly: what the `hand_off: better` rule
    hands on)."""
    from trainers.stats import compare, significant_gain

    after = run(student, val, "val:student")
    if Path(student).resolve() == Path(baseline).resolve():
        before = {s.id: t.reward for s, t in zip(val, after["trajectories"])}
        reused = len(val)
    else:
        need = [s for s in val if s.id not in warm_val]
        got = run(baseline, need, "val:warm_start")["trajectories"] if need else []
        before = {**{s.id: warm_val[s.id] for s in val if s.id in warm_val},
                  **{s.id: t.reward for s, t in zip(need, got)}}
        reused = len(val) - len(need)
    b, a = defaultdict(list), defaultdict(list)
    for s, t in zip(val, after["trajectories"]):
        b[s.domain].append(before[s.id])
        a[s.domain].append(t.reward)
    per = compare(dict(b), dict(a))
    st, test = per["all"], per["all"]["test"]
    sig = significant_gain(test)
    fell = sorted(d for d, v in per.items() if d != "all" and significant_gain(_flipped(v["test"])))
    better = test["gained"] > test["lost"] and not fell
    log(f"decision on {len(val)} validation tasks: student {st['after']['pass@1']:.3f} vs warm start "
        f"{st['before']['pass@1']:.3f}, {test['gained']} gained / {test['lost']} lost, p = {test['p_value']:.4f}"
        f" ({'a significant gain' if sig else 'no significant gain'}; "
        f"{'better' if better else 'not better'}{': ' + ', '.join(fell) + ' fell significantly' if fell else ''}; "
        f"{reused} warm-start outcomes reused)")
    return {"set": "validation", "n": len(val), "pass@1_before": st["before"]["pass@1"],
            "pass@1_after": st["after"]["pass@1"], "gained": test["gained"], "lost": test["lost"],
            "p_value": test["p_value"], "significant": sig, "better": better, "domains_fell": fell,
            "warm_start_reused": reused,
            "reason": "student vs warm start on the validation set, paired (exact McNemar)"}
