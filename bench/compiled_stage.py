"""The compiled decode step where a stage meets it: greedy evaluation of one policy on `n` tasks of the held-out
ladder, on an in-process engine, eager vs `compile_decode`, in one process. The first compiled run pays the compile
as a stage process does (traced here, the generated code from Inductor's disk cache if it holds it: `--cold` points
the cache at a fresh directory); the second finds it compiled. Same tasks, same greedy episodes (checked), seconds
per side, alternated.
Run: .venv/bin/python bench/compiled_stage.py [--tasks 240] [--cold]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import table

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, load_checkpoint
from trainers.sft import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tasks", type=int, default=240)
    ap.add_argument("--cold", action="store_true", help="an empty Inductor cache: the C++ compiled too")
    a = ap.parse_args()
    if a.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    cfg = configs.load(a.preset)
    model = load_checkpoint(cfg.base.checkpoint)
    specs = generate(cfg.envs.eval_patterns, a.tasks, seed=9, purpose="bench")
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    runs = []
    for name, comp in (("eager", False), ("compiled, first (compiles)", True), ("eager", False),
                       ("compiled, second", True)):
        t = time.perf_counter()
        ev = evaluate(model, specs, tok, sb, cfg.agent, n_slots=cfg.loop.n_slots,
                      concurrency=cfg.loop.batch_in_flight, compile_decode=comp)
        runs.append((name, time.perf_counter() - t, [list(s.tokens) for t_ in ev["trajectories"] for s in t_.segments],
                     ev["pass@1"]))
    base = runs[0][2]
    assert all(r[2] == base for r in runs), "the compiled step changed a greedy episode"
    eager = (runs[0][1] + runs[2][1]) / 2
    table(f"greedy evaluation, {a.tasks} tasks, {cfg.loop.batch_in_flight} in flight, seconds"
          + (" (cold Inductor cache)" if a.cold else ""),
          ["run", "seconds", "eager mean ÷ run", "pass@1"],
          [[n, f"{s:.1f}", eager / s, f"{p:.3f}"] for n, s, _, p in runs])


if __name__ == "__main__":
    main()
