"""`StoreWriter`: the one thread that writes a `TrajectoryStore`, fed by any number of producer threads.

Rollout workers call `submit(traj)` and go on; they never touch DuckDB. The writer thread collects
trajectories and commits them as one transaction every `batch_size` trajectories or `flush_interval`
seconds after the first one of a batch arrived, whichever comes first. `flush()` blocks until everything
submitted before it is committed; `close()` flushes and stops the thread.

Bad input loses nothing else: when a batch fails (an id already stored, a dict that is not JSON, a token
id outside int32), the writer commits the rest of the batch and keeps the failures; the next `flush()` or
`close()` raises `StoreWriteError` listing them. Of two trajectories with the same id the first one
stored wins.

A write that fails for a reason outside the batch (`StoreIOError`: the disk is full, an I/O error) drops
nothing: the batch is written again after each of `retry_delays` seconds; if the store still cannot write,
the writer holds the batch, `flush()` raises `StoreIOError` saying how many it holds, and the next commit,
`flush()` or `close()` writes them first.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollout.types import Trajectory
from store.trajectories import RETRY_DELAYS, DuplicateTrajectoryError, StoreIOError, TrajectoryStore

log = logging.getLogger(__name__)


class StoreWriteError(RuntimeError):
    """Trajectories the writer could not store: `failures` holds (trajectory_id, reason) pairs."""

    def __init__(self, failures: Sequence[tuple[str, str]]):
        self.failures = list(failures)
        shown = "; ".join(f"{tid!r}: {why}" for tid, why in self.failures[:10])
        more = f" (and {len(self.failures) - 10} more)" if len(self.failures) > 10 else ""
        super().__init__(f"{len(self.failures)} trajectories were not stored: {shown}{more}")


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


class _Held(Exception):  # noqa: N818 - internal signal, never escapes the writer thread
    """The store could not write (I/O): `rest` is what of the batch is not written yet."""

    def __init__(self, rest: list[Trajectory], error: OSError):
        super().__init__(str(error))
        self.rest, self.error = rest, error


_STOP = object()


class StoreWriter:
    """Background writer owning `store` (a TrajectoryStore, or a path to open one that it then also closes).

    batch_size: commit after this many trajectories. flush_interval: commit at most this many seconds after
    the first trajectory of a batch arrived. max_queue: `submit` blocks while this many wait (backpressure).
    on_commit: called on the writer thread with the ids of each committed batch (an exception it raises
    is reported by the next flush/close).

    Reads go through `writer.store` from any thread (each thread gets its own cursor). Use it as a context
    manager, or call `close()`; at interpreter exit an unclosed writer is flushed.
    """

    def __init__(
        self,
        store: TrajectoryStore | str | os.PathLike,
        *,
        batch_size: int = 256,
        flush_interval: float = 1.0,
        max_queue: int = 10_000,
        on_commit: Callable[[list[str]], None] | None = None,
        retry_delays: Sequence[float] = RETRY_DELAYS,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if flush_interval <= 0:
            raise ValueError(f"flush_interval must be > 0, got {flush_interval}")
        self._owns = not isinstance(store, TrajectoryStore)
        self.store = TrajectoryStore(store) if self._owns else store
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.on_commit = on_commit
        self.retry_delays, self._sleep = tuple(retry_delays), sleep
        self.committed = 0  # trajectories committed so far
        self.retries = 0  # failed attempts at a batch (I/O) that were tried again
        self._held: list[Trajectory] = []  # what the store could not write yet (I/O): written first next time
        self._held_error: OSError | None = None
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # orders submit against close
        self._flock = threading.Lock()  # guards _failures (the writer thread never takes _lock)
        self._closed = False
        self._failures: list[tuple[str, str]] = []
        self._fatal: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- producers

    def submit(self, traj: Trajectory) -> None:
        """Queue one trajectory for the next batch (blocks while the queue is full). Thread-safe."""
        if not isinstance(traj, Trajectory):
            raise TypeError(f"expected rollout.types.Trajectory, got {type(traj).__name__}")
        with self._lock:
            if self._closed:
                raise RuntimeError("StoreWriter is closed")
            self._check_alive()
            self._q.put(traj)

    def flush(self, timeout: float | None = None) -> None:
        """Block until everything submitted before this call is committed; raise StoreWriteError for failures."""
        with self._lock:
            if self._closed:
                raise RuntimeError("StoreWriter is closed")
            self._check_alive()
            req = _Flush()
            self._q.put(req)
        while not req.done.wait(0.05 if timeout is None else min(0.05, timeout)):
            self._check_alive()
            if timeout is not None:
                timeout -= 0.05
                if timeout <= 0:
                    raise TimeoutError("StoreWriter.flush timed out")
        self._raise_failures()

    def close(self) -> None:
        """Commit what is queued, stop the thread, close the store if the writer opened it; raise any failures."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread.is_alive():
                self._q.put(_STOP)
        atexit.unregister(self.close)
        self._thread.join()
        if self._owns:
            self.store.close()
        if self._fatal is not None:
            raise RuntimeError(f"the store writer thread died: {self._fatal!r}") from self._fatal
        self._raise_failures()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writer thread

    def _check_alive(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"the store writer thread died: {self._fatal!r}") from self._fatal

    def _raise_failures(self) -> None:
        with self._flock:
            failures, self._failures = self._failures, []
            held, err = len(self._held), self._held_error
        if held:
            raise StoreIOError(f"{held} trajectories are not written yet: the store could not write ({err}); the "
                               "writer holds them and writes them first at the next commit, flush or close")
        if failures:
            raise StoreWriteError(failures)

    def _fail(self, traj: Trajectory, why: str) -> None:
        with self._flock:
            self._failures.append((traj.trajectory_id, why))

    def _run(self) -> None:
        pending: list[Trajectory] = []
        deadline = 0.0
        try:
            while True:
                try:
                    timeout = None if not pending else max(0.0, deadline - time.monotonic())
                    item = self._q.get(timeout=timeout)
                except queue.Empty:
                    item = None
                if isinstance(item, Trajectory):
                    if not pending:
                        deadline = time.monotonic() + self.flush_interval
                    pending.append(item)
                    if len(pending) < self.batch_size and time.monotonic() < deadline:
                        continue
                if pending or (self._held and item is not None):  # held ones: again at a flush or close
                    self._commit(pending)
                    pending = []
                if isinstance(item, _Flush):
                    item.done.set()
                elif item is _STOP:
                    return
        except BaseException as e:  # keep it for submit/flush/close to raise
            self._fatal = e
            for t in self._held + pending:
                self._fail(t, f"not written: writer thread died ({e!r})")
            raise

    def _commit(self, batch: list[Trajectory]) -> None:
        """Write what is held and `batch`; an I/O failure is retried after each of `retry_delays`, and what is still
        not written after the last is held (never dropped)."""
        with self._flock:
            batch, self._held, self._held_error = self._held + batch, [], None
        for delay in (*self.retry_delays, None):
            try:
                self._write(batch)
                return
            except _Held as h:
                batch = h.rest
                if delay is None:
                    with self._flock:
                        self._held, self._held_error = batch, h.error
                    log.warning("store writer: holding %d trajectories the store could not write (%s)", len(batch),
                                h.error)
                    return
                self.retries += 1
                log.warning("store write failed (%s); %d trajectories kept, written again in %g s", h.error,
                            len(batch), delay)
                self._sleep(delay)

    def _write(self, batch: list[Trajectory]) -> None:
        """Commit `batch`, setting the bad ones aside; raises _Held with what is left when the store cannot write."""
        try:
            self.store.write(batch)
        except OSError as e:  # StoreIOError (disk full, I/O) and any other OSError: nothing of it was written
            raise _Held(batch, e) from e
        except DuplicateTrajectoryError as e:
            keep, seen = [], set()
            for t in batch:
                if t.trajectory_id in e.existing or t.trajectory_id in seen:
                    self._fail(t, "duplicate trajectory id: a trajectory with this id is already stored")
                else:
                    seen.add(t.trajectory_id)
                    keep.append(t)
            if keep:
                self._write(keep)
            return
        except Exception:
            # find the culprits: write one at a time, keep the good ones
            for i, t in enumerate(batch):
                try:
                    self.store.write([t])
                except OSError as e:
                    raise _Held(batch[i:], e) from e
                except Exception as e:
                    self._fail(t, f"{type(e).__name__}: {e}")
                else:
                    self._committed([t])
            return
        self._committed(batch)

    def _committed(self, batch: list[Trajectory]) -> None:
        self.committed += len(batch)
        if self.on_commit is not None:
            try:
                self.on_commit([t.trajectory_id for t in batch])
            except Exception as e:
                with self._flock:
                    self._failures.append(("<on_commit>", f"{type(e).__name__}: {e}"))
