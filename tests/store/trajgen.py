"""Random trajectories for the store tests (also imported by the kill-mid-write child process)."""

from __future__ import annotations

import copy

import numpy as np

from rollout.types import STATUSES, Segment, Trajectory

FAMILIES = ("arith", "grep", "sql")


def random_segment(rng: np.random.Generator, version: int, n: int | None = None) -> Segment:
    """A context window of `n` (default 50-500) tokens: generated tokens carry a version near `version`."""
    n = int(rng.integers(50, 501)) if n is None else n
    mask = rng.random(n) < 0.4
    logprobs = np.where(mask, -rng.exponential(1.0, n), 0.0)
    versions = np.where(mask, version - rng.integers(0, 3, n), -1)
    return Segment(
        tokens=rng.integers(0, 150_000, n).tolist(),
        loss_mask=mask.tolist(),
        logprobs=logprobs.tolist(),
        versions=versions.tolist(),
        start_turn=int(rng.integers(0, 5)),
        end_turn=int(rng.integers(5, 20)),
        summary=bool(rng.random() < 0.3),
    )


def random_trajectory(
    rng: np.random.Generator, tid: str, iteration: int = 0, version: int | None = None, status: str | None = None
) -> Trajectory:
    """1-3 segments of 50-500 tokens, random reward/status/verifier details/timings."""
    version = int(rng.integers(2, 10)) if version is None else version
    status = str(rng.choice(STATUSES)) if status is None else status
    segs = [random_segment(rng, version) for _ in range(int(rng.integers(1, 4)))]
    return Trajectory(
        trajectory_id=tid,
        env_id=f"env-{int(rng.integers(0, 20))}",
        family=str(rng.choice(FAMILIES)),
        domain=str(rng.choice(["code", "math", "reasoning"])),
        env_spec_hash=f"{int(rng.integers(0, 2**62)):016x}",
        verifier_hash=f"{int(rng.integers(0, 2**62)):016x}",
        iteration=iteration,
        segments=segs,
        reward=float(rng.normal()),
        status=status,
        verifier={"passed": bool(rng.random() < 0.5), "checks": [{"name": "c1", "ok": True, "score": 0.25}], "note": "ünï"},
        engine=str(rng.choice(["embedded", "sglang@h:30000"])),
        timings={"generate": float(rng.random()), "env": float(rng.random()), "total": 1.0 + float(rng.random())},
        created=1.7e9 + float(rng.random()) * 1e6,
        error="Traceback: boom" if status == "crashed" else None,
    )


def as_stored(t: Trajectory) -> Trajectory:
    """What the store gives back for `t`: log-probs rounded to float32, everything else unchanged."""
    t = copy.deepcopy(t)
    for s in t.segments:
        s.logprobs = np.asarray(s.logprobs, dtype=np.float32).tolist()
    return t
