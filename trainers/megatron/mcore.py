"""HF layout ↔ Megatron-core's own parameter names for GLM-5 / DeepSeek-V3.2 (MLA, the DSA indexer, MoE, MTP): the
state dict of a Megatron-LM `GPTModel` (Megatron-LM's torch checkpoints, a distributed checkpoint read back whole),
and the names Megatron Bridge maps to and from the HF checkpoints. One rank's whole model (tp = pp = ep = 1); temper's
own `MegatronGLM` keeps HF-style names (`convert.py`), which shard over tp / ep. Pure torch: no Megatron import.

Per decoder layer `decoder.layers.{i}.` (MTP layer j: `mtp.layers.{j}.transformer_layer.`), Megatron-core 0.16's
module names (checked against a GPTModel built from its classes in tests/trainers/test_megatron_mcore.py):

    input_layernorm                                   input_layernorm
    self_attn.q_a_proj / q_b_proj / q_proj            self_attention.linear_q_down_proj / linear_q_up_proj / linear_q_proj
    self_attn.kv_a_proj_with_mqa / kv_b_proj          self_attention.linear_kv_down_proj / linear_kv_up_proj
    self_attn.q_a_layernorm / kv_a_layernorm          self_attention.q_layernorm / kv_layernorm
    self_attn.o_proj                                  self_attention.linear_proj
    self_attn.indexer.{wq_b, wk, k_norm, weights_proj}  self_attention.core_attention.indexer.{linear_wq_b, linear_wk,
                                                        k_norm, linear_weights_proj}
    post_attention_layernorm                          pre_mlp_layernorm
    mlp.{gate,up}_proj / down_proj (dense)            mlp.linear_fc1 ([gate; up]) / mlp.linear_fc2
    mlp.gate.weight / .e_score_correction_bias        mlp.router.weight / .expert_bias
    mlp.experts.{e}.*                                 mlp.experts.local_experts.{e}.linear_fc{1,2} (SequentialMLP)
    mlp.shared_experts.*                              mlp.shared_experts.linear_fc{1,2}

and `embedding.word_embeddings`, `decoder.final_layernorm` (HF `model.norm`), `output_layer` (HF `lm_head`; absent
with tied embeddings: Megatron's head then reads the embedding), MTP's `enorm`, `hnorm`, `eh_proj` and
`final_layernorm` (HF `shared_head.norm`). Megatron's MTP layers share the embedding and output layer, as temper's do:
an HF checkpoint's MTP copies of them (`embed_tokens`, `shared_head.head`) convert only when equal to the main ones.

Transformer Engine's layer spec fuses a norm into the linear after it: `linear_q_up_proj.layer_norm_weight`,
`linear_kv_up_proj.layer_norm_weight`, and a dense layer's `mlp.linear_fc1.layer_norm_weight`; its grouped experts
are `mlp.experts.linear_fc{1,2}.weight{e}`. `from_mcore` reads either spelling; `to_mcore(te=True)` writes TE's.

One layout differs: Megatron's indexer keeps each head's rotary dims last ([nope | rope], `DSAIndexer._apply_rope`),
HF's first ([rope | nope]); `wq_b`'s rows per head, `wk`'s rows and `k_norm`'s weight and bias are permuted (a
LayerNorm over the head commutes with the permutation), as Megatron Bridge's DSA mapping swaps them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from model.checkpoint import _check_mtp_copy
from model.config import ModelConfig

SAME, GLU, IXQ, IXK = "same", "glu", "ixq", "ixk"
_Q_LORA = [("q_a_proj.weight", "linear_q_down_proj.weight"), ("q_b_proj.weight", "linear_q_up_proj.weight")]
_KV_O = [("kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"), ("kv_b_proj.weight", "linear_kv_up_proj.weight"),
         ("o_proj.weight", "linear_proj.weight")]
_MTP_COPY = re.compile(r"model\.layers\.(\d+)\.(embed_tokens\.weight|shared_head\.head\.weight)$")
_INDEXER = [("wq_b.weight", "linear_wq_b.weight", IXQ), ("wk.weight", "linear_wk.weight", IXK),
            ("k_norm.weight", "k_norm.weight", IXK), ("k_norm.bias", "k_norm.bias", IXK),
            ("weights_proj.weight", "linear_weights_proj.weight", SAME)]


def _layer(cfg: ModelConfig, hf: str, mg: str, moe: bool, indexer: bool, te: bool
           ) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], str]]:
    """(HF names, the Megatron names it may have (the first is what `to_mcore` writes, TE's spelling first with
    `te`), kind) for one transformer layer."""
    a, ma = hf + "self_attn.", mg + "self_attention."

    def norm(local: str, fused: str) -> tuple[str, ...]:
        return (fused, local) if te else (local, fused)

    yield (hf + "input_layernorm.weight",), (mg + "input_layernorm.weight",), SAME
    for h, m in [*(_Q_LORA if cfg.q_lora_rank else [("q_proj.weight", "linear_q_proj.weight")]), *_KV_O]:
        yield (a + h,), (ma + m,), SAME
    if cfg.q_lora_rank:
        yield (a + "q_a_layernorm.weight",), norm(ma + "q_layernorm.weight", ma + "linear_q_up_proj.layer_norm_weight"), SAME
    yield (a + "kv_a_layernorm.weight",), norm(ma + "kv_layernorm.weight", ma + "linear_kv_up_proj.layer_norm_weight"), SAME
    if indexer:
        for h, m, kind in _INDEXER:
            yield (a + "indexer." + h,), (ma + "core_attention.indexer." + m,), kind
    m, mm = hf + "mlp.", mg + "mlp."
    post = hf + "post_attention_layernorm.weight"
    if not moe:
        yield (post,), norm(mg + "pre_mlp_layernorm.weight", mm + "linear_fc1.layer_norm_weight"), SAME
        yield (m + "gate_proj.weight", m + "up_proj.weight"), (mm + "linear_fc1.weight",), GLU
        yield (m + "down_proj.weight",), (mm + "linear_fc2.weight",), SAME
        return
    yield (post,), (mg + "pre_mlp_layernorm.weight",), SAME
    yield (m + "gate.weight",), (mm + "router.weight",), SAME
    yield (m + "gate.e_score_correction_bias",), (mm + "router.expert_bias",), SAME
    if cfg.n_shared_experts:
        s, ms = m + "shared_experts.", mm + "shared_experts."
        yield (s + "gate_proj.weight", s + "up_proj.weight"), (ms + "linear_fc1.weight",), GLU
        yield (s + "down_proj.weight",), (ms + "linear_fc2.weight",), SAME
    for e in range(cfg.n_routed_experts):
        x, seq, grp = f"{m}experts.{e}.", f"{mm}experts.local_experts.{e}.", f"{mm}experts."
        fc1, fc2 = (grp + f"linear_fc1.weight{e}", seq + "linear_fc1.weight"), \
            (grp + f"linear_fc2.weight{e}", seq + "linear_fc2.weight")
        yield (x + "gate_proj.weight", x + "up_proj.weight"), fc1 if te else fc1[::-1], GLU
        yield (x + "down_proj.weight",), fc2 if te else fc2[::-1], SAME


def _rules(cfg: ModelConfig, te: bool = False) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], str]]:
    L = cfg.num_hidden_layers
    yield ("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), SAME
    yield ("model.norm.weight",), ("decoder.final_layernorm.weight",), SAME
    if not cfg.tie_word_embeddings:
        yield ("lm_head.weight",), ("output_layer.weight",), SAME
    types = cfg.layer_indexer_types()
    for i in range(L):
        yield from _layer(cfg, f"model.layers.{i}.", f"decoder.layers.{i}.", cfg.is_moe_layer(i), types[i] == "full", te)
    for j in range(cfg.num_nextn_predict_layers):
        hf, top = f"model.layers.{L + j}.", f"mtp.layers.{j}."
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            yield (hf + name,), (top + name,), SAME
        yield (hf + "shared_head.norm.weight",), (top + "final_layernorm.weight",), SAME
        yield from _layer(cfg, hf, top + "transformer_layer.", cfg.n_routed_experts > 0, cfg.use_dsa, te)


def _rope_last(cfg: ModelConfig) -> torch.Tensor:
    """The row order taking one HF indexer head ([rope | nope]) to Megatron's ([nope | rope])."""
    d, r = cfg.index_head_dim, cfg.qk_rope_head_dim
    return torch.cat([torch.arange(r, d), torch.arange(r)])


