"""Prefill time: IndexShare (one indexer per group of four layers) vs plain DSA (an indexer in every
layer), same weights for everything the two share, at long context with an indexer-heavy config.
Run: .venv/bin/python bench/indexshare_prefill.py [--contexts 2048 4096]
"""

from __future__ import annotations

import argparse

import torch
from common import table, threads, timeit

from model import ModelConfig, Transformer


def bench_cfg(types: list[str], topk: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=272, hidden_size=128, num_hidden_layers=4, first_k_dense_replace=4, intermediate_size=256,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        index_n_heads=16, index_head_dim=64, index_topk=topk, indexer_types=types, num_nextn_predict_layers=0,
        max_position_embeddings=65536,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--topk", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    plain = Transformer(bench_cfg(["full"] * 4, args.topk)).eval()
    share = Transformer(bench_cfg(["full", "shared", "shared", "shared"], args.topk)).eval()
    share.load_state_dict({k: v for k, v in plain.state_dict().items() if k in share.state_dict()})
    rows = []
    for ctx in args.contexts:
        ids = torch.randint(0, 272, (1, ctx), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            t_plain = timeit(lambda ids=ids: plain(ids), repeat=3)
            t_share = timeit(lambda ids=ids: share(ids), repeat=3)
        rows.append([ctx, t_plain, t_share, t_plain / t_share])
    table(f"prefill, batch 1, 4 layers, indexer 16×64 vs MLA 4 heads, top-{args.topk}, {threads()} threads",
          ["context", "plain DSA s", "IndexShare s", "speed-up"], rows)


if __name__ == "__main__":
    main()
