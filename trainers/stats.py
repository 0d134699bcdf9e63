"""Evaluation statistics: Wilson intervals for pass@1, and paired tests of two policies on the same tasks.

pass@1 over n tasks is a binomial proportion; its 95% Wilson interval stays inside [0, 1] and is honest at
p near 0 or 1, where the normal approximation is not. Two policies evaluated on the same tasks are compared
on the tasks where they disagree (exact McNemar: under no difference every discordant task is a fair coin),
which is far more powerful than comparing two independent intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of k successes in n trials ((0, 1) when n = 0)."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"wilson: need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k heads in n fair-coin flips (sum of outcomes no likelier than k)."""
    if n == 0:
        return 1.0
    probs = [math.comb(n, i) / 2**n for i in range(n + 1)]
    pk = probs[k]
    return min(1.0, sum(q for q in probs if q <= pk * (1 + 1e-12)))


def mcnemar_exact(before: Sequence[float], after: Sequence[float]) -> dict:
    """Exact McNemar test of paired binary outcomes (reward ≥ 0.5 counts as solved).

    Returns the counts of tasks that flipped each way (`gained`: unsolved → solved, `lost`: solved →
    unsolved), the change in pass@1 and the two-sided p-value."""
    if len(before) != len(after):
        raise ValueError(f"mcnemar_exact: {len(before)} vs {len(after)} outcomes: pair the same tasks")
    b = [x >= 0.5 for x in before]
    a = [x >= 0.5 for x in after]
    gained = sum(1 for x, y in zip(b, a) if not x and y)
    lost = sum(1 for x, y in zip(b, a) if x and not y)
    n = len(b)
    return {"n": n, "gained": gained, "lost": lost, "both": sum(1 for x, y in zip(b, a) if x and y),
            "neither": sum(1 for x, y in zip(b, a) if not x and not y),
            "delta": (gained - lost) / n if n else 0.0, "delta_ci95": paired_delta_ci(gained, lost, n),
            "p_value": binom_two_sided(min(gained, lost), gained + lost)}


def paired_delta_ci(gained: int, lost: int, n: int, z: float = Z95) -> tuple[float, float]:
    """95% interval of the change in pass@1 between two runs on the same n tasks, from the flips alone:
    Δ = (gained − lost)/n with variance ((gained + lost) − (gained − lost)²/n)/n² (paired proportions)."""
    if n == 0:
        return (0.0, 0.0)
    d = (gained - lost) / n
    se = math.sqrt(max(0.0, (gained + lost) - (gained - lost) ** 2 / n)) / n
    return (d - z * se, d + z * se)


def summarize(rewards: Sequence[float]) -> dict:
    """pass@1 with its 95% Wilson interval."""
    k, n = sum(1 for r in rewards if r >= 0.5), len(rewards)
    lo, hi = wilson(k, n)
    return {"pass@1": k / n if n else 0.0, "k": k, "n": n, "ci95": [round(lo, 4), round(hi, 4)]}


def compare(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict:
    """Per-group (and `all`) paired comparison of two runs over the same tasks: {group: {before, after, test}}.
    `before[g]` and `after[g]` are rewards in the same task order."""
    out = {}
    groups = sorted(before)
    everything_b = [r for g in groups for r in before[g]]
    everything_a = [r for g in groups for r in after[g]]
    for g, b, a in [*((g, before[g], after[g]) for g in groups), ("all", everything_b, everything_a)]:
        out[g] = {"before": summarize(b), "after": summarize(a), "test": mcnemar_exact(b, a)}
    return out


def significant_gain(test: dict, alpha: float = 0.05) -> bool:
    return test["gained"] > test["lost"] and test["p_value"] < alpha


def moves_champion(significant: bool, score: float, best: float | None) -> bool:
    """The `champion` rule: a student takes the alias only with a significant gain over its warm start and a
    pass@1 above the current champion's (`best`; None: no champion yet)."""
    return bool(significant) and (best is None or score > best)
