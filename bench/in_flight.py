"""Episodes in flight against a stage's wall time: greedy evaluation of one policy on `n` held-out-ladder tasks on an
in-process engine with as many slots as episodes in flight, each value run `repeat` times, alternating, in one
process (the machine's load drifts: alternation spreads it over every value). The episodes are checked equal.
Run: .venv/bin/python bench/in_flight.py [--tasks 240] [--values 32 96 240] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
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
    ap.add_argument("--values", type=int, nargs="+", default=[32, 96, 240])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    cfg = configs.load(a.preset)
    model = load_checkpoint(cfg.base.checkpoint)
    specs = generate(cfg.envs.eval_patterns, a.tasks, seed=9, purpose="bench")
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    secs: dict[int, list[float]] = {v: [] for v in a.values}
    episodes = None
    for _ in range(a.repeat):
        for v in a.values:
            t = time.perf_counter()
            ev = evaluate(model, specs, tok, sb, cfg.agent, n_slots=v, concurrency=v)
            secs[v].append(time.perf_counter() - t)
            got = [[list(s.tokens) for s in tr.segments] for tr in ev["trajectories"]]
            episodes = episodes or got
            assert got == episodes, f"{v} in flight changed a greedy episode"
    base = statistics.median(secs[a.values[0]])
    table(f"greedy evaluation, {a.tasks} tasks, seconds (median of {a.repeat}, alternated)",
          ["in flight (= slots)", "median s", "runs", f"× ({a.values[0]} in flight ÷ this)"],
          [[v, f"{statistics.median(s):.1f}", " ".join(f"{x:.1f}" for x in s), base / statistics.median(s)]
           for v, s in secs.items()])


if __name__ == "__main__":
    main()
