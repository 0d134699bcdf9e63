"""Weight-sync latency: a push of policy version v to the engines, in-process (state dict copy) vs servers by
URL (checkpoint written once, then `/pause_generation` → `/update_weights_from_disk` → version and checksum
check → `/continue_generation` on every worker), for `tiny` and a 180M-parameter config.
Run: .venv/bin/python bench/weight_push.py [--servers 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
from pathlib import Path

import torch
from common import table, threads
from loop_throughput import start_servers

import configs
from model import ByteTokenizer, Transformer, save_checkpoint
from rollout.backend import InProcessBackend, ServerBackend

BIG = ["model.hidden_size=768", "model.num_hidden_layers=8", "model.num_attention_heads=8", "model.q_lora_rank=384",
       "model.kv_lora_rank=256", "model.qk_nope_head_dim=64", "model.qk_rope_head_dim=32", "model.v_head_dim=64",
       "model.intermediate_size=2048", "model.moe_intermediate_size=512", "model.n_routed_experts=16",
       "model.index_head_dim=64", "model.indexer_types=[full,shared,shared,shared,full,shared,shared,shared]"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, over in (("tiny", []), ("big", BIG)):
        cfg = configs.load("tiny", over)
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        n = sum(p.numel() for p in model.parameters())
        tmp = Path(tempfile.mkdtemp(prefix="temper-bench-push-"))
        save_checkpoint(model, tmp / "init", policy_version=0)
        local = InProcessBackend(model, ByteTokenizer(), n_slots=2, max_len=256)
        try:
            t_local = [local.push(model, v + 1)["seconds"] for v in range(args.repeat)]
        finally:
            local.close()
        urls, procs = start_servers(tmp / "init", args.servers, 2)
        try:
            sb = ServerBackend(urls, tmp / "sync")
            t_srv = [sb.push(model, v + 1)["seconds"] for v in range(args.repeat)]
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            shutil.rmtree(tmp, ignore_errors=True)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        rows.append([name, f"{n / 1e6:.1f}M", med(t_local), med(t_srv), med(t_srv) / med(t_local)])
    table(f"weight push, median of {args.repeat} ({args.servers} servers, {threads()} threads)",
          ["config", "parameters", "in-process s", f"{args.servers} servers s", "ratio"], rows)


if __name__ == "__main__":
    main()
