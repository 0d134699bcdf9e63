"""The trajectory store: exact round trips, append-only ids, filters, the writer thread, Parquet exports, kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from trajgen import as_stored, random_trajectory

from rollout.types import STATUSES, Segment, Trajectory
from store import (
    DuplicateTrajectoryError,
    ParquetReader,
    StoreWriteError,
    StoreWriter,
    TrajectoryStore,
    from_arrow,
    to_arrow,
)

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def make(n: int, seed: int = 0, prefix: str = "t", **kw) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [random_trajectory(rng, f"{prefix}{i:04d}", **kw) for i in range(n)]


def edge_cases() -> list[Trajectory]:
    base = make(1, seed=99, prefix="edge")[0]
    no_segments = replace(base, trajectory_id="edge-nosegs", segments=[], status="crashed", error="sandbox died")
    empty_segment = replace(base, trajectory_id="edge-emptyseg", segments=[Segment([], [], [], [])], status="aborted")
    prompt_only = replace(
        base,
        trajectory_id="edge-prompt-only",
        segments=[Segment([1, 2, 3], [False] * 3, [0.0] * 3, [-1] * 3, 0, 1, False)],
        verifier={"nested": {"a": [1, 2.5, None, "x"], "b": {}}, "nan": float("nan")},
        timings={},
        reward=-0.0,
    )
    big = Segment([2**31 - 1, 0], [True, True], [-1e-30, -88.5], [7, 9])
    big_ids = replace(base, trajectory_id="edge-bigids", segments=[big])
    return [no_segments, empty_segment, prompt_only, big_ids]


def same(a: Trajectory, b: Trajectory) -> bool:
    """Equality that treats NaN == NaN inside the verifier/timings dicts (JSON text comparison)."""
    return replace(a, verifier={}, timings={}) == replace(b, verifier={}, timings={}) and (
        json.dumps(a.verifier, sort_keys=True) == json.dumps(b.verifier, sort_keys=True)
        and json.dumps(a.timings, sort_keys=True) == json.dumps(b.timings, sort_keys=True)
    )


def rounded(x):
    """Floats rounded to 12 significant digits, recursively (sums may add up in a different order)."""
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return float(f"{x:.12g}") if isinstance(x, float) else x


def by_id(trajs: list[Trajectory]) -> dict[str, Trajectory]:
    return {t.trajectory_id: t for t in trajs}


def test_round_trip_is_exact(tmp_path):
    trajs = make(40) + edge_cases()
    db = tmp_path / "t.db"
    with TrajectoryStore(db) as store:
        assert store.write(trajs) == len(trajs)
        got = by_id(store.read())
        assert set(got) == {t.trajectory_id for t in trajs}
        for t in trajs:
            assert same(got[t.trajectory_id], as_stored(t)), t.trajectory_id
            # float32 log-probs: within float32 rounding of what was written
            for s_in, s_out in zip(t.segments, got[t.trajectory_id].segments):
                np.testing.assert_allclose(s_out.logprobs, s_in.logprobs, rtol=1e-6, atol=0)
        # derived columns equal the Trajectory's own (pure-Python) accounting
        rows = store.cursor().execute(
            "SELECT trajectory_id, n_tokens, n_trainable, min_version, max_version, n_segments FROM trajectories"
        ).fetchall()
        for tid, n_tok, n_train, vmin, vmax, n_seg in rows:
            t = next(x for x in trajs if x.trajectory_id == tid)
            assert (n_tok, n_train, (vmin, vmax), n_seg) == (t.n_tokens, t.n_trainable, t.policy_versions(), len(t.segments))
        assert store.iterations() == [0]
        # the Arrow path gives the same data without Python lists
        tt, st = store.read_arrow(status="completed")
        assert from_arrow(tt, st) == store.read(status="completed")
        assert st.column("trajectory_id").to_pylist() == sorted(st.column("trajectory_id").to_pylist())
        one = next(t for t in trajs if t.status == "completed")
        row = tt.column("trajectory_id").to_pylist().index(one.trajectory_id)
        assert st.filter(pc.equal(st["trajectory_id"], one.trajectory_id))["tokens"].to_pylist()[0] == one.segments[0].tokens
        assert json.loads(tt["verifier"][row].as_py()) == one.verifier
    # reopened read-only (WAL checkpointed on close): the same trajectories
    with TrajectoryStore(db, read_only=True) as ro:
        again = by_id(ro.read())
        assert all(same(again[k], got[k]) for k in got)
        with pytest.raises(RuntimeError, match="read-only"):
            ro.write(make(1, seed=5, prefix="ro"))


def test_duplicates_and_bad_input_raise_and_write_nothing(tmp_path):
    with TrajectoryStore(tmp_path / "t.db") as store:
        first = make(5)
        store.write(first)
        fresh = make(3, seed=1, prefix="new")
        clash = replace(make(1, seed=2)[0], trajectory_id=first[2].trajectory_id)
        with pytest.raises(DuplicateTrajectoryError, match="already stored: 't0002'") as e:
            store.write(fresh + [clash])
        assert isinstance(e.value, ValueError) and e.value.existing == ["t0002"]
        with pytest.raises(DuplicateTrajectoryError, match="repeated within the batch: 'new0001'"):
            store.write(fresh + [fresh[1]])
        with pytest.raises(ValueError, match="tokens do not convert to int32"):
            store.write(fresh[:1] + [replace(fresh[2], segments=[Segment([2**40], [True], [0.0], [1])])])
        with pytest.raises(ValueError, match="'new0002': verifier is not JSON"):
            store.write(fresh[:2] + [replace(fresh[2], verifier={"f": object()})])
        tt, st = to_arrow(fresh)
        bad_status = tt.set_column(tt.schema.get_field_index("status"), "status", pa.array(["done"] * len(fresh)))
        with pytest.raises(ValueError, match="breaks a store constraint"):
            store.write_arrow(bad_status, st)
        with pytest.raises(ValueError, match="does not match n_segments .* 'new0000'"):
            store.write_arrow(tt, st.slice(1))
        # nothing of the failed batches got in; the stored one is untouched
        assert store.count() == 5
        assert by_id(store.read())["t0002"] == as_stored(first[2])
        assert store.cursor().execute("SELECT count(*) FROM segments").fetchone()[0] == sum(len(t.segments) for t in first)
        store.write(fresh)  # the store still works
        assert store.count() == 8


def test_filters_match_a_python_reference(tmp_path):
    rng = np.random.default_rng(3)
    trajs = [
        random_trajectory(rng, f"f{i:03d}", iteration=i % 3, version=int(rng.integers(2, 9)), status=STATUSES[i % 4])
        for i in range(60)
    ] + edge_cases()
    with TrajectoryStore(tmp_path / "t.db") as store:
        store.write(trajs)

        def ref(iteration=None, status=None, min_version=None, max_staleness=None, current_version=None, ids=None,
                domain=None):
            its = None if iteration is None else ({iteration} if isinstance(iteration, int) else set(iteration))
            sts = None if status is None else ({status} if isinstance(status, str) else set(status))
            doms = None if domain is None else ({domain} if isinstance(domain, str) else set(domain))
            out = []
            for t in trajs:
                if ids is not None and t.trajectory_id not in set(ids):
                    continue
                if doms is not None and t.domain not in doms:
                    continue
                vmin = t.policy_versions()[0]
                gen = t.n_trainable > 0
                if its is not None and t.iteration not in its:
                    continue
                if sts is not None and t.status not in sts:
                    continue
                if min_version is not None and gen and vmin < min_version:
                    continue
                if max_staleness is not None and gen and current_version - vmin > max_staleness:
                    continue
                out.append(t)
            return sorted(out, key=lambda t: (t.iteration, t.created, t.trajectory_id))

        cases = [
            {},
            {"iteration": 1},
            {"iteration": [0, 2]},
            {"status": "completed"},
            {"status": ["truncated", "crashed"], "iteration": 2},
            {"min_version": 5},
            {"max_staleness": 0, "current_version": 7},
            {"max_staleness": 2, "current_version": 7, "status": "completed"},
            {"max_staleness": 3, "current_version": 6, "iteration": 0, "min_version": 4},
            {"ids": ["f007", "f003", "f050", "nope"]},
            {"ids": [f"f{i:03d}" for i in range(0, 60, 2)], "iteration": 1, "status": "completed"},
            {"ids": []},
            {"domain": "math"},
            {"domain": ["code", "reasoning"], "iteration": 2},
        ]
        for kw in cases:
            want = ref(**kw)
            assert [t.trajectory_id for t in store.read(**kw)] == [t.trajectory_id for t in want], kw
            assert store.count(**kw) == len(want), kw
        assert 0 < store.count(max_staleness=1, current_version=7) < len(trajs)
        assert [t.trajectory_id for t in store.read(limit=7)] == [t.trajectory_id for t in ref()[:7]]
        assert store.read(iteration=9) == [] and store.read(limit=0) == []
        with pytest.raises(ValueError, match="max_staleness needs current_version"):
            store.read(max_staleness=1)
        with pytest.raises(ValueError, match="only used together with max_staleness"):
            store.count(current_version=3)
        with pytest.raises(ValueError, match="status 'done'"):
            store.read(status="done")
        with pytest.raises(ValueError, match="ids must be a list"):
            store.read(ids="f001")


def test_domain_rewards_match_a_hand_count(tmp_path):
    trajs = make(40, iteration=2) + make(10, seed=1, prefix="other", iteration=3)
    pick = [t.trajectory_id for t in trajs[::3]] + ["absent"]
    with TrajectoryStore(tmp_path / "t.db") as store:
        store.write(trajs)
        got = store.domain_rewards(pick, iteration=2)
        mine = [t for t in trajs if t.trajectory_id in set(pick) and t.iteration == 2]
        assert sorted(got) == sorted({t.domain for t in mine})
        for dom, g in got.items():
            dt = sorted((t for t in mine if t.domain == dom), key=lambda t: (t.created, t.trajectory_id))
            assert g["ids"] == [t.trajectory_id for t in dt]
            assert g["trajectories"] == len(dt) and sum(g["by_status"].values()) == len(dt)
            assert g["mean_reward"] == pytest.approx(np.mean([t.reward for t in dt]), rel=1e-12)
        # stats over the same ids agree with the per-domain counts
        assert store.stats(2, ids=pick)["trajectories"] == len(mine) == sum(g["trajectories"] for g in got.values())
        assert store.domain_rewards([], iteration=2) == {}


def test_stats_match_a_hand_count(tmp_path):
    trajs = make(50, iteration=4) + make(10, seed=1, prefix="other", iteration=5)
    with TrajectoryStore(tmp_path / "t.db") as store:
        store.write(trajs)
        st = store.stats(4)
        mine = [t for t in trajs if t.iteration == 4]
        assert st["trajectories"] == 50
        assert st["tokens"] == sum(t.n_tokens for t in mine)
        assert st["trainable_tokens"] == sum(t.n_trainable for t in mine)
        assert st["mean_reward"] == pytest.approx(np.mean([t.reward for t in mine]), rel=1e-12)
        assert st["by_status"] == {s: n for s in STATUSES if (n := sum(t.status == s for t in mine))}
        for fam, fs in st["by_family"].items():
            ft = [t for t in mine if t.family == fam]
            assert fs["trajectories"] == len(ft) and fs["tokens"] == sum(t.n_tokens for t in ft)
            assert fs["mean_reward"] == pytest.approx(np.mean([t.reward for t in ft]), rel=1e-12)
            assert sum(fs["by_status"].values()) == len(ft)
        assert sum(f["trajectories"] for f in st["by_family"].values()) == 50
        assert store.stats()["trajectories"] == 60
        assert store.stats(7) == {
            "trajectories": 0, "tokens": 0, "trainable_tokens": 0, "by_status": {}, "mean_reward": None, "by_family": {}
        }


def test_writer_thread_with_producers_and_a_concurrent_reader(tmp_path):
    """4 producer threads feed the writer; a reader cursor in this process sees only whole batches, growing."""
    store = TrajectoryStore(tmp_path / "t.db")
    produced = {p: make(50, seed=10 + p, prefix=f"p{p}-") for p in range(4)}
    total = sum(len(v) for v in produced.values())
    totals = [0]  # cumulative committed count after each batch (appended on the writer thread)
    seen = threading.Condition()
    observed: list[tuple[int, int, int, int]] = []
    stop = threading.Event()

    def on_commit(ids: list[str]) -> None:
        totals.append(totals[-1] + len(ids))
        with seen:  # hand-shake: wait until the reader has seen this batch, so every state gets observed
            seen.wait_for(lambda: observed and observed[-1][1] >= totals[-1], timeout=5)

    def reader() -> None:
        cur = store.cursor()
        while not stop.is_set():
            api = store.count()
            n, n_seg, want_seg = cur.execute(
                "SELECT (SELECT count(*) FROM trajectories), (SELECT count(*) FROM segments), "
                "(SELECT coalesce(sum(n_segments), 0) FROM trajectories)"
            ).fetchone()
            with seen:
                observed.append((api, n, n_seg, int(want_seg)))
                seen.notify_all()
        cur.close()

    def producer(p: int) -> None:
        for i, t in enumerate(produced[p]):
            writer.submit(t)
            if i % 10 == 0:
                time.sleep(0.005)

    writer = StoreWriter(store, batch_size=16, flush_interval=0.02, on_commit=on_commit)
    r = threading.Thread(target=reader)
    r.start()
    with seen:  # the empty store is the first state the reader sees
        seen.wait_for(lambda: observed, timeout=10)
    ps = [threading.Thread(target=producer, args=(p,)) for p in range(4)]
    for t in ps:
        t.start()
    for t in ps:
        t.join()
    writer.flush()
    assert store.count() == total
    writer.close()
    stop.set()
    r.join()

    assert writer.committed == total and totals[-1] == total and len(totals) > 4
    counts = [c for api, n, _, _ in observed for c in (api, n)]
    assert counts == sorted(counts), "counts only grow"
    assert set(counts) <= set(totals), "a reader never sees part of a batch"
    assert set(totals) <= set(counts), "every committed state was observed"
    assert all(n_seg == want for _, _, n_seg, want in observed), "segments always complete"
    got = by_id(store.read())
    want = by_id([t for v in produced.values() for t in v])
    assert got.keys() == want.keys() and all(got[k] == as_stored(want[k]) for k in want)
    store.close()


def test_writer_keeps_good_trajectories_and_reports_bad_ones(tmp_path):
    with TrajectoryStore(tmp_path / "t.db") as store:
        old = make(1, seed=7, prefix="old")[0]
        store.write([old])
        good = make(4, seed=8, prefix="good")
        bad_json = replace(make(1, seed=9, prefix="badjson")[0], verifier={"x": {1, 2}})
        clash = replace(good[0], trajectory_id=old.trajectory_id)  # already stored
        again = replace(good[3], reward=99.0)  # same id as good[3], submitted later
        with StoreWriter(store, batch_size=100, flush_interval=30) as w:
            for t in [good[0], clash, good[1], bad_json, good[2], good[3], again]:
                w.submit(t)
            with pytest.raises(StoreWriteError) as e:
                w.flush()
            assert sorted(tid for tid, _ in e.value.failures) == sorted([old.trajectory_id, "badjson0000", "good0003"])
            assert "not JSON-serialisable" in str(e.value) and "duplicate trajectory id" in str(e.value)
            w.flush()  # failures are reported once
        # a lone trajectory is committed by the timer, without flush
        late = make(1, seed=11, prefix="late")[0]
        w = StoreWriter(store, batch_size=100, flush_interval=0.05)
        w.submit(late)
        deadline = time.monotonic() + 10
        while store.count() < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.count() == 6
        w.close()
        got = by_id(store.read())
        assert set(got) == {old.trajectory_id, "late0000"} | {t.trajectory_id for t in good}
        assert got[old.trajectory_id] == as_stored(old)  # not overwritten
        assert got["good0003"].reward == good[3].reward  # the first one stored wins
        with pytest.raises(RuntimeError, match="closed"):
            w.submit(late)
        with StoreWriter(store) as w, pytest.raises(TypeError, match="expected rollout.types.Trajectory"):
            w.submit({"trajectory_id": "x"})


READER_CHILD = r"""
import sys
sys.path[:0] = [sys.argv[1]]
from store import ParquetReader, StoreLockedError, TrajectoryStore
r = ParquetReader(sys.argv[2])
ts = r.read(iteration=1)
print("count", r.count(), len(ts), sum(t.n_tokens for t in ts), flush=True)
try:
    TrajectoryStore(sys.argv[3])
