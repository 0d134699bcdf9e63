"""The store never drops what it was handed: a write that fails because the disk is full keeps its batch, retries,
and once space returns every trajectory and every consumption row is stored exactly once.

The Recorder (a stage's one writer) is tried on a real full disk: a 4 MiB tmpfs mounted by the test (as root, as
the sandbox's workspace quota is) and filled up, so DuckDB itself fails to write its WAL ("No space left on
device"); space returns when the filler file is removed. The StoreWriter thread is tried with the store's write
raising OSError(ENOSPC) (monkeypatched) a given number of times. No waiting on a clock: the retry delays are 0 and
the "sleep" between attempts is the test's hook."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from pathlib import Path

import numpy as np
import pytest
from trajgen import as_stored, random_trajectory

from stages.recorder import Recorder
from store import StoreIOError, StoreWriter, TrajectoryStore


def _make(n: int, seed: int, prefix: str):
    rng = np.random.default_rng(seed)
    return [random_trajectory(rng, f"{prefix}{i:03d}") for i in range(n)]


def _rows(trajs, step: int) -> list[dict]:
    return [{"trajectory_id": t.trajectory_id, "stage": "sao", "consumer": "sao:math", "step": step,
             "policy_version": step, "staleness": 0, "outcome": "trained"} for t in trajs]


@contextlib.contextmanager
def _tiny_disk(path: Path, size: str = "4m"):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(disk: Path) -> Path:
    """Write a filler file until the disk refuses (ENOSPC); returns it (remove it and space returns)."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def _stored(path: Path):
    with TrajectoryStore(path, read_only=True) as st:
        return {t.trajectory_id: t for t in st.read()}, st.consumption()


def test_recorder_on_a_full_disk_keeps_the_batch_and_loses_no_row_once_space_returns(tmp_path):
    with _tiny_disk(tmp_path / "disk") as disk:
        db = disk / "t.duckdb"
        frees = []

        def free_space(delay: float) -> None:  # the Recorder's wait between attempts: here, space comes back
            frees.append(delay)
            filler.unlink(missing_ok=True)

        rec = Recorder(db, retry_delays=(0.0, 0.0), sleep=free_space)
        first, later = _make(3, 1, "a"), _make(12, 2, "b")
        consumption = _rows(first, 1)
        for t in first:
            rec.add(t)
        assert rec.flush(consumption) == 3
        filler = _fill(disk)
        for t in later:
            rec.add(t)
        consumption += _rows(later, 2)
        # the first attempt hits the full disk (DuckDB cannot write its WAL); the batch is kept, space returns in the
        # wait, the second attempt writes it all
        assert rec.flush(consumption) == 12
        assert frees == [0.0] and rec.retries == 1 and rec.pending == []
        # a full disk that does not clear: flush gives up loudly and keeps everything pending for the next flush
        filler = _fill(disk)
        rec.sleep = lambda d: None
        last = _make(5, 3, "c")
        for t in last:
            rec.add(t)
        consumption += _rows(last, 3)
        with pytest.raises(StoreIOError, match="No space left on device.*stay pending"):
            rec.flush(consumption)
        assert [t.trajectory_id for t in rec.pending] == [t.trajectory_id for t in last]
        filler.unlink()
        assert rec.flush(consumption) == 5
        got, rows = _stored(db)
    every = first + later + last
    assert sorted(got) == sorted(t.trajectory_id for t in every)
    assert all(got[t.trajectory_id] == as_stored(t) for t in every)
    assert rows == consumption  # each row once, in order
    assert rec.written == 20 and rec.rows == 20


def test_store_writer_retries_a_full_disk_and_holds_what_it_cannot_write(tmp_path, monkeypatch):
    fails = {"left": 0, "calls": 0}
    real = TrajectoryStore.write_arrow

    def full_disk(self, *a, **kw):
        fails["calls"] += 1
        if fails["left"] > 0:
            fails["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **kw)

    monkeypatch.setattr(TrajectoryStore, "write_arrow", full_disk)
    waits = []
    trajs = _make(30, 4, "w")
    with TrajectoryStore(tmp_path / "t.db") as store:
        w = StoreWriter(store, batch_size=10, flush_interval=30, retry_delays=(0.0, 0.0), sleep=waits.append)
        fails["left"] = 2  # the first batch fails twice, then space returns: written on its third attempt
        for t in trajs[:10]:
            w.submit(t)
        w.flush()
        assert store.count() == 10 and w.retries == 2 and waits == [0.0, 0.0]
        fails["left"] = 6  # the disk stays full through the batch's 3 attempts and the flush's 3: held, and said
        for t in trajs[10:20]:
            w.submit(t)
        with pytest.raises(StoreIOError, match="10 trajectories are not written yet.*No space left"):
            w.flush()
        assert store.count() == 10 and w.retries == 6 and fails["left"] == 0
        fails["left"] = 0  # space returned: the held batch goes first, with the new ones
        for t in trajs[20:]:
            w.submit(t)
        w.close()
        got = {t.trajectory_id: t for t in store.read()}
    assert sorted(got) == sorted(t.trajectory_id for t in trajs)
    assert all(got[t.trajectory_id] == as_stored(t) for t in trajs)
    assert w.committed == 30
