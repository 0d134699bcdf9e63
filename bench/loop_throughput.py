"""The RL loop's layouts side by side: sync, async on an in-process engine, async on engine servers by URL.

Same model, environments (calc-chain and kv-lookup with their long-tailed horizons), batch size and total engine
slots. Sync: generate a batch, wait for its slowest episode, train, push. Async in-process: one engine in the
trainer's process keeps `in_flight` episodes going while the trainer consumes finished ones. Async on servers:
the same, with rollouts on N `temper serve` processes (each pinned to one core where `taskset` exists) behind
the Router and weights pushed through `/update_weights_from_disk` — the disaggregated layout.
Reported: trajectories trained per second, generated per second, the trainer's idle share (time waiting for a
batch over the run), and the push latency.
Run: .venv/bin/python bench/loop_throughput.py [--steps 12] [--servers 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import table, threads

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, Transformer, save_checkpoint
from rollout.backend import ServerBackend, wait_healthy
from trainers.loop import LoopConfig, RLLoop

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(ckpt: Path, n: int, slots: int) -> tuple[list[str], list[subprocess.Popen]]:
    urls, procs = [], []
    cores = os.cpu_count() or 1
    for i in range(n):
        port = _port()
        cmd = [sys.executable, "-m", "pipelines.cli", "serve", "--checkpoint", str(ckpt), "--port", str(port),
               "--slots", str(slots), "--max-len", "1024"]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(i % cores), *cmd]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    for u, p in zip(urls, procs):
        wait_healthy(u, p)
    return urls, procs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--slots", type=int, default=16, help="engine slots in total, the same for every layout")
    ap.add_argument("--servers", type=int, default=2)
    args = ap.parse_args()
    cfg = configs.load(args.preset)
    tok, sb = ByteTokenizer(), make_sandbox()
    specs = generate(["calc-chain", "kv-lookup"], 64, seed=5)
    tmp = Path(tempfile.mkdtemp(prefix="temper-bench-loop-"))
    torch.manual_seed(0)
    init = Transformer(cfg.model)
    save_checkpoint(init, tmp / "init", policy_version=0)
    rows = []
    for layout in ("sync", "async in-process", f"async {args.servers} servers"):
        actor = Transformer(cfg.model)
        actor.load_state_dict(init.state_dict())
        mode = "sync" if layout == "sync" else "async"
        # same batch per optimiser step (8) and same engine capacity: sync can only fill it with one batch
        lc = LoopConfig(mode=mode, batch_size=8, in_flight=8 if mode == "sync" else args.slots, n_slots=args.slots)
        sao = cfg.sao.model_copy(update={"loss": "sao", "staleness": 4})
        procs, backend = [], None
        if "servers" in layout:
            urls, procs = start_servers(tmp / "init", args.servers, args.slots // args.servers)
            backend = ServerBackend(urls, tmp / "sync")
            backend.push(actor, 0)
        try:
            loop = RLLoop(actor, specs, tok, sb, cfg.agent.model_copy(update={"temperature": 1.0}), sao, lc,
                          backend=backend)
            t = time.perf_counter()
            hist = loop.run(args.steps)
            dt = time.perf_counter() - t
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        trained = sum(h["trajectories"] for h in hist)
        push = sum(p["seconds"] for p in loop.pushes) / max(1, len(loop.pushes))
        rows.append([layout, len(hist), trained, f"{dt:.1f}", trained / dt, loop.finished / dt,
                     f"{loop.wait_seconds / dt:.0%}", f"{push * 1000:.0f} ms" if loop.pushes else "no update"])
    base = rows[0][4]
    for r in rows:
        r.append(r[4] / base)
    shutil.rmtree(tmp, ignore_errors=True)
    table(f"RL loop layouts on long-tailed horizons ({args.preset}, batch 8, {args.slots} slots, {threads()} threads)",
          ["layout", "steps", "trajectories trained", "seconds", "trained/s", "generated/s", "trainer idle",
           "push", "ratio vs sync"], rows)


if __name__ == "__main__":
    main()
