"""Crash accounting: what share of a stage's episodes each family lost to infrastructure, and the rule that a stage
fails, naming the cause, when a family lost more than `loop.max_crashed_share` of them, instead of training on (or
scoring) what is left.

An agent's failure is reward 0 with status completed or truncated; `crashed` means the sandbox could not start a
check (or an environment's own machinery failed): the status an agent must never be able to reach by failing, and
the one the threshold is on. `aborted` means the engine ended a generation (an engine restarted, a request timed
out on a loaded machine): the policy's infrastructure, not the environment's, counted and reported in its own
column (with its own share) but not held to the threshold: a handful of aborted requests on a busy machine would
otherwise fail a small stage, while the engine's faults have their own retry and staleness rules.

A share is "above" the threshold when it is strictly greater: at 5%, 1 of 20 passes and 2 of 20 fail.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

KNOB = "loop.max_crashed_share"
LOST = ("crashed", "aborted")
SHOWN_CAUSES = 3  # the most common causes a message names (the report keeps a few more)
KEPT_CAUSES = 5
CAUSE_CHARS = 240


class CrashedShareExceeded(RuntimeError):
    """A stage lost more of a family's episodes to infrastructure than `loop.max_crashed_share` allows."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


def cause(t) -> str:
    """Why an episode was lost: its `error`, with the first crashed verifier check's name and detail when the
    verifier's own machinery failed (the trajectory's `verifier` details)."""
    why = getattr(t, "error", None) or f"status {t.status}, no error recorded"
    checks = (getattr(t, "verifier", None) or {}).get("checks") or []
    bad = next((c for c in checks if isinstance(c, dict) and c.get("crashed")), None)
    if bad is not None:
        why += f" (check {bad.get('name', '?')}: {str(bad.get('detail', '')).strip()})"
    return " ".join(why.split())[:CAUSE_CHARS]


