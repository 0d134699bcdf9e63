"""Multi-head latent attention (MLA) with DeepSeek Sparse Attention (DSA) and IndexShare.

Per token MLA caches one row of `kv_lora_rank + qk_rope_head_dim` numbers: the normalised latent c_kv
and the rotated rotary key k_pe. Two attention paths read that one cache and give the same numbers:

* expanded (train / prefill): kv_b_proj expands c_kv into per-head k_nope and v; scaled dot-product
  attention over [k_nope | k_pe] with a boolean mask of the allowed (causal ∩ selected) keys, computed
  in query chunks so long prefills stay within memory;
* absorbed (decode): q̃_h = q_nope,h · W_UK,h lives in latent space, so all heads attend one shared
  key row [c_kv | k_pe] (a single-head attention over H·T query rows), the output latent P·c_kv is
  mapped by W_UV,h and o_proj. With a DSA selection the selected latent rows are gathered first, so a
  decode step touches top-k rows, not the whole context.

The lightning indexer scores past token s for query t as I(t,s) = Σ_j w_j·ReLU(q_j·k_s)/√d_I with
w = weights_proj(x)/√H_I; the top-k (k = min(index_topk, #keys)) is deterministic, ties going to the
earlier position. A layer whose indexer type is "shared" owns no indexer and attends with its group
leader's indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import temper_kernels as kernels
from temper_kernels import stable_topk  # noqa: F401  (re-exported: the model's deterministic top-k)

from . import indexer_stats
from .config import ModelConfig
from .layers import FP32Linear, RMSNorm, apply_rope, replaying

if TYPE_CHECKING:
    from .cache import KVCache

# Budget (elements) for one chunk of [heads, queries, keys] scores in the expanded / indexer paths.
CHUNK_ELEMS = 1 << 25


def _absorbed_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """MLA's absorbed query [q_nope · W_UK | q_pe] (B, T, H, kv_lora_rank + rope)."""
    return torch.cat([torch.einsum("bthn,hnr->bthr", q_nope, w_uk), q_pe], -1)


@dataclass
class AttnContext:
    """Everything a layer needs that is shared by all layers of one forward."""

    cos: torch.Tensor  # [B, T, rope/2]
    sin: torch.Tensor
    qpos: torch.Tensor  # [B, T] absolute positions of the queries
    cache: KVCache | None = None
    slots: torch.Tensor | None = None  # [B] cache slots
    slot_range: tuple[int, int] | None = None  # contiguous slots → views instead of copies
    write_mask: torch.Tensor | None = None  # [B, T] which new tokens are real (not right padding)
    n_keys: int = 0  # keys visible after this step's writes (max over the batch)
    dense: bool = False  # ignore DSA selection (indexer warm-up / dense baseline)
    impl: str = "auto"  # "expanded" | "absorbed" | "auto"
    collect: list | None = None  # indexer-loss statistics, one entry per indexer group
    detach_indexer_input: bool = False
    indexer_calls: list = field(default_factory=list)  # layer ids whose indexer ran (for tests/metrics)


