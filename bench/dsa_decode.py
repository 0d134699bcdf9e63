"""Decode step time: DSA (lightning indexer + top-k latent gather) vs dense MLA, same weights.

The cache is filled to the context length with random latent rows (a decode step's cost does not
depend on the values), then one token per sequence is decoded through the absorbed MLA path.
Run: .venv/bin/python bench/dsa_decode.py [--contexts 4096 16384 32768]
"""

from __future__ import annotations

import argparse

import torch
from common import table, threads, timeit

from model import KVCache, ModelConfig, Transformer


def bench_cfg(use_dsa: bool, topk: int) -> ModelConfig:
    # GLM-5-like proportions at CPU scale: the indexer is ~1/40 of MLA's per-key work
    return ModelConfig(
        vocab_size=272, hidden_size=256, num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=512,
        num_attention_heads=16, q_lora_rank=128, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=32,
        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        use_dsa=use_dsa, index_n_heads=4, index_head_dim=32, index_topk=topk, num_nextn_predict_layers=0,
        max_position_embeddings=65536,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--topk", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    dsa = Transformer(bench_cfg(True, args.topk)).eval()
    dense = Transformer(bench_cfg(False, args.topk)).eval()
    dense.load_state_dict({k: v for k, v in dsa.state_dict().items() if ".indexer." not in k})
    rows = []
    for ctx in args.contexts:
        times = {}
        for name, m in (("dense", dense), ("dsa", dsa)):
            cache = KVCache(m.config, args.batch, ctx + 8)
            g = torch.Generator().manual_seed(1)
            for layer in range(m.config.num_hidden_layers):
                cache.kv[layer][:, :ctx] = torch.randn(args.batch, ctx, cache.kv[layer].shape[-1], generator=g)
                if cache.index[layer] is not None:
                    cache.index[layer][:, :ctx] = torch.randn(args.batch, ctx, cache.index[layer].shape[-1],
                                                              generator=g)
            tok = torch.randint(0, 272, (args.batch, 1), generator=g)

            def step(m=m, cache=cache, tok=tok, ctx=ctx):
                cache.lengths[:] = ctx
                with torch.no_grad():
                    m(tok, cache=cache)

            times[name] = timeit(step, repeat=7, warmup=2)
        rows.append([ctx, times["dense"] * 1e3, times["dsa"] * 1e3, times["dense"] / times["dsa"]])
    table(f"decode step, batch {args.batch}, 2 layers, 16 heads, kv_lora 256, DSA top-{args.topk}, "
          f"{threads()} threads",
          ["context", "dense MLA ms", "DSA ms", "speed-up"], rows)


if __name__ == "__main__":
    main()
