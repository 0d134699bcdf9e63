"""Teacher residency for multi-teacher on-policy distillation.

OPD routes each student sample to its domain's teacher (code, math, reasoning, …). Teachers are as
large as the policy, so only `max_resident` of them live in memory (on `device`); the others stay on
local disk as HF-layout safetensors checkpoint directories. While the current teacher scores its
batches, the next one is read from disk in a background thread, so that switching teachers costs
only the part of the load that scoring did not cover.

    pool = TeacherPool({"code": "ckpt/code", "math": "ckpt/math"}, max_resident=1)
    with pool.use("code") as teacher:          # pinned: never evicted while inside the block
        pool.prefetch("math")                   # background read of the next teacher
        logits = teacher(ids)
    results = pool.score_batches([("math", b0), ("code", b1)], score_fn)   # both, fewest swaps
    pool.stats().hidden_fraction                # share of load time the caller did not wait for

Life of a teacher:

* **on disk** → `prefetch(d)` submits a load to a one-thread executor (or `get(d)` loads it in the
  calling thread) → **staged**: loaded into host memory, not yet counted as resident.
* **staged** → **resident** ("installed"): the model is moved to `device` and joins the LRU set. A
  background load installs itself when it finishes if a slot is free or an idle (unpinned) teacher
  can be evicted; otherwise it waits staged until `get`/`use` asks for it. Installing counts a *swap*.
* **resident** → evicted (least recently used first, never a teacher pinned by `use`). An evicted
  teacher is dropped from the pool; a caller still holding a reference from `get` keeps a working
  model until it lets go.

So memory holds at most `max_resident` resident teachers plus the staged ones (at most one per
outstanding `prefetch`; `score_batches` keeps one in flight).

Accounting (see `PoolStats`): every read from disk is a *load* and adds to `load_seconds`. When a
prefetched teacher is first taken by `get`/`use`, the part of its load time the caller did not spend
waiting for it is *hidden* (in `score_batches` the caller spends that time scoring, so this is the
load time that overlapped with scoring). Synchronous loads are never hidden; prefetched loads that
nobody asked for are counted as loads but not as hidden.

Thread safety: the pool state lives under one lock; loading (safetensors reads + torch ops) runs
outside it in the background thread while the caller's thread runs forward passes, which torch
allows. Model construction on the meta device inside `model.load_checkpoint` uses a thread-local
torch function mode, so it does not leak into the caller's thread.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from model import load_checkpoint


@dataclass(frozen=True)
class PoolStats:
    """Counters of a `TeacherPool` since it was created."""

    swaps: int  # teachers installed into the resident set (cold starts included)
    loads: int  # checkpoint reads from disk (synchronous + background)
    evictions: int  # resident teachers dropped to make room
    load_seconds: float  # wall time of all loads
    hidden_seconds: float  # load time of prefetched teachers the caller did not wait for
    wait_seconds: float  # time `get`/`use` spent blocked on a load (in flight or synchronous)
    hidden_fraction: float  # hidden_seconds / load_seconds (0 when nothing was loaded)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class TeacherPool:
    """At most `max_resident` teacher models in memory, the rest on disk, the next one prefetched.

    `paths` maps a domain name to an HF-layout checkpoint directory. `loader(path)` reads one (default
    `model.load_checkpoint`, which builds the model on the host); the pool then moves it to `device`
    when it is installed. Use as a context manager (or call `close()`) to stop the background thread.
    """

    def __init__(
        self,
        paths: Mapping[str, str | Path],
        max_resident: int = 1,
        device: str | torch.device = "cpu",
        loader: Callable[[Path], nn.Module] = load_checkpoint,
    ):
        if max_resident < 1:
            raise ValueError(f"max_resident must be at least 1, got {max_resident}")
        if not paths:
            raise ValueError("TeacherPool needs at least one teacher checkpoint")
        self.paths = {str(d): Path(p) for d, p in paths.items()}
        self.max_resident = max_resident
        self.device = torch.device(device)
        self.loader = loader
        self._lock = threading.Lock()
        self._resident: OrderedDict[str, nn.Module] = OrderedDict()  # LRU order: oldest first
        self._staged: dict[str, nn.Module] = {}  # loaded, not installed
        self._pending: dict[str, Future] = {}  # loads in flight (background or synchronous)
        self._prefetched: dict[str, float] = {}  # domain → load seconds of a prefetch not yet taken
        self._in_use: Counter[str] = Counter()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="teacher-prefetch")
        self._closed = False
        self._swaps = self._loads = self._evictions = 0
        self._load_s = self._hidden_s = self._wait_s = 0.0

    # ---- public API ---------------------------------------------------------------------------------
    @property
    def domains(self) -> list[str]:
        return list(self.paths)

    def resident(self) -> list[str]:
        """Resident domains, least recently used first."""
        with self._lock:
            return list(self._resident)

    def get(self, domain: str) -> nn.Module:
        """The teacher of `domain`, installing it first if needed (waits for a prefetch in flight,
        otherwise loads it synchronously in this thread). Not pinned: a later install may evict it
        from the pool — use `use()` to keep it resident while scoring."""
        return self._acquire(domain, pin=False)

    @contextmanager
    def use(self, domain: str) -> Iterator[nn.Module]:
        """`with pool.use(domain) as teacher:` — like `get`, and the teacher is never evicted while any
        `use` block for it is open."""
        model = self._acquire(domain, pin=True)
        try:
            yield model
        finally:
            with self._lock:
                self._in_use[domain] -= 1
                if self._in_use[domain] <= 0:
                    del self._in_use[domain]

    def prefetch(self, domain: str) -> Future | None:
        """Start reading `domain`'s teacher in the background thread; returns the load's future, or
        None when it is already resident, staged or loading. Load errors surface at `get`/`use`."""
        self._check(domain)
        with self._lock:
            if self._closed:
                raise RuntimeError("TeacherPool is closed")
            if domain in self._resident or domain in self._staged or domain in self._pending:
                return None
            fut: Future = Future()
            self._pending[domain] = fut
        self._executor.submit(self._load, domain, fut, True)
        return fut

    def score_batches(
        self, batches: list[tuple[str, Any]], score_fn: Callable[[nn.Module, Any], Any], prefetch: bool = True
    ) -> list[Any]:
        """Score `(domain, batch)` pairs with `score_fn(teacher, batch)`; results in the input order.

        Batches are grouped by domain and the groups visited in the order that needs the fewest swaps:
        resident teachers first (least recently used first), then teachers already staged or loading,
        then the rest in order of first appearance. Each domain is visited once. While a group is
        scored, the next group's teacher is prefetched (unless `prefetch=False`)."""
        groups: dict[str, list[int]] = {}
        for i, (domain, _) in enumerate(batches):
            self._check(domain)
            groups.setdefault(domain, []).append(i)
        order = self._visit_order(list(groups))
        results: list[Any] = [None] * len(batches)
        for k, domain in enumerate(order):
            with self.use(domain) as teacher:  # pin first, so the prefetch cannot evict it
                if prefetch and k + 1 < len(order):
                    self.prefetch(order[k + 1])
                for i in groups[domain]:
                    results[i] = score_fn(teacher, batches[i][1])
        return results

    def stats(self) -> PoolStats:
        with self._lock:
            frac = self._hidden_s / self._load_s if self._load_s > 0 else 0.0
            return PoolStats(self._swaps, self._loads, self._evictions, self._load_s, self._hidden_s,
                             self._wait_s, frac)

    def close(self) -> None:
        """Cancel queued prefetches, wait for a running one, drop every model."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(RuntimeError("TeacherPool closed before the load finished"))
            self._pending.clear()
            self._staged.clear()
            self._resident.clear()

    def __enter__(self) -> TeacherPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------
    def _check(self, domain: str) -> None:
        if domain not in self.paths:
            raise KeyError(f"unknown teacher domain {domain!r}; known domains: {', '.join(self.paths)}")

    def _visit_order(self, domains: list[str]) -> list[str]:
        with self._lock:
            resident = [d for d in self._resident if d in domains]
            coming = [d for d in domains if d not in resident and (d in self._staged or d in self._pending)]
        rest = [d for d in domains if d not in resident and d not in coming]
        return resident + coming + rest

    def _acquire(self, domain: str, pin: bool) -> nn.Module:
        self._check(domain)
        waited = 0.0
        while True:
            sync = False
            with self._lock:
                if self._closed:
                    raise RuntimeError("TeacherPool is closed")
                if domain in self._staged:
                    self._install(domain, required=True)
                if domain in self._resident:
                    self._resident.move_to_end(domain)
                    if pin:
                        self._in_use[domain] += 1
                    if domain in self._prefetched:
                        self._hidden_s += max(0.0, self._prefetched.pop(domain) - waited)
                    self._wait_s += waited
                    return self._resident[domain]
                fut = self._pending.get(domain)
                if fut is None:
                    fut = self._pending[domain] = Future()
                    sync = True
            t0 = time.perf_counter()
            if sync:
                self._load(domain, fut, False)
            fut.result()  # re-raises a failed load
            waited += time.perf_counter() - t0

    def _load(self, domain: str, fut: Future, background: bool) -> None:
        """Read one checkpoint (outside the lock), stage it, and for a prefetch try to install it."""
        if fut.done():  # failed by close() before it started
            return
        t0 = time.perf_counter()
        try:
            model = self.loader(self.paths[domain])
        except BaseException as e:
            with self._lock:
                self._pending.pop(domain, None)
            if not fut.done():
                fut.set_exception(e)
            return
        secs = time.perf_counter() - t0
        with self._lock:
            self._pending.pop(domain, None)
            self._loads += 1
            self._load_s += secs
            if self._closed:
                model = None
            else:
                self._staged[domain] = model.eval()
                if background:
                    self._prefetched[domain] = secs
                    with suppress(Exception):  # e.g. out of device memory: stays staged; `get` retries and raises
                        self._install(domain, required=False)
        if not fut.done():  # close() may have failed it already
            fut.set_result(None)

    def _install(self, domain: str, required: bool) -> bool:
        """Move a staged teacher into the resident set (lock held), evicting idle LRU teachers.
        Returns False (stays staged) when every slot is pinned and `required` is false."""
        while len(self._resident) >= self.max_resident:
            victim = next((d for d in self._resident if not self._in_use[d]), None)
            if victim is None:
                if not required:
                    return False
                raise RuntimeError(
                    f"cannot install teacher {domain!r}: all {self.max_resident} resident teachers are in use "
                    f"({', '.join(self._resident)}); raise max_resident or leave a `use` block first"
                )
            del self._resident[victim]
            self._prefetched.pop(victim, None)  # evicted before anyone took it: a wasted prefetch
            self._evictions += 1
        model = self._staged[domain]
        if self.device.type != "cpu":
            model = model.to(self.device)
        del self._staged[domain]
        self._resident[domain] = model
        self._swaps += 1
        return True
