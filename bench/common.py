"""Shared helpers for the benchmarks: timing and a ratio table."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timeit(fn: Callable[[], object], repeat: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def table(title: str, header: list[str], rows: list[list[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in header:
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(*[f"{x:,.3f}" if isinstance(x, float) else str(x) for x in r])
    Console().print(t)


def threads() -> int:
    return torch.get_num_threads()
