"""Trajectory store ingest: tokens/s of batched Arrow inserts (`TrajectoryStore.write`, one transaction per
batch) against DuckDB `executemany` row inserts (timed on a small sample, extrapolated per token); then
read-back and Parquet export speeds for trainers.
Run: .venv/bin/python bench/store_ingest.py [--trajectories 2000 --tokens 2000 --batch 200 --sample 20]
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per trajectory")
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--sample", type=int, default=20, help="trajectories for the executemany baseline")
    args = ap.parse_args()

    trajs = make_trajectories(args.trajectories, args.tokens)
    n_tok = sum(t.n_tokens for t in trajs)
    batches = [trajs[i : i + args.batch] for i in range(0, len(trajs), args.batch)]
    tmp = Path(tempfile.mkdtemp(prefix="store-bench-"))

    # 1. end to end: Trajectory objects -> Arrow -> INSERT ... SELECT, one transaction per batch
    with TrajectoryStore(tmp / "write.db") as store:
        t = time.perf_counter()
        for b in batches:
            store.write(b)
        t_write = time.perf_counter() - t

    # 2. the two halves: Arrow conversion alone, DuckDB insert of ready tables alone
    t = time.perf_counter()
    tables = [to_arrow(b) for b in batches]
    t_arrow = time.perf_counter() - t
    with TrajectoryStore(tmp / "insert.db") as store:
        t = time.perf_counter()
        for tt, st in tables:
            store.write_arrow(tt, st)
        t_insert = time.perf_counter() - t
    del tables

    # 3. executemany on a sample, extrapolated per token
    sample = trajs[: args.sample]
    s_tok = sum(t.n_tokens for t in sample)
    t = time.perf_counter()
    executemany_insert(tmp / "rows.db", sample)
    t_rows = time.perf_counter() - t

    rate_rows = s_tok / t_rows
    rows = []
    for name, n, tok, sec in [
        (f"write(): Arrow + INSERT, batches of {args.batch}", len(trajs), n_tok, t_write),
        ("  of which to_arrow() (Python -> Arrow)", len(trajs), n_tok, t_arrow),
        ("  of which write_arrow() (DuckDB insert)", len(trajs), n_tok, t_insert),
        ("executemany row inserts (sample)", len(sample), s_tok, t_rows),
    ]:
        rate = tok / sec
        rows.append([name, n, f"{tok:,}", sec, f"{rate / 1e6:.2f}", rate / rate_rows])
    table(
        f"store ingest: {len(trajs):,} trajectories x ~{args.tokens} tokens ({n_tok / 1e6:.1f}M tokens)",
        ["path", "trajectories", "tokens", "seconds", "M tokens/s", "× executemany"],
        rows,
    )

    # 4. trainer side: read back from the database and from a Parquet export
    rows = []
    with TrajectoryStore(tmp / "write.db") as store:
        t = time.perf_counter()
        got = store.read(iteration=0)
        t_read = time.perf_counter() - t
        assert len(got) == len(trajs) and got[0].segments[0].tokens == trajs[0].segments[0].tokens
        del got
        t = time.perf_counter()
        store.export_parquet(0, tmp / "export")
        t_export = time.perf_counter() - t
    size = sum(p.stat().st_size for p in (tmp / "export").rglob("*.parquet"))
    with ParquetReader(tmp / "export") as pq:
        t = time.perf_counter()
        got = pq.read(iteration=0)
        t_pq = time.perf_counter() - t
        assert len(got) == len(trajs)
        del got
    for name, sec in [("TrajectoryStore.read", t_read), ("export_parquet", t_export), ("ParquetReader.read", t_pq)]:
        rows.append([name, sec, f"{n_tok / sec / 1e6:.2f}"])
    table(f"read and export ({size / 1e6:.1f} MB of Parquet, zstd)", ["operation", "seconds", "M tokens/s"], rows)
    print(json.dumps({"db_bytes": (tmp / "write.db").stat().st_size, "dir": str(tmp)}))


if __name__ == "__main__":
    main()
