"""Every Triton kernel the CUDA paths launch, compiled for an H200 (sm_90) on a machine without a GPU: Triton's own
compiler and ptxas, ahead of time, once per specialisation the code actually launches (argument dtypes, constexpr
values, warps). The paths run on the `meta` device (`temper_kernels.meta.on_meta`): a training forward+backward (the
trainers' losses, the indexer KL), the engine's captured decode step over dense and sparse key buckets, and the
indexer in FP8 and in the model's dtype, for bench/gpu.py's 524M and 2B configs in bf16, for `tiny` in fp32 (the GPU
bench's parity run), and for GLM-5's own shapes (`glm5`: the preset's widths, two layers, in bf16, the Triton
grouped GEMM in place of torch's) at one 132K-token sequence and at 16 × 4096 tokens, with a 64-slot ×
128K-position decode cache. Each launch is specialised as `triton.jit` would specialise it (integer arguments and
pointers divisible by 16 marked so, an integer 1 folded in), so the figures are those of the kernels a GPU runs.

    python bench/triton_compile.py [--arch 90] [--sizes 524M 2B glm5]

At GLM-5's shapes each launch's integer arguments and grid also go through `ir_offsets.wrapping_offsets`: every i32
add / multiply feeding an address whose exact value can pass 2³¹ there is listed (kernel, source line, span), and
any makes the run fail: a tensor of more than 2³¹ elements is addressed with 64-bit offsets, or the kernel reads
and writes some other row. The table gives each specialisation's registers, stack bytes (spilled registers) and
local-memory bytes per thread, from cuobjdump.

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


def paths(cfg, dtype, b: int, t: int, slots: int = 9, max_len: int | None = None, collect: bool = True) -> None:
    """The CUDA paths of one config: a training step's forward+backward (with the indexer-KL statistics where
    `collect`) and the captured decode step (a cache of `slots` rows of `max_len` positions, default 4·index_topk)."""
    from model import KVCache, Transformer, lm_forward_loss, mtp_loss
    from model.losses import indexer_kl_loss
    from rollout.engine import DecodeGraphs, EngineStats
    from temper_kernels import indexer as kix

    with torch.device("meta"):
        m = Transformer(cfg).train().to(dtype)
    ids = torch.zeros(b, t, dtype=torch.long, device="meta")
    out, loss = lm_forward_loss(m, ids, collect_indexer=collect, detach_indexer_input=True)
    if len(m.mtp_layers):
        loss = loss + mtp_loss(m, out.hidden, ids)
    if out.indexer_stats:
        loss = loss + indexer_kl_loss(out.indexer_stats)
    loss.backward()
    m.eval()
    with torch.device("meta"):
        cache = KVCache(cfg, slots, max_len or 4 * cfg.index_topk, dtype=dtype, device=torch.device("meta"))
    graphs = DecodeGraphs(m, cache, 8, EngineStats())
    with torch.no_grad():
        for n_keys in (cfg.index_topk // 2, 4 * cfg.index_topk):
            graphs.step(torch.zeros(8, 1, dtype=torch.long, device="meta"), torch.arange(8, device="meta"),
                        torch.ones(8, dtype=torch.long, device="meta"), n_keys)
        # the indexer at this config's shapes, FP8 (GLM-5's and DeepSeek-V3.2's) and in the model's dtype (whichever
        # the config does not run)
        h, d = cfg.index_n_heads, cfg.index_head_dim
        q = torch.zeros(1, 64, h, d, device="meta", dtype=dtype)
        k = torch.zeros(1, 4 * cfg.index_topk, d, device="meta", dtype=dtype)
        w = torch.zeros(1, 64, h, device="meta")
        for fp8 in (True, False):
            kix.indexer_topk(q, w, k, torch.zeros(1, 64, dtype=torch.long, device="meta") + 4 * cfg.index_topk,
                             cfg.index_topk, fp8=fp8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="the CUDA compute capability to compile for (90: H100/H200)")
    ap.add_argument("--sizes", nargs="+", default=["524M", "2B", "glm5"], choices=["524M", "2B", "glm5"],
                    help="bench/gpu.py's configs and GLM-5's shapes to run in bf16 (tiny runs in fp32 always)")
    ap.add_argument("--max-shared", type=int, default=232448,
                    help="shared memory a block may use, bytes (sm_90: 227 KiB, the H200's opt-in maximum)")
    args = ap.parse_args()
    from gpu_common import hf_config
    from triton.backends.compiler import GPUTarget

    import configs
    from model import ModelConfig
    from temper_kernels import moe
    from temper_kernels.meta import on_meta

    target = GPUTarget("cuda", args.arch, 32)
    compiled: dict = {}
    runs = [("tiny", configs.load("tiny").model, torch.float32, 2, 128, {})]
    for size in args.sizes:
        if size == "glm5":
            cfg = configs.load("glm5").model.model_copy(update=GLM5_LAYERS)
            runs += [(f"glm5 {b}×{t}", cfg, torch.bfloat16, b, t, kw) for b, t, kw in GLM5_RUNS]
            continue
        cfg = ModelConfig.from_hf_dict({**hf_config(size, False).to_dict(), "num_nextn_predict_layers": 1})
        runs.append((size, cfg, torch.bfloat16, 1, 2 * cfg.index_topk, {}))
    t0 = time.perf_counter()
    launches: list = []  # GLM-5's
    for name, cfg, dtype, b, t, kw in runs:
        glm5 = name.startswith("glm5")
        with on_meta(compile_for=target, compiled=compiled, launches=launches if glm5 else None):
            if glm5:  # the Triton grouped GEMM in bf16 (a GPU without torch's `_grouped_mm`), not torch's
                moe._torch_grouped_ok = lambda xs, w: False
            paths(cfg, dtype, b, t, **kw)
        print(f"{name}: {len(compiled)} specialisations so far, {time.perf_counter() - t0:.0f} s", flush=True)
    rows, failed, seen = [], 0, {}
    for (kernel, sig, const, opts, *_), got in sorted(compiled.items(), key=lambda kv: kv[0][0]):
        ptrs = ",".join(sorted({v for _, v in sig if v.startswith("*")}))
        consts = " ".join(f"{k}={v}" for k, v in const)
        err = got["error"]
        if err is None and got["shared"] > args.max_shared:
            err = f"needs {got['shared']:,} B of shared memory a block; sm_{args.arch} has {args.max_shared:,}"
        shared = "-" if got["shared"] is None else f"{got['shared'] / 1024:.1f}"
        row = (kernel, ptrs, consts[:70], dict(opts).get("num_warps", "-"), dict(opts).get("num_stages", "-"), shared,
               *("-" if got.get(r) is None else got[r] for r in ("regs", "stack", "local")),
               "ok" if err is None else err[:150])
        seen[row] = seen.get(row, 0) + 1  # specialisations that differ only in which arguments are ÷16: one row
        failed += err is not None
    rows = [[*row[:-1], n, row[-1]] for row, n in seen.items()]
    table(f"Triton kernels compiled for sm_{args.arch} ({len(compiled)} specialisations, {failed} failed)",
          ["kernel", "pointer types", "constexprs", "warps", "stages", "shared KiB", "regs", "stack B", "local B", "×",
           "result"], rows)
    wrapped = offsets_report(compiled, launches) if launches else 0
    sys.exit(1 if failed or wrapped else 0)


# GLM-5's widths in two layers (one dense, one MoE; the first runs the indexer, the second shares it) and one MTP layer;
# a smaller vocabulary (no Triton kernel sees it: the lm-head's loss is torch, in row chunks, whose count it sets)
GLM5_LAYERS = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "mtp_draft_steps": 1,
               "vocab_size": 16384}
# (B, T, cache): one sequence past 2^17 tokens (rope's q slice wraps at 131,072), a batch of 16 × 4096 (the sparse MLA
# wrapped at 58,255 tokens a call either way); the decode step over a 64-slot × 128K cache (4.8 G latent elements).
# The indexer-KL statistics (torch ops in query chunks, no kernel of their own) only in the second: on `meta` their
# ~10^4 chunks of the long sequence cost minutes of Python
GLM5_RUNS = ((1, 135168, {"slots": 64, "max_len": 131072, "collect": False}), (16, 4096, {}))


def offsets_report(compiled: dict, launches: list) -> int:
    """Check the GLM-5 launches' address arithmetic (`ir_offsets.wrapping_offsets`), once per distinct launch (its
    integer arguments and grid); print what wraps, each place once with its widest span. Returns the number of
    places."""
    from ir_offsets import wrapping_offsets

    distinct = {(ln["key"], tuple(sorted(ln["ints"].items())), ln["grid"]) for ln in launches}
    found: dict = {}
    for key, ints, grid in distinct:
        ttir = compiled[key].get("ttir")
        if ttir is None:
            continue
        for f in wrapping_offsets(ttir, {n: (v, v) for n, v in ints}, grid):
            at = (key[0], f.where, f.op, f.value)
            lo, hi = found.get(at, (f.lo, f.hi))
            found[at] = (min(lo, f.lo), max(hi, f.hi))
    rows = [[*at, f"{lo:,} … {hi:,}"] for at, (lo, hi) in sorted(found.items())]
    checked = sorted({k[0] for k, _, _ in distinct})
    table(f"i32 address arithmetic that wraps at GLM-5's shapes ({len(distinct)} launches of {len(checked)} kernels "
          f"checked: {', '.join(checked)}; {len(rows)} found)",
          ["kernel", "source", "op", "value", "exact span"], rows or [["-", "-", "-", "-", "none"]])
    print(f"offsets at GLM-5 shapes: {len(distinct)} launches checked, kernels {' '.join(checked)}; {len(rows)} wrap")
    return len(rows)


if __name__ == "__main__":
    main()