except StoreLockedError as e:
    print("locked", e, flush=True)
"""


def test_parquet_export_reads_back_like_the_store(tmp_path):
    db, out = tmp_path / "t.db", tmp_path / "export"
    with TrajectoryStore(db) as store:
        store.write(make(30, iteration=0) + make(25, seed=1, prefix="i1-", iteration=1) + edge_cases())
        folders = [store.export_parquet(i, out) for i in (0, 1)]
        assert [f.name for f in folders] == ["iteration-000000", "iteration-000001"]
        pq = ParquetReader(out)
        assert pq.iterations() == [0, 1]
        for kw in [{}, {"iteration": 1}, {"status": "completed"}, {"max_staleness": 1, "current_version": 7}, {"limit": 9}]:
            a, b = pq.read(**kw), store.read(**kw)
            assert len(a) > 0 and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)), kw
        assert pq.count(status="crashed") == store.count(status="crashed")
        assert rounded(pq.stats(0)) == rounded(store.stats(0)) and rounded(pq.stats()) == rounded(store.stats())

        # another process reads the export while this one holds the database, which it cannot open
        proc = subprocess.run(
            [sys.executable, "-c", READER_CHILD, str(ROOT), str(out), str(db)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        ones = store.read(iteration=1)
        assert f"count {store.count()} {len(ones)} {sum(t.n_tokens for t in ones)}" in proc.stdout
        assert f"locked {db} is held by another process" in proc.stdout

        # re-export after more writes replaces the files atomically; no temporary files remain
        store.write(make(5, seed=2, prefix="i1b-", iteration=1))
        store.export_parquet(1, out)
        assert pq.count(iteration=1) == store.count(iteration=1) == 25 + 5
        assert sorted(p.name for p in folders[1].iterdir()) == ["segments.parquet", "trajectories.parquet"]
        # an empty iteration exports empty files; an empty or missing folder reads as nothing
        store.export_parquet(8, out)
        assert pq.read(iteration=8) == [] and pq.count(iteration=8) == 0
        assert ParquetReader(tmp_path / "nothing").read() == []
        pq.close()


KILL_CHILD = r"""
import sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
mode, db, B = sys.argv[3], sys.argv[4], int(sys.argv[5])
from dataclasses import replace
import numpy as np
from store import TrajectoryStore
from trajgen import random_trajectory
rng = np.random.default_rng(0)
template = [random_trajectory(rng, f"tpl{i}") for i in range(B)]
# a low checkpoint threshold makes the kill land in WAL checkpoints too
store = TrajectoryStore(db, config={"checkpoint_threshold": "256KB"})
b = 0
while True:
    if mode == "mid-transaction" and b == 4:
        real = store._wcon
        class Stall:  # stops the writer after both INSERTs of batch 4, before COMMIT
            def __getattr__(self, name):
                return getattr(real, name)
            def execute(self, sql, *args):
                out = real.execute(sql, *args)
                if sql.startswith("INSERT INTO segments"):
                    print("stalled", flush=True)
                    time.sleep(600)
                return out
        store._wcon = Stall()
    store.write([replace(t, trajectory_id=f"b{b:05d}-{i:03d}") for i, t in enumerate(template)])
    print(f"committed {b}", flush=True)
    b += 1
