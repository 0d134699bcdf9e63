"""Decode tokens/s: temper's embedded engine vs transformers' `generate`, same checkpoint, greedy,
batch 1 and 16. Config as in REFERENCE.md's baseline (hidden 128, 4 layers, 8 experts top-2, "FSSS").
Run: .venv/bin/python bench/engine_decode.py
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from common import reference_glm_config, table, threads

from model import load_checkpoint
from rollout.engine import Engine, GenRequest
from rollout.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
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
        assert out.shape[1] == args.prompt + args.new
        eng = Engine(ours, n_slots=b, max_len=args.prompt + args.new + 8, start=False, chunk_size=args.prompt * b)
        sp = SamplingParams(max_new_tokens=args.new, temperature=0, ignore_eos=True)
        warm = [eng.submit(GenRequest(p.tolist(), sp.model_copy(update={"max_new_tokens": 4}))) for p in prompts]
        while not all(r.future.done() for r in warm):
            eng.step()
        t = time.perf_counter()
        reqs = [eng.submit(GenRequest(p.tolist(), sp.model_copy())) for p in prompts]
        while not all(r.future.done() for r in reqs):
            eng.step()
        t_ours = time.perf_counter() - t
        same = sum(r.output_ids == out[i, args.prompt:].tolist() for i, r in enumerate(reqs))
        n = b * args.new
        rows.append([b, f"{n / t_hf:,.0f}", f"{n / t_ours:,.0f}", t_hf / t_ours, f"{same}/{b}"])
    table(f"greedy decode, prompt {args.prompt}, {args.new} new tokens, {threads()} threads",
          ["batch", "transformers tok/s", "temper engine tok/s", "speed-up", "identical outputs"], rows)


if __name__ == "__main__":
    main()
