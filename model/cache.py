"""Preallocated slot pool for incremental decoding.

For every attention layer (the main layers, then the MTP layers) the pool holds, per slot and
position, one MLA row `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]` and, for layers that own a
lightning indexer, the indexer key (index_head_dim). `lengths[slot]` counts the tokens of the main
model cached in a slot; `mtp_lengths[slot]` the tokens seen by the MTP layers.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        n_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        self.cfg, self.n_slots, self.max_len = cfg, n_slots, max_len
        types = cfg.layer_indexer_types() + ["full" if cfg.use_dsa else "none"] * cfg.num_nextn_predict_layers
        row = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        # one scratch column past max_len: right-padding tokens of a step write there, so a cache write is a
        # plain index_put with no data-dependent shape (no host sync; capturable in a CUDA graph)
        self.kv = [torch.zeros(n_slots, max_len + 1, row, dtype=dtype, device=device) for _ in types]
        self.index = [
            torch.zeros(n_slots, max_len + 1, cfg.index_head_dim, dtype=torch.float32, device=device)
            if t == "full"
            else None
            for t in types
        ]
        self.lengths = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.mtp_lengths = torch.zeros(n_slots, dtype=torch.long, device=device)

    def tensor(self, kind: str, layer: int) -> torch.Tensor:
        t = self.kv[layer] if kind == "kv" else self.index[layer]
        if t is None:
            raise RuntimeError(f"layer {layer} has no {kind} cache")
        return t

    def reset(self, slots: torch.Tensor | list[int] | None = None) -> None:
        """Forget the contents of `slots` (all when None). Rows are overwritten on the next write."""
        if slots is None:
            self.lengths.zero_()
            self.mtp_lengths.zero_()
        else:
            self.lengths[slots] = 0
            self.mtp_lengths[slots] = 0

    def truncate(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll slots back to `lengths` tokens (rejected speculative tokens, prefix reuse)."""
        self.lengths[slots] = torch.minimum(self.lengths[slots], lengths)
        self.mtp_lengths[slots] = torch.minimum(self.mtp_lengths[slots], lengths)

    def nbytes_per_token(self) -> int:
        return sum(t[0, 0].numel() * t.element_size() for t in self.kv) + sum(
            t[0, 0].numel() * t.element_size() for t in self.index if t is not None
        )
