"""Every Triton kernel the CUDA paths launch, compiled for an H200 (sm_90) on a machine without a GPU: Triton's own
compiler and ptxas, ahead of time, once per specialisation the code actually launches (argument dtypes, constexpr
values, warps). The paths run on the `meta` device (`temper_kernels.meta.on_meta`): a training forward+backward (the
trainers' losses, the indexer KL), the engine's captured decode step over dense and sparse key buckets, and the FP8
indexer, for bench/gpu.py's 524M and 2B configs in bf16 and for `tiny` in fp32 (the GPU bench's parity run).

    python bench/triton_compile.py [--arch 90] [--sizes 524M 2B]

A kernel that the interpreter runs (TRITON_INTERPRET=1, the CPU tests) can still fail to compile for a GPU: a
construct the interpreter accepts and the compiler does not, or a tile that needs more shared memory than the SM has.
This finds those before a GPU session spends its minutes on them. It exits 1 if any specialisation fails. (The GPU
machine's Triton may be older than this one's; a kernel that compiles here can still fail there.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("bench/triton_compile.py compiles the real kernels: run it without TRITON_INTERPRET")

from common import table  # noqa: E402


def paths(cfg, dtype, b: int, t: int) -> None:
    """The CUDA paths of one config: a training step's forward+backward and the captured decode step."""
    from model import KVCache, Transformer, lm_forward_loss, mtp_loss
    from model.losses import indexer_kl_loss
    from rollout.engine import DecodeGraphs, EngineStats
    from temper_kernels import indexer as kix

    with torch.device("meta"):
        m = Transformer(cfg).train().to(dtype)
    ids = torch.zeros(b, t, dtype=torch.long, device="meta")
    out, loss = lm_forward_loss(m, ids, collect_indexer=True, detach_indexer_input=True)
    if len(m.mtp_layers):
        loss = loss + mtp_loss(m, out.hidden, ids)
    if out.indexer_stats:
        loss = loss + indexer_kl_loss(out.indexer_stats)
    loss.backward()
    m.eval()
    with torch.device("meta"):
        cache = KVCache(cfg, 9, 4 * cfg.index_topk, dtype=dtype, device=torch.device("meta"))
    graphs = DecodeGraphs(m, cache, 8, EngineStats())
    with torch.no_grad():
        for n_keys in (cfg.index_topk // 2, 4 * cfg.index_topk):
            graphs.step(torch.zeros(8, 1, dtype=torch.long, device="meta"), torch.arange(8, device="meta"),
                        torch.ones(8, dtype=torch.long, device="meta"), n_keys)
        # the FP8 indexer (GLM-5's and DeepSeek-V3.2's), at this config's indexer shapes
        h, d = cfg.index_n_heads, cfg.index_head_dim
        q = torch.zeros(1, 64, h, d, device="meta", dtype=dtype)
        k = torch.zeros(1, 4 * cfg.index_topk, d, device="meta", dtype=dtype)
        w = torch.zeros(1, 64, h, device="meta")
        kix.indexer_topk(q, w, k, torch.zeros(1, 64, dtype=torch.long, device="meta") + 4 * cfg.index_topk,
                         cfg.index_topk, fp8=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="the CUDA compute capability to compile for (90: H100/H200)")
    ap.add_argument("--sizes", nargs="+", default=["524M", "2B"], choices=["524M", "2B"],
                    help="bench/gpu.py's configs to run in bf16 (tiny runs in fp32 always)")
    ap.add_argument("--max-shared", type=int, default=232448,
                    help="shared memory a block may use, bytes (sm_90: 227 KiB, the H200's opt-in maximum)")
    args = ap.parse_args()
    from gpu import hf_config
    from triton.backends.compiler import GPUTarget

    import configs
    from model import ModelConfig
    from temper_kernels.meta import on_meta

    target = GPUTarget("cuda", args.arch, 32)
    compiled: dict = {}
    runs = [("tiny", configs.load("tiny").model, torch.float32, 2, 128)]
    for size in args.sizes:
        cfg = ModelConfig.from_hf_dict({**hf_config(size, False).to_dict(), "num_nextn_predict_layers": 1})
        runs.append((size, cfg, torch.bfloat16, 1, 2 * cfg.index_topk))
    t0 = time.perf_counter()
    for name, cfg, dtype, b, t in runs:
        with on_meta(compile_for=target, compiled=compiled):
            paths(cfg, dtype, b, t)
        print(f"{name}: {len(compiled)} specialisations so far, {time.perf_counter() - t0:.0f} s", flush=True)
    rows, failed = [], 0
    for (kernel, sig, const, opts), got in sorted(compiled.items(), key=lambda kv: kv[0][0]):
        ptrs = ",".join(sorted({v for _, v in sig if v.startswith("*")}))
        consts = " ".join(f"{k}={v}" for k, v in const)
        err = got["error"]
        if err is None and got["shared"] > args.max_shared:
            err = f"needs {got['shared']:,} B of shared memory a block; sm_{args.arch} has {args.max_shared:,}"
        shared = "-" if got["shared"] is None else f"{got['shared'] / 1024:.1f}"
        rows.append([kernel, ptrs, consts[:70], dict(opts).get("num_warps", "-"), shared,
                     "ok" if err is None else err[:150]])
        failed += err is not None
    table(f"Triton kernels compiled for sm_{args.arch} ({len(compiled)} specialisations, {failed} failed)",
          ["kernel", "pointer types", "constexprs", "warps", "shared KiB", "result"], rows)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
