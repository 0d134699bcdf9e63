"""Teacher residency: how much teacher load time background prefetch hides behind scoring (target ≥ 90%).

Three `tiny`-preset teachers (code / math / reasoning) live on disk as HF-layout checkpoints; one is
resident at a time (`max_resident=1`). Each OPD step scores a shuffled mix of batches from all three
domains (score = a forward pass producing the token log-probs of random token sequences) through
`TeacherPool.score_batches`, which visits each teacher once per step, resident one first. Same batches,
same pool, once with loads on demand and once with the next teacher prefetched in the background.
The cold start (the very first load, which nothing can overlap) is reported apart from the
steady-state swaps ("steady hidden"). Checkpoints are read from the page cache, as on a node with the
teachers on local disk that it has read before. Run: .venv/bin/python bench/teacher_prefetch.py

Reading the result on a CPU-only machine: a load is CPU work (deserialising, copying, building the
module), so with no idle core it slows scoring by about what it hides, and the total barely moves. The
wall-clock gain appears where loading uses resources scoring does not: scoring on an accelerator while
the host reads the next teacher, or a spare core. One intra-op thread by default: scoring on one core,
loading on the other (two threads per process oversubscribe a shared 2-core machine badly).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from common import table, threads

import configs
from model import Transformer, load_checkpoint, save_checkpoint
from trainers.teachers import TeacherPool

DOMAINS = ("code", "math", "reasoning")


def make_steps(n_steps: int, per_domain: int, batch: int, seq: int, seed: int = 0):
    """Per step: `per_domain` random-token batches for every domain, in a shuffled order."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(n_steps):
        batches = [(d, torch.randint(0, 256, (batch, seq), generator=g)) for d in DOMAINS for _ in range(per_domain)]
        rng.shuffle(batches)
        steps.append(batches)
    return steps


def run(paths: dict[str, Path], steps, prefetch: bool) -> dict:
    scoring = [0.0]

    @torch.no_grad()
    def score(teacher, ids):
        t = time.perf_counter()
        lp = teacher(ids)[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        scoring[0] += time.perf_counter() - t
        return lp

    with TeacherPool(paths, max_resident=1) as pool:
        t0 = time.perf_counter()
        pool.get(steps[0][0][0])  # the cold start: nothing to overlap it with
        cold = pool.stats()
        outs = [pool.score_batches(batches, score, prefetch=prefetch) for batches in steps]
        total = time.perf_counter() - t0
        s = pool.stats()
    steady_load = s.load_seconds - cold.load_seconds
    return {
        "stats": s, "cold_load": cold.load_seconds, "total": total, "scoring": scoring[0], "outs": outs,
        "steady_hidden": (s.hidden_seconds - cold.hidden_seconds) / steady_load if steady_load > 0 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="OPD steps (each visits all three teachers)")
    ap.add_argument("--per-domain", type=int, default=3, help="batches per domain per step")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: scoring on one core, loading on the other)")
    args = ap.parse_args()
    os.environ.setdefault("COLUMNS", "160")  # rich wraps at 80 columns when stdout is not a terminal
    torch.set_num_threads(args.threads)
    cfg = configs.load("tiny").model
    with tempfile.TemporaryDirectory() as d:
        paths = {}
        for i, dom in enumerate(DOMAINS):
            torch.manual_seed(i)
            paths[dom] = save_checkpoint(Transformer(cfg), Path(d) / dom)
        t = time.perf_counter()
        warm = load_checkpoint(paths["code"])  # first-call costs of the loader (lazy imports, allocator)
        warm_s = time.perf_counter() - t
        load_s = min(_timed(lambda: load_checkpoint(paths["math"])) for _ in range(3))
        steps = make_steps(args.steps, args.per_domain, args.batch, args.seq)
        ids = steps[0][0][1]
        with torch.no_grad():
            warm(ids)
            fwd_s = min(_timed(lambda: warm(ids)) for _ in range(3))
        warm = None  # free it before the runs
        rows, base = [], None
        for prefetch in (False, True):
            r = run(paths, steps, prefetch)
            s = r["stats"]
            base = base or r
            rows.append([
                "prefetch next teacher" if prefetch else "load on demand", s.swaps, s.loads, s.load_seconds,
                s.hidden_seconds, f"{100 * s.hidden_fraction:.1f}%", f"{100 * r['steady_hidden']:.1f}%",
                s.wait_seconds, r["scoring"], r["total"], base["total"] / r["total"],
            ])
            for a, b in zip(base["outs"], r["outs"]):  # same teachers, same scores
                assert all(torch.equal(x, y) for x, y in zip(a, b))
    n_params = Transformer(cfg).num_parameters()
    group = args.per_domain * fwd_s
    table(
        f"{len(DOMAINS)} tiny teachers ({n_params / 1e6:.1f}M params), max_resident=1, {args.steps} steps × "
        f"{len(DOMAINS)} domains × {args.per_domain} batches of {args.batch}×{args.seq}; one load ≈ {1e3 * load_s:.0f} ms "
        f"(first ever {1e3 * warm_s:.0f} ms, excluded), scoring one group ≈ {1e3 * group:.0f} ms; {threads()} threads",
        ["schedule", "swaps", "loads", "load s", "hidden s", "hidden", "steady hidden", "waited s",
         "scoring s", "total s", "speed-up"],
        rows,
    )


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
