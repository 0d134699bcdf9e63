"""Trajectory store ingest: tokens/s of batched Arrow inserts (`TrajectoryStore.write`, one transaction per
batch) against DuckDB `executemany` row inserts (timed on a small sample, extrapolated per token); then
read-back and Parquet export speeds for trainers.

Rates count the whole durable cost: the commits (DuckDB writes each batch to its WAL) plus `close()`,
which checkpoints what is left in the WAL into the compressed database file. The `:memory:` row is the
insert alone (no WAL, no checkpoint, no compression to disk), for comparison.
Run: .venv/bin/python bench/store_ingest.py [--trajectories 2000 --tokens 2000 --batch 200 --sample 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
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


if __name__ == "__main__":
    main()
