"""Forward tokens/s: temper's `model.Transformer` vs transformers' GlmMoeDsaForCausalLM, same weights.

Config as in REFERENCE.md's baseline: hidden 128, 4 layers, 8 experts top-2, "FSSS" indexers, batch
8 × 512 on the CPU, fp32, no grad.  Run: .venv/bin/python bench/model_forward.py
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from common import reference_glm_config, table, threads, timeit

from model import load_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    transformers.logging.set_verbosity_error()
    hf_cfg = reference_glm_config()
    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_checkpoint(d)
    n_params = sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, 272, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
        t_hf = timeit(lambda: hf(ids), repeat=args.repeat)
        t_ours = timeit(lambda: ours(ids), repeat=args.repeat)
    n = ids.numel()
    table(
        f"forward {args.batch}×{args.seq}, {n_params / 1e6:.2f}M params, fp32, {threads()} threads "
        f"(max |Δlogit| {diff:.1e})",
        ["implementation", "seconds", "tokens/s", "ratio"],
        [["transformers GlmMoeDsa", t_hf, f"{n / t_hf:,.0f}", 1.0],
         ["temper model.Transformer", t_ours, f"{n / t_ours:,.0f}", t_hf / t_ours]],
    )


if __name__ == "__main__":
    main()
