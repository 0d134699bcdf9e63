"""The GLM-5 / DeepSeek-V3.2 transformer: MLA + DSA (IndexShare) attention, dense and MoE FFNs, MTP.

Full-sequence use (training, scoring)::

    model = Transformer(cfg)
    logits = model(input_ids)                  # [B, T, V]
    out = model.run(input_ids)                 # .logits, .hidden (pre-norm last layer, for MTP)

Incremental decoding API (what the engine uses)::

    cache = KVCache(cfg, n_slots=S, max_len=L)          # preallocated pool, see model/cache.py
    out = model.run(new_ids, cache=cache, slots=slots, n_new=n_new)

* `new_ids` [B, T] holds the *new* tokens of B sequences, right-padded: row b has `n_new[b]` real
  tokens (default: all T). Sequences may be at different lengths; nothing but the new tokens is passed.
* `slots` [B] names the cache slot of each row (default 0..B-1). Row b's new tokens sit at positions
  `cache.lengths[slot] + 0..n_new[b]-1`; each layer writes their latent row [c_kv | k_pe] and (on
  indexer layers) their indexer key into the slot, then attends over the slot's first
  `lengths + n_new` positions, causally. Padded positions are neither written nor attended to.
* After the call `cache.lengths[slots] += n_new`. `out.logits[b, n_new[b]-1]` is the next-token
  distribution of sequence b; logits at padded positions are meaningless.
* `impl="auto"` picks the absorbed MLA path for steps of ≤ 8 new tokens (decode, speculative verify) and
  for prefill chunks with a DSA selection (the selected latent rows are read in place, nothing is
  re-expanded), and the expanded path otherwise; both read the same latent cache. `impl` must be one of
  "auto", "expanded", "absorbed".
* DSA: with more keys than `index_topk`, each query attends only its top-k keys (deterministic ties);
  "shared" layers reuse their group leader's indices and never run an indexer.
* `cache.reset(slots)` frees slots; `cache.truncate(slots, lengths)` rolls back (rejected drafts).
* MTP: `model.mtp(hidden, next_ids, step, cache=..., slots=..., n_new=...)` runs draft step `step` on
  the hidden states of the previous step (or the main model's `out.hidden`), using `cache.mtp_lengths`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .attention import MLA, AttnContext
from .cache import KVCache
from .config import ModelConfig
from .layers import MLP, Experts, MoE, RMSNorm, Rotary, Router, _replaying

IMPLS = ("auto", "expanded", "absorbed")


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    hidden: torch.Tensor  # [B, T, hidden] last layer output before the final norm
    indexer_stats: list | None = None
    indexer_calls: list | None = None


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, indexer_type: str, moe: bool):
        super().__init__()
        self.self_attn = MLA(cfg, layer_idx, indexer_type)
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: AttnContext, sel: torch.Tensor | None):
        h, sel = self.self_attn(self.input_layernorm(x), ctx, sel)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), sel


class MTPLayer(nn.Module):
    """h' = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) → one block; logits = lm_head(shared_head.norm(h'))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = Block(cfg, layer_idx, "full" if cfg.use_dsa else "none", moe=cfg.n_routed_experts > 0)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h_prev: torch.Tensor, emb_next: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(h_prev)], -1))
        return self.block(x, ctx, None)[0]


def _checkpointed(layer: nn.Module, x: torch.Tensor, ctx: AttnContext, sel: torch.Tensor | None):
    """`layer(x, ctx, sel)` keeping only its inputs for backward, which runs it again (non-reentrant
    `torch.utils.checkpoint`) under `model.layers.replaying()`, so its side effects happen once."""
    from torch.utils.checkpoint import checkpoint

    from temper_kernels.memory import no_recipes

    calls = [0]

    def run(x, sel):
        calls[0] += 1
        with no_recipes():  # the checkpoint makes the layer's tensors again itself (temper_kernels/memory.py)
            if calls[0] == 1:
                return layer(x, ctx, sel)
            token = _replaying.set(True)
            try:
                return layer(x, ctx, sel)
            finally:
                _replaying.reset(token)

    return checkpoint(run, x, sel, use_reentrant=False)