def sdpa(q, k, v, scale: float, mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention that keeps the fused CPU/GPU kernels when the value width differs
    from the query/key width (MLA: qk 192+64 vs v 128/256): the narrower side is zero-padded, which
    changes neither the scores nor the output."""
    dq, dv = q.shape[-1], v.shape[-1]
    if dv < dq:
        v = F.pad(v, (0, dq - dv))
    elif dq < dv:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    return o[..., :dv] if dq != dv else o


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        q_in = cfg.q_lora_rank or cfg.hidden_size
        self.wq_b = nn.Linear(q_in, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = FP32Linear(cfg.hidden_size, self.n_heads, bias=False)  # fp32, as the references keep it
        self.w_scale = (self.n_heads * self.head_dim) ** -0.5  # over all heads (a tensor-parallel shard keeps it)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.cfg.qk_rope_head_dim
        rot = apply_rope(x[..., :r], cos, sin, self.cfg.rope_interleave_indexer)
        return torch.cat([rot, x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self._rope(self.k_norm(self.wk(x)), cos, sin)  # [B, T, d_I]

    def queries(self, x, q_in, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        q = self._rope(self.wq_b(q_in).view(b, t, self.n_heads, self.head_dim), cos.unsqueeze(2), sin.unsqueeze(2))
        w = F.linear(x.float(), self.weights_proj.weight.float())
        w = w * self.w_scale
        return q.float(), w  # [B,T,HI,dI], [B,T,HI]


class MLA(nn.Module):
    """One attention layer. A tensor-parallel subclass (trainers/megatron) holds a slice of the heads and
    overrides the two hooks: `_fan` (a replicated activation entering per-head work: identity forward,
    gradient summed over the heads' ranks) and `_reduce_heads` (a sum over heads: summed over ranks)."""

    def _fan(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def _reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def _split_heads(self) -> bool:
        """True when the heads are split over ranks: the fused indexer top-k needs every head's score."""
        return False

    def __init__(self, cfg: ModelConfig, layer_idx: int, indexer_type: str):
        super().__init__()
        self.cfg, self.layer_idx, self.indexer_type = cfg, layer_idx, indexer_type
        h, H = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads = H
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, h, bias=cfg.attention_bias)
        self.indexer = Indexer(cfg) if indexer_type == "full" else None
        self.scale = cfg.softmax_scale()

    # ---------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctx: AttnContext, shared_sel: torch.Tensor | None = None):
        """x [B,T,hidden] (normed) → (out [B,T,hidden], selection [B,T,k] or None)."""
        cfg = self.cfg
        b, t, _ = x.shape
        H, nope, rope, r = self.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q_lat = self._fan(self.q_a_layernorm(self.q_a_proj(x)))
            q = self.q_b_proj(q_lat)
        else:
            q_lat = self._fan(x)
            q = self.q_proj(q_lat)
        q = q.view(b, t, H, nope + rope)
        q_nope = q[..., :nope]
        q_pe = apply_rope(q[..., nope:], ctx.cos.unsqueeze(2), ctx.sin.unsqueeze(2), True)
        kv = self.kv_a_proj_with_mqa(x)
        new_kv = torch.cat([self.kv_a_layernorm(kv[..., :r]), apply_rope(kv[..., r:], ctx.cos, ctx.sin, True)], -1)
        new_kv = self._fan(new_kv)
        pool = self._write(ctx, "kv", new_kv)
        n_keys = ctx.n_keys if ctx.cache is not None else t

        # ---- DSA selection ----
        sel = None
        sparse = cfg.use_dsa and not ctx.dense
        needs_sel = sparse and n_keys > cfg.index_topk
        if self.indexer is not None and (needs_sel or ctx.collect is not None or ctx.cache is not None):
            # with a cache the indexer keys are always written, so later (longer) steps find them
            sel = self._index(x, q_lat, keys_len=n_keys, ctx=ctx, sparse=sparse)
        elif self.indexer_type == "shared" and needs_sel:
            if shared_sel is None:
                raise RuntimeError(f"layer {self.layer_idx}: shared indexer layer has no leader selection")
            sel = shared_sel
        if not sparse:
            sel = None

        if ctx.collect is not None and self.indexer_type != "none" and not replaying():  # no_grad: nothing saved
            self._collect_attention(q_nope, q_pe, self._gather(ctx, pool), ctx, sel)

        impl = ctx.impl
        if impl == "auto":
            # with a cache, decode / verify steps and every chunk with a DSA selection read the latent rows in place
            # (absorbed): a prefill chunk never re-expands the cached context. Training forwards with a selection
            # take the sparse kernel where it is Triton (the FLOPs saving); the CPU keeps the masked dense path.
            absorbed = ctx.cache is not None and (t <= 8 or sel is not None)
            absorbed |= sel is not None and kernels.backend(x) == "triton"
            impl = "absorbed" if absorbed else "expanded"
        if impl == "absorbed":
            out = self._absorbed(q_nope, q_pe, pool, ctx, sel)
        else:
            out = self._expanded(q_nope, q_pe, self._gather(ctx, pool), ctx, sel)
        return self.o_proj(out.reshape(b, t, H * cfg.v_head_dim)), sel

    # ---- cache plumbing ----
    def _write(self, ctx: AttnContext, kind: str, new: torch.Tensor) -> torch.Tensor:
        """Write this step's rows into the cache; return the pool [slots, max_len + 1, d] (or `new` without a
        cache). Padding positions go to the scratch column `max_len`."""
        if ctx.cache is None:
            return new
        store = ctx.cache.tensor(kind, self.layer_idx)
        pos = torch.where(ctx.write_mask, ctx.qpos, ctx.cache.max_len)
        store[ctx.slots[:, None].expand_as(pos), pos] = new.to(store.dtype)
        return store

    def _gather(self, ctx: AttnContext, pool: torch.Tensor) -> torch.Tensor:
        """The batch's keys [B, n_keys, d]: a view for contiguous slots, else a copy."""
        if ctx.cache is None:
            return pool
        if ctx.slot_range is not None:
            s0, s1 = ctx.slot_range
            return pool[s0:s1, : ctx.n_keys]
        return pool[ctx.slots, : ctx.n_keys]

    def _keys(self, ctx: AttnContext, kind: str, new: torch.Tensor) -> torch.Tensor:
        return self._gather(ctx, self._write(ctx, kind, new))

    def _allowed(self, ctx: AttnContext, t0: int, t1: int, n_keys: int) -> torch.Tensor:
        kpos = torch.arange(n_keys, device=ctx.qpos.device)
        return kpos <= ctx.qpos[:, t0:t1, None]  # [B, C, S]

    def _index(self, x, q_lat, keys_len: int, ctx: AttnContext, sparse: bool):
        ix = self.indexer
        collect = ctx.collect is not None
        if collect and ctx.detach_indexer_input:
            x, q_lat = x.detach(), q_lat.detach()
        with torch.set_grad_enabled(collect and torch.is_grad_enabled()):
            k_new = ix.keys(x, ctx.cos, ctx.sin)
            k_all = self._fan(self._keys(ctx, "index", k_new))
            q, w = ix.queries(self._fan(x), q_lat, ctx.cos, ctx.sin)
            t = x.shape[1]
            cfg = self.cfg
            relu, fp8, topk = cfg.index_score_relu, cfg.indexer_fp8, cfg.index_topk
            select = sparse and keys_len > topk
            if not select and not collect:
                return None
            replay = replaying()  # recomputing for backward: the statistics were collected once already
            if not replay:
                ctx.indexer_calls.append(self.layer_idx)
            sel = None
            if select and self._split_heads:  # this rank's heads: their scores summed over the ranks, chunk by chunk
                sel = indexer_stats.select_topk(q, w, k_all, ctx.qpos, topk, relu, fp8, self._reduce_heads,
                                                CHUNK_ELEMS)
            elif select:
                sel = kernels.indexer_topk(q, w, k_all, ctx.qpos, topk, fp8=fp8, relu=relu)
            if collect:  # the indexer's logits with their graph: at the selected keys, or (dense) at every key
                s = self._reduce_heads(indexer_stats.indexer_logits(q, w, k_all, sel, relu, CHUNK_ELEMS))
                if sel is not None:
                    s = s.masked_fill(sel > ctx.qpos[..., None], float("-inf"))  # a row's picks past its causal end
                else:
                    s = s.masked_fill(~self._allowed(ctx, 0, t, keys_len), float("-inf"))
                if not replay:
                    ctx.collect.append({"layer": self.layer_idx, "index_logits": s, "target": None, "sel": sel})
            return sel

    # ---- attention paths ----
    def _mask(self, ctx: AttnContext, t0: int, t1: int, n_keys: int, sel: torch.Tensor | None) -> torch.Tensor:
        allowed = self._allowed(ctx, t0, t1, n_keys)
        if sel is None:
            return allowed
        chosen = torch.zeros_like(allowed).scatter_(-1, sel[:, t0:t1], True)
        return allowed & chosen

    def _expanded(self, q_nope, q_pe, keys, ctx: AttnContext, sel):
        cfg = self.cfg
        b, t, H, _ = q_nope.shape
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        s = keys.shape[1]
        kv = self.kv_b_proj(keys[..., :r]).view(b, s, H, nope + cfg.v_head_dim)
        k = torch.cat([kv[..., :nope], keys[..., None, r:].expand(b, s, H, cfg.qk_rope_head_dim)], -1)
        k, v = k.transpose(1, 2), kv[..., nope:].transpose(1, 2)
        q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)  # [B,H,T,D]
        if ctx.cache is None and sel is None:
            o = sdpa(q, k, v, self.scale, is_causal=True)
            return o.transpose(1, 2)
        step = max(1, CHUNK_ELEMS // max(1, H * s * b))
        outs = []
        for t0 in range(0, t, step):
            t1 = min(t, t0 + step)
            m = self._mask(ctx, t0, t1, s, sel).unsqueeze(1)
            outs.append(sdpa(q[:, :, t0:t1], k, v, self.scale, mask=m))
        return torch.cat(outs, 2).transpose(1, 2)

    def _absorb_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]  # W_UK [H,nope,r], W_UV [H,v,r]

    def _absorbed(self, q_nope, q_pe, pool, ctx: AttnContext, sel):
        cfg = self.cfg
        b, t, H, _ = q_nope.shape
        r = cfg.kv_lora_rank
        w_uk, w_uv = self._absorb_weights()
        q = _absorbed_query(q_nope, q_pe, w_uk)  # [B,T,H,r+rope]
        if sel is not None:  # the selected rows, read in place from the pool (no copy of the context)
            slots = ctx.slots if ctx.cache is not None else None
            # kept for the backward as a recipe, not a tensor (288 MiB a layer at the 524M config: 16K × 16 × 576)
            with kernels.recomputed(q, lambda: _absorbed_query(q_nope.detach(), q_pe.detach(), w_uk.detach())):
                o = kernels.sparse_mla(q, pool, sel, ctx.qpos, self.scale, r, slots)
        else:
            keys = self._gather(ctx, pool)
            s = keys.shape[1]
            m = self._allowed(ctx, 0, t, s)  # [B,T,S]
            m = m[:, :, None, :].expand(b, t, H, s).reshape(b, 1, t * H, s)
            o = sdpa(q.reshape(b, 1, t * H, -1), keys[:, None], keys[:, None, :, :r], self.scale, mask=m)
            o = o.view(b, t, H, r)
        return torch.einsum("bthr,hvr->bthv", o, w_uv)

    # ---- indexer-loss statistics ----
    @torch.no_grad()
    def _collect_attention(self, q_nope, q_pe, keys, ctx: AttnContext, sel):
        """Head-summed main-attention distribution of this layer, added to its indexer group's target, in query
        chunks (no [B, H, T, S] logits exist at once). With a selection, at the selected keys only [B, T, k] (what
        the sparse KL reads): the absorbed form over the gathered latent rows, O(k) a query as in `sparse_mla`;
        without one, over every key [B, T, S] through the expanded keys."""
        cfg = self.cfg
        b, t, H, _ = q_nope.shape
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        s = keys.shape[1]
        parts = []
        if sel is not None:
            w_uk, _ = self._absorb_weights()
            n, d = sel.shape[-1], keys.shape[-1]
            step = max(1, CHUNK_ELEMS // max(1, b * n * (d + H)))
            rows = torch.arange(b, device=keys.device)[:, None, None]
            for t0 in range(0, t, step):
                t1 = min(t, t0 + step)
                qa = _absorbed_query(q_nope[:, t0:t1], q_pe[:, t0:t1], w_uk)  # [B, C, H, r + rope]
                sc = torch.einsum("bchd,bckd->bchk", qa, keys[rows, sel[:, t0:t1]]).float() * self.scale
                valid = sel[:, t0:t1] <= ctx.qpos[:, t0:t1, None]  # a row's picks past its causal end
                p = sc.masked_fill(~valid[:, :, None], float("-inf")).softmax(-1).sum(2)  # [B, C, k]
                parts.append(self._reduce_heads(p))
        else:
            kv = self.kv_b_proj(keys[..., :r]).view(b, s, H, nope + cfg.v_head_dim)
            k = torch.cat([kv[..., :nope], keys[..., None, r:].expand(b, s, H, cfg.qk_rope_head_dim)], -1)
            q = torch.cat([q_nope, q_pe], -1)
            step = max(1, CHUNK_ELEMS // max(1, b * H * s))
            for t0 in range(0, t, step):
                t1 = min(t, t0 + step)
                logits = torch.einsum("bthd,bshd->bhts", q[:, t0:t1], k).float() * self.scale
                m = self._allowed(ctx, t0, t1, s)
                parts.append(self._reduce_heads(logits.masked_fill(~m[:, None], float("-inf")).softmax(-1).sum(1)))
        p = torch.cat(parts, 1)
        entry = ctx.collect[-1]
        entry["target"] = p if entry["target"] is None else entry["target"] + p