class CrashTally:
    """Per family: episodes seen, how many crashed and how many were aborted, and the causes. `add` trajectories
    (anything with `family`, `status`, `error`, `verifier`) or `count` one outcome at a time; `report` for a
    stage's result; `check` to fail the stage. `state` / `from_state` carry it across a resumed stage."""

    def __init__(self, trajs: Iterable = ()):
        self.rows: dict[str, dict] = {}
        self.causes: dict[str, Counter] = {}
        self.add(trajs)

    def count(self, family: str, status: str, why: str | None = None) -> None:
        row = self.rows.setdefault(family, {"episodes": 0, "crashed": 0, "aborted": 0})
        row["episodes"] += 1
        if status in LOST:
            row[status] += 1
            self.causes.setdefault(family, Counter())[why or f"status {status}"] += 1

    def add(self, trajs: Iterable) -> None:
        for t in trajs:
            self.count(t.family, t.status, cause(t) if t.status in LOST else None)

    @property
    def episodes(self) -> int:
        return sum(r["episodes"] for r in self.rows.values())

    @property
    def lost(self) -> int:
        return sum(r["crashed"] for r in self.rows.values())

    def report(self) -> dict:
        """{"episodes", "crashed", "aborted", "share", "families": {family: {"episodes", "crashed", "aborted",
        "share", "aborted_share", "causes": {cause: n} (only where some were lost)}}}; `share` is crashed / episodes."""
        fams = {}
        for f, r in sorted(self.rows.items()):
            fams[f] = {**r, "share": _share(r["crashed"], r["episodes"]),
                       "aborted_share": _share(r["aborted"], r["episodes"])}
            if f in self.causes:
                fams[f]["causes"] = dict(self.causes[f].most_common(KEPT_CAUSES))
        total = {k: sum(r[k] for r in self.rows.values()) for k in ("episodes", "crashed", "aborted")}
        return {**total, "share": _share(total["crashed"], total["episodes"]),
                "aborted_share": _share(total["aborted"], total["episodes"]), "families": fams}

    def state(self) -> dict:
        return self.report()

    @classmethod
    def from_state(cls, state: dict | None) -> CrashTally:
        t = cls()
        for f, r in ((state or {}).get("families") or {}).items():
            t.rows[f] = {k: int(r.get(k, 0)) for k in ("episodes", "crashed", "aborted")}
            if r.get("causes"):
                t.causes[f] = Counter(r["causes"])
        return t

    def check(self, threshold: float | None, stage: str, planned: int | None = None) -> dict:
        """The report, or `CrashedShareExceeded` naming the family, its share, the threshold and the most common
        causes. `threshold` None: count only.

        `planned`: how many episodes the whole stage will run, when this is a tally of part of it. Each family's
        share is judged once the tally is complete (no `planned`, or that many seen); before then the stage fails as
        soon as failing is certain, i.e. when the episodes lost so far are already above the threshold's share of
        `planned` (the stage's final share can only be higher), so a broken sandbox stops a long stage after a
        few batches and a stage that would pass is never stopped."""
        rep = self.report()
        if threshold is None:
            return rep
        if planned is not None and self.episodes < planned:
            if self.lost / max(1, planned) > threshold:
                lost = {f: r for f, r in rep["families"].items() if r["crashed"]}
                raise CrashedShareExceeded(
                    f"{stage}: {self.lost} of the {planned} episodes this stage runs already crashed, "
                    f"in its first {self.episodes} ({self.lost / planned:.1%} of {planned}: above {KNOB} "
                    f"{threshold:g} whatever the rest do); "
                    + "; ".join(_family(f, r) for f, r in sorted(lost.items(), key=_worst)) + _ADVICE, rep)
            return rep
        over = {f: r for f, r in rep["families"].items() if r["episodes"] and
                r["crashed"] / r["episodes"] > threshold}
        if over:
            raise CrashedShareExceeded(
                f"{stage}: the crashed share of {', '.join(sorted(over, key=lambda f: _worst((f, over[f]))))} is above "
                f"{KNOB} {threshold:g}: "
                + "; ".join(_family(f, r) for f, r in sorted(over.items(), key=_worst)) + _ADVICE, rep)
        return rep


_ADVICE = (". Not training on (or scoring) what is left: fix the cause, or raise loop.max_crashed_share to accept "
           "the loss")


def _share(lost: int, n: int) -> float:
    return round(lost / n, 6) if n else 0.0


def _worst(item) -> tuple:
    f, r = item
    return (-r["crashed"] / max(1, r["episodes"]), f)


def _family(f: str, r: dict) -> str:
    lost = r["crashed"]
    parts = [f"{r['crashed']} crashed"] + ([f"and {r['aborted']} aborted by the engine"] if r["aborted"] else [])
    causes = list(r.get("causes", {}).items())[:SHOWN_CAUSES]
    why = ", ".join(f"{c!r} ×{n}" for c, n in causes)
    return (f"{f}: {lost} of {r['episodes']} episodes ({lost / max(1, r['episodes']):.1%}: {', '.join(parts)})"
            + (f", most common causes: {why}" if why else ""))


def crash_report(trajs: Iterable) -> dict:
    """Per-family crashed and aborted counts and shares of `trajs`, and the overall share (`CrashTally.report`)."""
    return CrashTally(trajs).report()


def check_crashes(trajs: Iterable, threshold: float | None, stage: str) -> dict:
    """`crash_report(trajs)`, or `CrashedShareExceeded` when a family's share is above `threshold`."""
    return CrashTally(trajs).check(threshold, stage)


def crash_metrics(report: dict | None, prefix: str = "crashed_share") -> dict[str, float]:
    """Flat metrics of a report (MLflow, asset metadata): the overall share and each family's."""
    if not report:
        return {}
    return {prefix: report["share"], **{f"{prefix}_{f}": r["share"] for f, r in report["families"].items()}}
