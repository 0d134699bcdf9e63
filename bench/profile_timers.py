"""Exclusive, per-thread timers for `bench/iteration_profile.py`: where the seconds of a run go, by stage and category.

Each thread keeps its own stack of open categories. Time is attributed to the innermost one only, in segments: every
push or pop closes the segment since the thread's last event and adds it to the category then on top, so a category
nested inside another counts once and nothing between the first push and the last pop is dropped. A stack entry that
starts with "@" is a context marker: transparent (its own time goes to the category under it; none: not recorded),
but visible to the category resolvers above it (a backward inside "@critic" is the critic's).

Stages are set by whoever runs them (`stage_start` / `stage_end`: the bench hooks Dagster's step events). The thread
that starts a stage is its main thread; a segment of any thread goes to the stage that was current when the segment
began, and to a group by its thread: "main" (the stage's thread), "engine" (threads named `engine-*`: the rollout
engines' loops) or "workers" (every other thread: sandbox calls run by `asyncio.to_thread`, the gate's pool, the
rollouts-ahead thread, teacher prefetch). Only main-thread time adds up to the stage's wall time (its remainder is
`other`); the engine and workers groups are busy seconds that overlap it (and each other).

The clock is injected (tests drive a fake one); nothing here imports torch or Dagster.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable

OUTSIDE = "(between steps)"  # the run's time outside any stage: Dagster planning, events, step launches
GROUPS = ("main", "engine", "workers")


class _Thread:
    """One thread's stack, its last event's time, stage and group, and what it has added up."""

    def __init__(self, ident: int, name: str):
        self.ident, self.name = ident, name
        self.stack: list[str] = []
        self.last = 0.0
        self.stage, self.group = OUTSIDE, "workers"
        self.acc: dict[tuple[str, str, str], float] = defaultdict(float)  # (stage, group, category) -> seconds
        self.counts: dict[tuple[str, str], float] = defaultdict(float)  # (stage, counter) -> amount


class Profiler:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.active = True
        self._lock = threading.Lock()
        self._local = threading.local()
        self._threads: list[_Thread] = []
        self.stage, self.stage_thread = OUTSIDE, None
        self._stage_t0: float | None = None
        self.walls: dict[str, float] = defaultdict(float)
        self.order: list[str] = []
        self.t_begin: float | None = None
        self.t_end: float | None = None
        self._undo: list[tuple[object, str, object, bool]] = []
        self.missing: list[str] = []  # hook targets not found (renamed in the library): reported, not fatal

    # ---- run and stages ----------------------------------------------------------------------------
    def begin(self) -> None:
        self.t_begin = self.clock()

    def end(self) -> None:
        if self._stage_t0 is not None:
            self.stage_end()
        self.t_end = self.clock()
        self.active = False

    def stage_start(self, name: str) -> None:
        """`name` starts on the calling thread (a stage still open is ended first)."""
        if self._stage_t0 is not None:
            self.stage_end()
        now = self.clock()
        with self._lock:
            self.stage, self._stage_t0, self.stage_thread = name, now, threading.get_ident()
            if name not in self.order:
                self.order.append(name)

    def stage_end(self, name: str | None = None) -> None:
        if self._stage_t0 is None or (name is not None and name != self.stage):
            return
        now = self.clock()
        with self._lock:
            self.walls[self.stage] += now - self._stage_t0
            self.stage, self._stage_t0 = OUTSIDE, None

    def on_stage_thread(self) -> bool:
        return threading.get_ident() == self.stage_thread

    # ---- timers ------------------------------------------------------------------------------------
    def _state(self) -> _Thread:
        st = getattr(self._local, "st", None)
        if st is None:
            t = threading.current_thread()
            st = self._local.st = _Thread(t.ident, t.name)
            with self._lock:
                self._threads.append(st)
        return st

    def _group(self, st: _Thread) -> str:
        if st.ident == self.stage_thread:
            return "main"
        return "engine" if st.name.startswith("engine-") else "workers"

    def _close_segment(self, st: _Thread, now: float) -> None:
        top = next((c for c in reversed(st.stack) if not c.startswith("@")), None)
        if top is not None:
            st.acc[(st.stage, st.group, top)] += now - st.last
        st.last, st.stage, st.group = now, self.stage, self._group(st)

    def push(self, category: str) -> None:
        st = self._state()
        self._close_segment(st, self.clock())
        st.stack.append(category)

    def pop(self) -> None:
        st = self._state()
        self._close_segment(st, self.clock())
        st.stack.pop()

    def stack(self) -> list[str]:
        return list(self._state().stack)

    def count(self, name: str, amount: float) -> None:
        """Add `amount` to counter `name` (tokens, steps) of the current stage."""
        if self.active and amount:
            self._state().counts[(self.stage, name)] += amount

    def timer(self, category: str):
        return _Timer(self, category)

    # ---- wrapping ----------------------------------------------------------------------------------
    def wrap(self, fn: Callable, category, *, when: Callable[[], bool] | None = None, measure=None) -> Callable:
        """`fn` timed under `category` (a name, or `category(stack, args, kwargs)` -> name, chosen at entry from the
        thread's open categories). `when()`: time this call at all (default: always). `measure(args, kwargs, category)`,
        called before `fn`, returns `after(result)` -> {counter: amount}, added to the stage's counters."""
        prof = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not prof.active or (when is not None and not when()):
                return fn(*args, **kwargs)
            cat = category(prof.stack(), args, kwargs) if callable(category) else category
            after = measure(args, kwargs, cat) if measure is not None else None
            prof.push(cat)
            try:
                result = fn(*args, **kwargs)
            finally:
                prof.pop()
            if after is not None:
                for k, v in after(result).items():
                    prof.count(k, v)
            return result

        timed.__profiled__ = fn  # type: ignore[attr-defined]
        return timed

    def patch(self, owner, name: str, category, **kw) -> bool:
        """Replace `owner.name` (a class's method or a module's function) with its timed twin until `restore()`."""
        fn = getattr(owner, name, None)
        if fn is None:
            self.missing.append(f"{getattr(owner, '__name__', owner)}.{name}")
            return False
        had, raw = name in vars(owner), vars(owner).get(name)
        setattr(owner, name, self.wrap(fn, category, **kw))
        self._undo.append((owner, name, raw, had))
        return True

    def replace(self, owner, name: str, new) -> None:
        """Set `owner.name` to `new` until `restore()`."""
        had, raw = name in vars(owner), vars(owner).get(name)
        setattr(owner, name, new)
        self._undo.append((owner, name, raw, had))

    def patch_everywhere(self, fn: Callable, category, prefixes: tuple[str, ...], **kw) -> int:
        """Replace every module-level reference to function `fn` in the loaded modules of the packages `prefixes` (a
        name taken with `from x import fn` is its own reference); returns how many were replaced."""
        timed = self.wrap(fn, category, **kw)
        n = 0
        for mod in list(sys.modules.values()):
            name = getattr(mod, "__name__", "") or ""
            if name.split(".")[0] not in prefixes:
                continue
            for attr, val in list(vars(mod).items()):
                if val is fn:
                    setattr(mod, attr, timed)
                    self._undo.append((mod, attr, fn, True))
                    n += 1
        if not n:
            self.missing.append(getattr(fn, "__qualname__", str(fn)))
        return n

    def restore(self) -> None:
        for owner, name, fn, had in reversed(self._undo):
            if had:
                setattr(owner, name, fn)
            else:
                delattr(owner, name)
        self._undo.clear()

    # ---- the report --------------------------------------------------------------------------------
    def report(self) -> dict:
        """{"wall", "order", "stages": {stage: {"wall", "main": {category: s, ..., "other": remainder}, "engine": {...},
        "workers": {...}, "counts": {...}}}}. Main-thread categories of a stage add up to its wall exactly."""
        acc: dict[tuple[str, str, str], float] = defaultdict(float)
        counts: dict[tuple[str, str], float] = defaultdict(float)
        with self._lock:
            threads = list(self._threads)
        for st in threads:
            for k, v in list(st.acc.items()):
                acc[k] += v
            for k, v in list(st.counts.items()):
                counts[k] += v
        total = (self.t_end if self.t_end is not None else self.clock()) - (self.t_begin or 0.0)
        walls = dict(self.walls)
        walls[OUTSIDE] = total - sum(walls.values())
        stages = {}
        for s in [*self.order, OUTSIDE]:
            row = {"wall": walls.get(s, 0.0), **{g: {} for g in GROUPS}, "counts": {}}
            for (stage, group, cat), v in acc.items():
                if stage == s:
                    row[group][cat] = row[group].get(cat, 0.0) + v
            row["main"]["other"] = row["wall"] - sum(row["main"].values())
            row["counts"] = {name: v for (stage, name), v in counts.items() if stage == s}
            stages[s] = row
        return {"wall": total, "order": [*self.order, OUTSIDE], "stages": stages}


class _Timer:
    def __init__(self, prof: Profiler, category: str):
        self.prof, self.category = prof, category

    def __enter__(self):
        self.prof.push(self.category)
        return self

    def __exit__(self, *exc):
        self.prof.pop()
        return False


def innermost(stack: list[str], rules: list[tuple[Callable[[str], bool], str]], default: str) -> str:
    """The category of the first rule (predicate on a stack entry, category) that matches an open entry, looking from
    the innermost outwards; `default` when none does (the category resolvers of `Profiler.wrap`)."""
    for entry in reversed(stack):
        for test, cat in rules:
            if test(entry):
                return cat
    return default
