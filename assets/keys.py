"""What the iteration's assets, the launch checks and the resources share, with no import of each other: the
`policy` asset's key and how to read its records, and what a partition key must be."""

from __future__ import annotations

import re
from pathlib import Path

import dagster as dg

POLICY_KEY = dg.AssetKey("policy")


class LaunchRefused(ValueError):
    """A launch that cannot succeed: its config, its iteration or its partition key is wrong."""


def iteration_number(key) -> int:
    """The iteration a partition key names; a key that is not 1, 2, … (no sign, no leading zero, no text) is refused."""
    if not isinstance(key, str | int) or not re.fullmatch(r"[1-9][0-9]*", str(key)):
        raise LaunchRefused(f"partition key {str(key)!r} is not an iteration number (1, 2, …): iterations are "
                            "numbered, each starting from what the one before it hands off")
    return int(key)


def record_root(meta) -> Path | None:
    """The run root a `policy` record belongs to: its `run_root` metadata, or (records written before it was kept)
    the directory above the student's `iteration-NNNN` directory."""
    if "run_root" in meta:
        return Path(meta["run_root"].value)
    parts = Path(meta["checkpoint"].value).parts
    hits = [i for i, x in enumerate(parts) if x.startswith("iteration-")]
    return Path(*parts[: hits[-1]]) if hits else None
