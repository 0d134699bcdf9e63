"""Ablation at staleness 0 / 2 / 4: SAO vs naive async PPO vs synchronous GRPO, from one warm start.

    python bench/staleness_ablation.py --init runs/bench-learning/warm_start/checkpoint --steps 30

Staleness s is induced the same way for every method: the trainer pushes weights to the engine every
s + 1 steps, so rollouts come from policies up to s versions old (async generation adds its own lag on
top). Training runs on fresh environments (the preset's RL set), not the ones SFT saw. SAO: the
double-sided token mask and the staleness bound τ = s. Naive async PPO: symmetric clip, no mask, no
bound. GRPO: synchronous generation in groups of 4, group-normalised advantages.
Reported per run: the mean batch reward over the last third of the steps (final reward), the spread of
batch reward over that window and the largest KL (stability), samples dropped as stale, and held-out
pass@1 after training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import table

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, load_checkpoint
from trainers.loop import RLLoop
from trainers.sft import evaluate


def run_one(cfg, init: str, specs, held, method: str, s: int, steps: int, tok, sb) -> dict:
    torch.manual_seed(cfg.seed)
    actor = load_checkpoint(init)
    if method == "sao":
        sao = cfg.sao.model_copy(update={"loss": "sao", "staleness": s})
        lc = cfg.loop.model_copy(update={"mode": "async", "push_every": s + 1})
    elif method == "ppo":
        sao = cfg.sao.model_copy(update={"loss": "ppo", "staleness": None})
        lc = cfg.loop.model_copy(update={"mode": "async", "push_every": s + 1})
    else:
        sao = cfg.sao.model_copy(update={"loss": "grpo", "staleness": None})
        lc = cfg.loop.model_copy(update={"mode": "sync", "push_every": s + 1, "group_size": 4})
    loop = RLLoop(actor, specs, tok, sb, cfg.agent, sao, lc, version=1)
    t = time.perf_counter()
    hist = loop.run(steps)
    dt = time.perf_counter() - t
    tail = [h["batch_reward"] for h in hist[-max(1, len(hist) // 3):]]
    ev = evaluate(actor, held, tok, sb, cfg.agent)
    return {"method": method, "staleness": s, "final_reward": statistics.mean(tail),
            "reward_std": statistics.pstdev(tail), "max_kl": max(abs(h.get("kl", 0.0)) for h in hist),
            "dropped_stale": loop.trainer.dropped["stale"], "pass@1": ev["pass@1"], "seconds": dt,
            "rewards": [h["batch_reward"] for h in hist]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--init", required=True, help="warm-start checkpoint (e.g. from bench/learning.py)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--staleness", default="0,2,4")
    ap.add_argument("--methods", default="sao,ppo,grpo")
    ap.add_argument("--out", default="runs/bench-ablation.json")
    args = ap.parse_args()
    cfg = configs.load(args.preset, args.override)
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    specs = generate(cfg.envs.patterns, *cfg.envs.rl_source)  # the RL set: environments SFT never saw
    held = generate(cfg.envs.held_out_patterns, cfg.envs.n_eval, cfg.envs.eval_seed)
    base = evaluate(load_checkpoint(args.init), held, tok, sb, cfg.agent)["pass@1"]
    rows, runs = [], []
    for s in map(int, args.staleness.split(",")):
        for m in args.methods.split(","):
            r = run_one(cfg, args.init, specs, held, m, s, args.steps, tok, sb)
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "rewards"}), flush=True)
            rows.append([s, m, r["final_reward"], r["reward_std"], r["max_kl"], r["dropped_stale"], base, r["pass@1"],
                         f"{r['seconds']:.0f}"])
    table(f"staleness ablation on {args.preset} ({args.steps} steps each, warm start pass@1 {base:.2f})",
          ["staleness", "method", "final reward", "reward std", "max |KL|", "dropped stale", "pass@1 before",
           "pass@1 after", "seconds"], rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
