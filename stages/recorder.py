"""The trajectory store's one writer in a stage process: every trajectory the stage generates, and what it did with
each one."""

from __future__ import annotations

from pathlib import Path


class Recorder:
    """Every trajectory a stage generates, and what the stage did with it, into the trajectory store.

    Trajectories arrive as they finish (`add`, from any thread); `flush(consumption)` writes those not yet written
    plus the new consumption rows in one transaction. Stages flush when they checkpoint, so after a kill the store
    holds what the resumed stage's checkpoint saw. This stage process is the store's one writer meanwhile (its
    asset holds the `duckdb_writer` pool). Without a store path nothing is written."""

    def __init__(self, store_path: Path | str | None):
        import threading

        self.path = Path(store_path) if store_path else None
        self.pending: list = []
        self.lock = threading.Lock()
        self.rows_done = 0
        self.written = 0
        self.rows = 0

    def add(self, traj) -> None:
        with self.lock:
            self.pending.append(traj)

    def flush(self, consumption: list[dict]) -> int:
        if self.path is None:
            return 0
        from store import TrajectoryStore

        with self.lock:
            trajs, self.pending = self.pending, []
        rows = consumption[self.rows_done:]
        with TrajectoryStore(self.path) as st:
            n = st.write(trajs, rows)
        self.rows_done = len(consumption)
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
