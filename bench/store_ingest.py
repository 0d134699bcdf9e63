"""Trajectory store ingest: tokens/s of batched Arrow inserts (`TrajectoryStore.write`, one transaction per
batch) against DuckDB `executemany` row inserts (timed on a small sample, extrapolated per token); then
read-back and Parquet export speeds for trainers.

Rates count the whole durable cost: the commits (DuckDB writes each batch to its WAL) plus `close()`,
which checkpoints what is left in the WAL into the compressed database file. The `:memory:` row is the
insert alone (no WAL, no checkpoint, no compression to disk), for comparison.
`--layouts` adds what the per-token columns would cost in other layouts, durably, the same tokens in 10 transactions:
list columns (the store's), one BLOB per column, one row per token, and Parquet files written with pyarrow.
Run: .venv/bin/python bench/store_ingest.py [--trajectories 2000 --tokens 2000 --batch 200 --sample 20] [--layouts]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from common import table

from rollout.types import Segment, Trajectory
from store import ParquetReader, TrajectoryStore, to_arrow


def make_trajectories(n: int, tokens: int, seed: int = 0) -> list[Trajectory]:
    """`n` trajectories of about `tokens` tokens each, in 1-3 segments, 40% generated tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(1, 4))
        lens = rng.multinomial(tokens - 50 * k, [1 / k] * k) + 50
        segs = []
        for m in lens:
            mask = rng.random(m) < 0.4
            segs.append(
                Segment(
                    tokens=rng.integers(0, 150_000, m).tolist(),
                    loss_mask=mask.tolist(),
                    logprobs=np.where(mask, -rng.exponential(1.0, m), 0.0).tolist(),
                    versions=np.where(mask, 7, -1).tolist(),
                    start_turn=0,
                    end_turn=3,
                )
            )
        out.append(
            Trajectory(
                trajectory_id=f"traj-{seed}-{i:06d}", env_id=f"env-{i % 50}", family="arith", domain="math",
                env_spec_hash="ab" * 8, verifier_hash="cd" * 8, iteration=0, segments=segs, reward=float(rng.normal()),
                verifier={"passed": True, "checks": [1, 2]}, engine="embedded", timings={"total": 1.0}, created=1.7e9 + i,
            )
        )
    return out


def executemany_insert(path: Path, trajs: list[Trajectory]) -> None:
    """Row-at-a-time baseline into the same schema: DB-API executemany, one transaction."""
    traj_tbl, seg_tbl = to_arrow(trajs)  # only to reuse the derived columns; not timed separately
    store = TrajectoryStore(path)
    con = store.cursor()
    t_rows = [tuple(r.values()) for r in traj_tbl.to_pylist()]
    s_rows = [
        (t.trajectory_id, i, s.tokens, s.loss_mask, s.logprobs, s.versions, s.start_turn, s.end_turn, s.summary)
        for t in trajs
        for i, s in enumerate(t.segments)
    ]
    con.begin()
    con.executemany(f"INSERT INTO trajectories VALUES ({', '.join('?' * len(t_rows[0]))})", t_rows)
    con.executemany("INSERT INTO segments VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", s_rows)
    con.commit()
    con.close()
    store.close()


