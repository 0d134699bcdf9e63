"""Decode tokens/s: temper's embedded engine vs transformers' `generate`, same checkpoint, greedy, one process.
Config as in REFERENCE.md's baseline (hidden 128, 4 layers, 8 experts top-2, "FSSS"). Three engines:
- `loop MoE`: the decode step's experts as the reference's loop over experts (the code before P; `DENSE_ROWS = 0`);
- `dense MoE`: a step of at most `DENSE_ROWS` tokens as one GEMM over every expert (the default);
- `compiled`: the step through torch.compile (`compile_decode`), timed warm; its compile seconds (tracing, and C++
  compiling unless Inductor's disk cache has it) are reported beside it.
Each engine first decodes the timed length once (warm-up: allocator, the compiled variants on both sides of the
indexer's top-k). Run: .venv/bin/python bench/engine_decode.py [--batches 16 64] [--no-compile]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from common import reference_glm_config, table, threads

import temper_kernels.moe as kmoe
from model import load_checkpoint
from rollout.engine import Engine, GenRequest
from rollout.sampling import SamplingParams


def _engine_run(model, prompts, new: int, dense_rows: int, compile_decode: bool) -> tuple[float, list, Engine]:
    """(seconds of the timed run, its outputs, the engine) after a warm-up run of the same length."""
    b, plen = prompts.shape
    kmoe.DENSE_ROWS, old = dense_rows, kmoe.DENSE_ROWS
    try:
        eng = Engine(model, n_slots=b, max_len=plen + new + 8, start=False, chunk_size=plen * b,
                     compile_decode=compile_decode)
        sp = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
        for _ in range(2):  # a warm-up run, then the timed one
            t = time.perf_counter()
            reqs = [eng.submit(GenRequest(p.tolist(), sp.model_copy())) for p in prompts]
            while not all(r.future.done() for r in reqs):
                eng.step()
            dt = time.perf_counter() - t
        return dt, [r.output_ids for r in reqs], eng
    finally:
        kmoe.DENSE_ROWS = old


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled engine")
    args = ap.parse_args()
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    transformers.logging.set_verbosity_error()
    hf_cfg = reference_glm_config(eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_checkpoint(d)
    rows = []
    for b in args.batches:
        prompts = torch.randint(1, 272, (b, args.prompt), generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            hf.generate(prompts, max_new_tokens=4, do_sample=False, min_new_tokens=4)  # warm-up
            t = time.perf_counter()
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new,
                              min_new_tokens=args.new, do_sample=False)
            t_hf = time.perf_counter() - t
        want = out[:, args.prompt:].tolist()
        n = b * args.new
        rows.append([b, "transformers generate", f"{n / t_hf:,.0f}", 1.0, "", ""])
        engines = [("engine, loop MoE (before)", 0, False), ("engine, dense MoE", kmoe.DENSE_ROWS, False)]
        engines += [] if args.no_compile else [("engine, compiled", kmoe.DENSE_ROWS, True)]
        for name, dense, comp in engines:
            dt, got, eng = _engine_run(ours, prompts, args.new, dense, comp)
            same = sum(g == w for g, w in zip(got, want))
            note = f"compile {eng.stats.compile_seconds:.1f} s ({eng.stats.compiled})" if comp else ""
            rows.append([b, name, f"{n / dt:,.0f}", t_hf / dt, f"{same}/{b}", note])
    table(f"greedy decode, prompt {args.prompt}, {args.new} new tokens, {threads()} threads",
          ["batch", "decoder", "tok/s", "vs generate", "same tokens as generate", "note"], rows)


if __name__ == "__main__":
    main()
