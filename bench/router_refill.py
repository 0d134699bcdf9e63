"""Router: dynamic refill vs static batches on long-tailed episode lengths, two embedded servers.

Static: send a batch that fills every slot, wait for the whole batch, send the next (the shape of a
synchronous rollout). Dynamic: submit everything; the router dispatches a request the moment a slot
frees. Same requests, same servers. Run: .venv/bin/python bench/router_refill.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import torch
from common import table, threads

import configs
from model import Transformer
from rollout.engine import Engine
from rollout.router import Router
from rollout.server import ServerThread, create_app


def lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(256, int(8 * (1 / (1 - rng.random())) ** 1.2)) for _ in range(n)]  # Pareto-like tail


async def run(urls, reqs, static: bool, slots: int) -> float:
    async with Router(urls, slots_per_worker=slots) as router:
        t = time.perf_counter()

        async def one(i, n):
            return await router.generate([1 + i % 200, 2, 3, 4], {"max_new_tokens": n, "ignore_eos": True})

        if static:
            size = slots * len(urls)
            for b in range(0, len(reqs), size):
                await asyncio.gather(*(one(i, n) for i, n in enumerate(reqs[b : b + size], start=b)))
        else:
            await asyncio.gather(*(one(i, n) for i, n in enumerate(reqs)))
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--slots", type=int, default=4)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Transformer(configs.load("micro").model).eval()
    engines = [Engine(model, n_slots=args.slots, max_len=320) for _ in range(2)]
    servers = [ServerThread(create_app(e)).start() for e in engines]
    reqs = lengths(args.requests, 0)
    tokens = sum(reqs)
    try:
        urls = [s.url for s in servers]
        asyncio.run(run(urls, reqs[:8], False, args.slots))  # warm-up
        t_static = asyncio.run(run(urls, reqs, True, args.slots))
        t_dyn = asyncio.run(run(urls, reqs, False, args.slots))
    finally:
        for s in servers:
            s.stop()
        for e in engines:
            e.shutdown()
    table(f"{args.requests} requests, {tokens} tokens (lengths {min(reqs)}–{max(reqs)}, median "
          f"{sorted(reqs)[len(reqs) // 2]}), 2 servers × {args.slots} slots, {threads()} threads",
          ["schedule", "seconds", "tokens/s", "ratio"],
          [["static batches", t_static, f"{tokens / t_static:,.0f}", 1.0],
           ["router dynamic refill", t_dyn, f"{tokens / t_dyn:,.0f}", t_static / t_dyn]])


if __name__ == "__main__":
    main()