def layouts(tmp: Path, n_seg: int = 4000, seg_len: int = 1000, parts: int = 10) -> list[list]:
    """Durable ingest of the same per-token columns in four layouts: seconds and M tokens/s (commits + close)."""
    rng = np.random.default_rng(0)
    n = n_seg * seg_len
    mask = rng.random(n) < 0.4
    cols = {"tokens": rng.integers(0, 150_000, n).astype(np.int32), "mask": mask,
            "lp": np.where(mask, -rng.exponential(1.0, n), 0.0).astype(np.float32),
            "ver": np.where(mask, 7, -1).astype(np.int32)}
    offs = np.arange(n_seg + 1, dtype=np.int64) * seg_len
    tid = pa.array([f"t{i}" for i in range(n_seg)])

    def blob(v: np.ndarray) -> pa.Array:
        v = v.view(np.uint8) if v.dtype == np.bool_ else v
        return pa.LargeBinaryArray.from_buffers(pa.large_binary(), n_seg,
                                                [None, pa.py_buffer(offs * v.itemsize), pa.py_buffer(v.tobytes())])

    lists = pa.table({"tid": tid, **{k: pa.LargeListArray.from_arrays(pa.array(offs), pa.array(v))
                                     for k, v in cols.items()}})
    tables = {
        "list columns (the store's)": (lists, "tid VARCHAR, tokens INTEGER[], mask BOOLEAN[], lp FLOAT[], ver INTEGER[]"),
        "one BLOB per column": (pa.table({"tid": tid, **{k: blob(v) for k, v in cols.items()}}),
                                "tid VARCHAR, tokens BLOB, mask BLOB, lp BLOB, ver BLOB"),
        "one row per token": (pa.table({"tid": np.repeat(np.arange(n_seg, dtype=np.int32), seg_len), **cols}),
                              "tid INTEGER, tokens INTEGER, mask BOOLEAN, lp FLOAT, ver INTEGER"),
    }
    rows = []
    for name, (tbl, ddl) in tables.items():
        path = tmp / f"layout-{len(rows)}.db"
        con = duckdb.connect(str(path))
        con.execute(f"CREATE TABLE s ({ddl})")
        step = tbl.num_rows // parts
        t = time.perf_counter()
        for i in range(parts):
            con.register("b", tbl.slice(i * step, step))
            con.begin()
            con.execute("INSERT INTO s SELECT * FROM b")
            con.commit()
            con.unregister("b")
        con.close()
        sec = time.perf_counter() - t
        rows.append([name, sec, f"{n / sec / 1e6:.2f}", f"{path.stat().st_size / 1e6:.0f}"])
    for comp in ("none", "zstd"):
        out = tmp / f"parquet-{comp}"
        out.mkdir()
        step = n_seg // parts
        t = time.perf_counter()
        for i in range(parts):
            f = out / f"part-{i}.parquet"
            pq.write_table(lists.slice(i * step, step), f, compression=comp)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        sec = time.perf_counter() - t
        rows.append([f"Parquet, pyarrow, {comp}", sec, f"{n / sec / 1e6:.2f}",
                     f"{sum(p.stat().st_size for p in out.iterdir()) / 1e6:.0f}"])
    return rows


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per trajectory")
    ap.add_argument("--batch", type=int, nargs="+", default=[200, 2000], help="trajectories per transaction")
    ap.add_argument("--sample", type=int, default=20, help="trajectories for the executemany baseline")
    ap.add_argument("--dir", default=None, help="where the databases go (default: a temporary folder)")
    ap.add_argument("--layouts", action="store_true", help="also time the per-token columns in other layouts")
    args = ap.parse_args()

    trajs = make_trajectories(args.trajectories, args.tokens)
    n_tok = sum(t.n_tokens for t in trajs)

    def batches(size: int) -> list[list[Trajectory]]:
        return [trajs[i : i + size] for i in range(0, len(trajs), size)]

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="store-bench-") as d:
        tmp = Path(d)
        sample = trajs[: args.sample]
        s_tok = sum(t.n_tokens for t in sample)
        t_rows = timed(lambda: executemany_insert(tmp / "rows.db", sample))
        base = s_tok / t_rows
        rows = [["executemany row inserts (sample)", len(sample), s_tok, t_rows, "", f"{base / 1e6:.2f}", 1.0]]

        for size in args.batch:
            store = TrajectoryStore(tmp / f"write{size}.db")
            chunks = batches(size)
            t = time.perf_counter()
            for chunk in chunks:
                store.write(chunk)
            t_commit = time.perf_counter() - t
            t_close = timed(store.close)  # the checkpoint of what is still in the WAL
            rate = n_tok / (t_commit + t_close)
            rows.append([f"write(), batches of {size}", len(trajs), n_tok, t_commit, f"{t_close:.3f}", f"{rate / 1e6:.2f}",
                         rate / base])
        size = args.batch[0]
        t = time.perf_counter()
        tables = [to_arrow(chunk) for chunk in batches(size)]
        t_arrow = time.perf_counter() - t
        rows.append([f"  to_arrow() alone, batches of {size}", len(trajs), n_tok, t_arrow, "", f"{n_tok / t_arrow / 1e6:.2f}",
                     n_tok / t_arrow / base])
        store = TrajectoryStore(tmp / "insert.db")
        t = time.perf_counter()
        for tt, st in tables:
            store.write_arrow(tt, st)
        t_insert = time.perf_counter() - t
        t_close = timed(store.close)
        rate = n_tok / (t_insert + t_close)
        rows.append([f"  write_arrow() alone, batches of {size}", len(trajs), n_tok, t_insert, f"{t_close:.3f}",
                     f"{rate / 1e6:.2f}", rate / base])
        store = TrajectoryStore(":memory:")  # the insert alone: no WAL, no checkpoint
        t_mem = timed(lambda: [store.write_arrow(tt, st) for tt, st in tables])
        store.close()
        rows.append([f"  write_arrow() into :memory:, batches of {size}", len(trajs), n_tok, t_mem, "",
                     f"{n_tok / t_mem / 1e6:.2f}", n_tok / t_mem / base])
        tables.clear()
        table(
            f"store ingest: {len(trajs):,} trajectories x ~{args.tokens} tokens, one transaction per batch",
            ["path", "trajectories", "tokens", "seconds", "+ close s", "M tokens/s", "× executemany"],
            rows,
        )

        # trainer side: read back from the database and from a Parquet export
        db = tmp / f"write{args.batch[0]}.db"
        rows = []
        with TrajectoryStore(db) as store:
            rows.append(["TrajectoryStore.read", timed(lambda: store.read(iteration=0))])
            rows.append(["TrajectoryStore.read_arrow", timed(lambda: store.read_arrow(iteration=0))])
            rows.append(["export_parquet", timed(lambda: store.export_parquet(0, tmp / "export"))])
        size_mb = sum(p.stat().st_size for p in (tmp / "export").rglob("*.parquet")) / 1e6
        with ParquetReader(tmp / "export") as pq:
            assert pq.count() == len(trajs)
            rows.append(["ParquetReader.read", timed(lambda: pq.read(iteration=0))])
            rows.append(["ParquetReader.read_arrow", timed(lambda: pq.read_arrow(iteration=0))])
        table(
            f"read and export: {db.stat().st_size / 1e6:.1f} MB database, {size_mb:.1f} MB Parquet (zstd)",
            ["operation", "seconds", "M tokens/s"],
            [[name, sec, f"{n_tok / sec / 1e6:.2f}"] for name, sec in rows],
        )
        if args.layouts:
            table("per-token columns, 4M tokens in 10 transactions, durable (commits + close)",
                  ["layout", "seconds", "M tokens/s", "MB"], layouts(tmp))


if __name__ == "__main__":
    main()