class Transformer(nn.Module):
    """`activation_checkpointing`: training forwards (grad enabled, no cache) keep only each main layer's input and
    recompute the layer in backward: activation memory of one layer instead of all, for about one more forward.
    Set by the trainer backends from `trainer.activation_checkpointing`; not part of the checkpoint."""

    supports_head_chunks = True  # model/losses.py may take its losses through `lm_head(norm(h))` in row chunks

    activation_checkpointing: bool = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = cfg = config
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        types = cfg.layer_indexer_types()
        self.layers = nn.ModuleList(
            Block(cfg, i, types[i], cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp_layers = nn.ModuleList(
            MTPLayer(cfg, cfg.num_hidden_layers + i) for i in range(cfg.num_nextn_predict_layers)
        )
        self.rotary = Rotary(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    # ---- init -------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                if m.weight.device.type != "meta":
                    nn.init.normal_(m.weight, std=std)
                    if getattr(m, "bias", None) is not None:
                        nn.init.zeros_(m.bias)
            elif isinstance(m, (RMSNorm, nn.LayerNorm)) and m.weight.device.type != "meta":
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, Experts | Router) and m.weight_tensors()[0].device.type != "meta":
                for w in m.weight_tensors():
                    nn.init.normal_(w, std=std)

    def materialize_buffers(self, device: str | torch.device = "cpu") -> None:
        """Recreate non-persistent buffers (after building on the meta device and loading weights)."""
        self.rotary = Rotary(self.config).to(device)
        for m in self.moe_layers():
            m.expert_load = torch.zeros(self.config.n_routed_experts, device=device)

    # ---- context ----------------------------------------------------------------------------------
    def _context(self, b: int, t: int, device, dtype, cache: KVCache | None, slots, n_new, mtp: bool,
                 n_keys: int | None = None, **kw) -> tuple[AttnContext, torch.Tensor | None, torch.Tensor | None]:
        """`n_keys` (with a cache): the caller's bound on every row's keys after this step's writes. Given, the
        context reads nothing back from the device (no checks of `n_new`, no contiguity test, no `end.max()`): the
        forward has no host sync and can be captured in a CUDA graph (`rollout.engine.DecodeGraphs`). Keys past a
        row's own positions are masked, so any bound at least the true one gives the same outputs (to float rounding
        where the larger bound crosses the indexer's top-k and the step takes the selected path instead of the dense
        one)."""
        if kw.get("impl", "auto") not in IMPLS:
            raise ValueError(f"impl: {kw['impl']!r} is not one of {', '.join(IMPLS)}")
        ar = torch.arange(t, device=device)
        if cache is None:
            qpos = ar.expand(b, t)
            cos, sin = self.rotary(ar, dtype)
            return AttnContext(cos=cos.expand(b, t, -1), sin=sin.expand(b, t, -1), qpos=qpos, **kw), None, None
        if slots is None:
            slots = torch.arange(b, device=device)
        slots = torch.as_tensor(slots, device=device, dtype=torch.long)
        if n_new is None:
            n_new = torch.full((b,), t, device=device, dtype=torch.long)
        n_new = torch.as_tensor(n_new, device=device, dtype=torch.long)
        lengths = cache.mtp_lengths if mtp else cache.lengths
        start = lengths[slots]
        end = start + n_new
        qpos = start[:, None] + ar
        cos, sin = self.rotary(qpos, dtype)
        write_mask = ar[None, :] < n_new[:, None]
        if n_keys is not None:  # the caller's bound: nothing read back from the device
            if not 0 < n_keys <= cache.max_len:
                raise ValueError(f"n_keys must lie in [1, {cache.max_len}] (the cache's max_len), got {n_keys}")
            return AttnContext(cos=cos, sin=sin, qpos=qpos, cache=cache, slots=slots, slot_range=None,
                               write_mask=write_mask, n_keys=n_keys, **kw), slots, end
        if bool((n_new > t).any()) or bool((n_new < 0).any()):
            raise ValueError(f"n_new must lie in [0, {t}] (the width of input_ids)")
        n_keys = int(end.max()) if b else 0
        if n_keys > cache.max_len:
            raise ValueError(f"cache overflow: {n_keys} positions needed, cache max_len is {cache.max_len}")
        s0 = int(slots[0]) if b else 0
        contiguous = b > 0 and bool((slots == torch.arange(s0, s0 + b, device=device)).all())
        ctx = AttnContext(
            cos=cos, sin=sin, qpos=qpos, cache=cache, slots=slots,
            slot_range=(s0, s0 + b) if contiguous else None,
            write_mask=write_mask, n_keys=n_keys, **kw,
        )
        return ctx, slots, end

    # ---- forward ----------------------------------------------------------------------------------
    def run(
        self,
        input_ids: torch.Tensor,
        *,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        n_new: torch.Tensor | None = None,
        dense: bool = False,
        impl: str = "auto",
        collect_indexer: bool = False,
        detach_indexer_input: bool = False,
        logits: bool = True,
        n_keys: int | None = None,
    ) -> ModelOutput:
        """`n_keys`: see `_context` (a host-sync-free forward over a cache, for CUDA graphs)."""
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids)
        ctx, slots, end = self._context(
            b, t, x.device, x.dtype, cache, slots, n_new, mtp=False, n_keys=n_keys, dense=dense, impl=impl,
            collect=[] if collect_indexer else None, detach_indexer_input=detach_indexer_input,
        )
        sel = None
        checkpointed = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        for layer in self.layers:
            x, sel = _checkpointed(layer, x, ctx, sel) if checkpointed else layer(x, ctx, sel)
        if cache is not None:
            cache.lengths[slots] = end
        out = self.lm_head(self.norm(x)) if logits else x.new_empty(0)
        return ModelOutput(out, x, ctx.collect, ctx.indexer_calls)

    def forward(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        return self.run(input_ids, **kw).logits

    def mtp(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        step: int = 0,
        *,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
        n_new: torch.Tensor | None = None,
        impl: str = "auto",
        logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft step: (logits [B,T,V], hidden [B,T,H]). Position i combines hidden[i] with the
        embedding of next_ids[i] (the token after position i) and predicts the token after that. Step 0 takes the
        main model's `out.hidden` (normed first when `config.mtp_input == "post_norm"`), later steps the previous
        step's hidden. `logits=False`: an empty tensor in their place (the head applied by the caller, with
        `mtp_head_norm(step)`)."""
        if not len(self.mtp_layers):
            raise RuntimeError("this model has no MTP layer (num_nextn_predict_layers = 0)")
        layer = self.mtp_layers[min(step, len(self.mtp_layers) - 1)]
        if step == 0 and self.config.mtp_input == "post_norm":  # Megatron's convention (ModelConfig.mtp_input)
            hidden = self.norm(hidden)
        b, t = next_ids.shape
        ctx, slots, end = self._context(b, t, hidden.device, hidden.dtype, cache, slots, n_new, mtp=True, impl=impl)
        h = layer(hidden, self.embed_tokens(next_ids), ctx)
        if cache is not None:
            cache.mtp_lengths[slots] = end
        return (self.lm_head(layer.shared_head_norm(h)) if logits else h.new_empty(0)), h

    def mtp_head_norm(self, step: int = 0) -> nn.Module:
        """The norm MTP draft step `step` applies before the shared `lm_head`."""
        return self.mtp_layers[min(step, len(self.mtp_layers) - 1)].shared_head_norm

    # ---- utilities --------------------------------------------------------------------------------
    def attention_modules(self) -> list[nn.Module]:
        """The main layers' attention modules (what SAO's critic freezes; the Megatron model has its own)."""
        return [layer.self_attn for layer in self.layers]

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def update_router_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free load balancing: call after each optimiser step."""
        for m in self.moe_layers():
            m.update_bias(rate)

    def num_parameters(self, active: bool = False, mtp: bool = True) -> int:
        """Total parameters, or those a token activates: top-k routed + shared experts, without the
        input embedding (a table lookup, not compute: the convention of the published active counts)."""
        cfg = self.config
        total = 0
        for name, p in self.named_parameters():
            if not mtp and name.startswith("mtp_layers"):
                continue
            if active and name == "embed_tokens.weight" and not cfg.tie_word_embeddings:
                continue
            n = p.numel()
            if active and name.endswith(("experts.gate_up_proj", "experts.down_proj")) and p.dim() == 3:
                n = n // cfg.n_routed_experts * cfg.num_experts_per_tok
            total += n
        return total

