"""The trajectory store's one writer in a stage process: every trajectory the stage generates, and what it did with
each one."""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


class Recorder:
    """Every trajectory a stage generates, and what the stage did with it, into the trajectory store.

    Trajectories arrive as they finish (`add`, from any thread); `flush(consumption)` writes those not yet written
    plus the new consumption rows in one transaction. Stages flush when they checkpoint, so after a kill the store
    holds what the resumed stage's checkpoint saw. This stage process is the store's one writer meanwhile (its
    asset holds the `duckdb_writer` pool). Without a store path nothing is written.

    Nothing handed over is dropped: trajectories leave `pending` (and consumption rows count as written) only once
    their transaction committed. A write that fails for a reason outside the batch (`store.StoreIOError`: the disk
    is full, an I/O error; nothing was written) is tried again after each of `retry_delays` seconds; if it still
    fails, flush raises and everything stays pending for the next flush (a stage that fails here has not saved the
    checkpoint that follows the flush, so its resumed run redoes those steps)."""

    def __init__(self, store_path: Path | str | None, retry_delays: tuple[float, ...] | None = None, sleep=time.sleep):
        import threading

        from store import RETRY_DELAYS

        self.path = Path(store_path) if store_path else None
        self.pending: list = []
        self.lock = threading.Lock()
        self.flushing = threading.Lock()  # one flush at a time (trajectories are added meanwhile)
        self.retry_delays = RETRY_DELAYS if retry_delays is None else tuple(retry_delays)
        self.sleep = sleep
        self.rows_done = 0
        self.written = 0
        self.rows = 0
        self.retries = 0  # failed attempts that were tried again

    def add(self, traj) -> None:
        with self.lock:
            self.pending.append(traj)

    def flush(self, consumption: list[dict]) -> int:
        if self.path is None:
            return 0
        from store import StoreIOError, TrajectoryStore

        with self.flushing:
            with self.lock:
                trajs = list(self.pending)  # they stay pending until written
            rows = consumption[self.rows_done:]
            for delay in (*self.retry_delays, None):
                try:
                    with TrajectoryStore(self.path) as st:
                        n = st.write(trajs, rows)
                    break
                except OSError as e:  # StoreIOError (disk full, I/O): nothing of the batch was written
                    if delay is None:
                        raise StoreIOError(f"{e} — gave up after {len(self.retry_delays) + 1} attempts; the "
                                           f"{len(trajs)} trajectories and {len(rows)} consumption rows stay pending "
                                           "for the next flush") from e
                    self.retries += 1
                    log.warning("store write failed (%s); the batch is kept and written again in %g s", e, delay)
                    self.sleep(delay)
            with self.lock:
                del self.pending[: len(trajs)]  # `add` only appends: what came in meanwhile stays
            self.rows_done += len(rows)
        self.written += n
        self.rows += len(rows)
        return n

    def repair(self, consumer: str, step: int) -> int:
        """Before a resumed stage redoes the steps after its checkpoint `step`: drop the consumption rows a killed
        attempt wrote for them (it flushes before it checkpoints, so the store can be ahead of the state, never
        behind it). Returns how many rows were dropped."""
        if self.path is None or not self.path.exists():
            return 0
        from store import TrajectoryStore

        with TrajectoryStore(self.path) as st:
            return st.drop_consumption_after(consumer, step)
