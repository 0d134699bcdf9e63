"""Async (SAO) vs synchronous RL loop: trajectories trained per second on long-tailed horizons.

Same model, same environments (calc-chain and kv-lookup with their long-tailed horizons), same batch
size and engine slots. Sync: generate a batch, wait for its slowest episode, train, push. Async: the
engine keeps `in_flight` episodes going while the trainer consumes finished ones.
Run: .venv/bin/python bench/loop_throughput.py [--steps 12]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import table, threads

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, Transformer
from trainers.loop import LoopConfig, RLLoop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--slots", type=int, default=16, help="engine slots, the same for both modes")
    args = ap.parse_args()
    cfg = configs.load(args.preset)
    tok, sb = ByteTokenizer(), make_sandbox()
    specs = generate(["calc-chain", "kv-lookup"], 64, seed=5)
    rows = []
    for mode in ("sync", "async"):
        torch.manual_seed(0)
        actor = Transformer(cfg.model)
        # same batch per optimiser step (8) and same engine capacity: sync can only fill it with one batch
        # (the next one waits for training); async keeps every slot busy with episodes in flight
        lc = LoopConfig(mode=mode, batch_size=8, in_flight=8 if mode == "sync" else args.slots, n_slots=args.slots)
        sao = cfg.sao.model_copy(update={"loss": "sao", "staleness": 4})
        loop = RLLoop(actor, specs, tok, sb, cfg.agent.model_copy(update={"temperature": 1.0}), sao, lc)
        t = time.perf_counter()
        hist = loop.run(args.steps)
        dt = time.perf_counter() - t
        trained = sum(h["trajectories"] for h in hist)
        reward = sum(h["batch_reward"] for h in hist) / max(1, len(hist))
        rows.append([mode, len(hist), trained, f"{dt:.1f}", f"{trained / dt:.2f}", f"{loop.finished / dt:.2f}",
                     f"{reward:.2f}"])
    rows[0].append(1.0)
    rows[1].append(float(rows[1][4]) / float(rows[0][4]))
    table(f"RL loop on long-tailed horizons ({args.preset}, batch 8, {args.slots} slots, {threads()} threads)",
          ["mode", "steps", "trajectories trained", "seconds", "trained/s", "generated/s", "mean reward", "ratio"], rows)


if __name__ == "__main__":
    main()