"""


@pytest.mark.parametrize("mode", ["random", "mid-transaction"])
def test_kill_mid_write_loses_nothing_committed(tmp_path, mode):
    db, B = tmp_path / "t.db", 40
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(ROOT), str(HERE), mode, str(db), str(B)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    guard = threading.Timer(60, proc.kill)
    guard.start()
    committed: list[int] = []
    try:
        for line in proc.stdout:
            if line.startswith("committed"):
                committed.append(int(line.split()[1]))
            if (mode == "random" and len(committed) == 6) or line.startswith("stalled"):
                if mode == "random":
                    time.sleep(float(np.random.default_rng().uniform(0, 0.02)))
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait()
        committed += [int(x.split()[1]) for x in proc.stdout.read().splitlines() if x.startswith("committed")]
    finally:
        guard.cancel()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert committed == list(range(len(committed))) and len(committed) >= 4

    rng = np.random.default_rng(0)
    template = [random_trajectory(rng, f"tpl{i}") for i in range(B)]
    with TrajectoryStore(db) as store:  # replays the WAL
        got = store.read()  # raises if any trajectory lacks segments
        batches: dict[int, list[Trajectory]] = {}
        for t in got:
            batches.setdefault(int(t.trajectory_id[1:6]), []).append(t)
        assert set(committed) <= set(batches), "a committed batch was lost"
        if mode == "mid-transaction":
            assert sorted(batches) == committed == [0, 1, 2, 3], "the uncommitted batch is invisible"
        else:  # at most the batch being written when killed may be there too, if its COMMIT finished
            assert sorted(batches) in (committed, committed + [committed[-1] + 1])
        for b, ts in batches.items():
            assert len(ts) == B, f"batch {b} is partial"
            for t in ts:
                assert t == replace(as_stored(template[int(t.trajectory_id[7:])]), trajectory_id=t.trajectory_id)
        n_seg, want = store.cursor().execute(
            "SELECT (SELECT count(*) FROM segments), (SELECT sum(n_segments) FROM trajectories)"
        ).fetchone()
        assert n_seg == want
        store.write(make(3, prefix="after"))  # and the store takes writes again
        assert store.count() == len(got) + 3


def test_drop_consumption_after_undoes_only_the_redone_steps(tmp_path):
    """A stage resumed from its checkpoint at step 2 redoes steps 3.. : exactly its rows of those steps go; other
    consumers' rows, earlier steps and the trajectories themselves stay."""
    rng = np.random.default_rng(4)
    trajs = [random_trajectory(rng, f"t{i}") for i in range(6)]

    def row(i, consumer, step):
        return {"trajectory_id": f"t{i}", "stage": "sao", "consumer": consumer, "step": step, "policy_version": step,
                "staleness": 0, "outcome": "trained"}

    rows = [row(i, "sao:math", 1 + i // 2) for i in range(6)] + [row(i, "sao:code", 1 + i // 2) for i in range(6)]
    with TrajectoryStore(tmp_path / "s.duckdb") as st:
        st.write(trajs, rows)
        assert st.drop_consumption_after("sao:math", 2) == 2
        assert st.drop_consumption_after("sao:math", 2) == 0
        left = st.consumption()
        assert st.count() == 6
    assert sorted((r["consumer"], r["step"]) for r in left) == sorted(
        [("sao:math", 1)] * 2 + [("sao:math", 2)] * 2 + [("sao:code", s) for s in (1, 1, 2, 2, 3, 3)])
    with TrajectoryStore(tmp_path / "s.duckdb", read_only=True) as st, pytest.raises(RuntimeError, match="read-only"):
        st.drop_consumption_after("sao:math", 0)