def _permute(kind: str, t: torch.Tensor, order: torch.Tensor, heads: int) -> torch.Tensor:
    if kind == IXK:
        return t[order]
    return t.reshape(heads, order.numel(), *t.shape[1:])[:, order].reshape(t.shape)


def to_mcore(hf: dict[str, torch.Tensor], cfg: ModelConfig, *, te: bool = False) -> dict[str, torch.Tensor]:
    """An HF-layout state (temper's `to_hf_state`, or a checkpoint's tensors) under Megatron-core's names. `te`:
    Transformer Engine's spelling (fused norms, grouped experts). Every HF tensor is converted or refused: an MTP
    layer's own embedding or head that differs from the shared one, or a name this config has no place for, raises."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    order = _rope_last(cfg)
    for names, mg, kind in _rules(cfg, te):
        missing = [n for n in names if n not in hf]
        if missing:
            raise KeyError(f"HF state lacks {', '.join(missing)}")
        ts = [hf[n] for n in names]
        used.update(names)
        if kind == GLU:
            out[mg[0]] = torch.cat(ts, 0)
        elif kind in (IXQ, IXK):
            out[mg[0]] = _permute(kind, ts[0], order, cfg.index_n_heads)
        else:
            out[mg[0]] = ts[0]
    L = cfg.num_hidden_layers
    for name in sorted(set(hf) - used):
        copy = _MTP_COPY.match(name)
        if copy and L <= int(copy.group(1)) < L + cfg.num_nextn_predict_layers:
            _check_mtp_copy(cfg, hf, int(copy.group(1)) - L, copy.group(2), hf[name])  # shared: equal or refused
            continue
        raise KeyError(f"{name}: no Megatron-core name for it under this config")
    return out


def from_mcore(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A Megatron-core GPTModel's state dict (either spelling, `_extra_state` entries ignored) in HF layout, with
    temper's names (`from_hf_state` loads it). Every Megatron tensor is converted or refused: a name this config
    has no place for (an indexer in a layer the config shares, an output layer with tied embeddings) raises."""
    sd = {k: v for k, v in sd.items() if not k.endswith("_extra_state")}
    if any(k.endswith("mlp.experts.weight1") for k in sd):
        raise KeyError("mlp.experts.weight1: the legacy GroupedMLP layout (moe_use_legacy_grouped_gemm) is not read; "
                       "save with SequentialMLP or Transformer Engine's grouped experts")
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    order = _rope_last(cfg).argsort()
    for names, mgs, kind in _rules(cfg):
        found = [m for m in mgs if m in sd]
        if not found:
            raise KeyError(f"Megatron state lacks {' or '.join(mgs)} (HF {names[0]})")
        t = sd[found[0]]
        used.add(found[0])
        if kind == GLU:
            for n, part in zip(names, t.chunk(2, 0)):
                out[n] = part
        elif kind in (IXQ, IXK):
            out[names[0]] = _permute(kind, t, order, cfg.index_n_heads)
        else:
            out[names[0]] = t
    if extra := sorted(set(sd) - used):
        why = " (tie_word_embeddings: the head is the embedding)" if "output_layer.weight" in extra else ""
        raise KeyError(f"Megatron state has tensors this config has no place for{why}: {', '.join(extra[:6])}")
    return out
