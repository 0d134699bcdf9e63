"""temper's `ModelConfig` ↔ Megatron-core's `MLATransformerConfig` arguments.

`megatron_args(cfg)` is the pure mapping (no Megatron import): the keyword arguments of Megatron's transformer
config that describe the same model, under the names Megatron 0.16–0.19 use. `model_config_from_megatron` maps
them back. The two conventions where Megatron's GLM-5 setup and temper's default differ are explicit fields of
`ModelConfig`, so a checkpoint says which one it was trained with:

* `index_score_relu` ↔ `dsa_indexer_scoring_relu` (Megatron: off for GLM-5; transformers applies the ReLU);
* `mtp_input` ↔ where Megatron's GPTModel takes MTP's input from: the decoder's output after the final norm
  (`"post_norm"`); temper's default feeds the pre-norm state (`"pre_norm"`).

Routing semantics that Megatron cannot express are errors naming the key, not silent approximations.
"""

from __future__ import annotations

from typing import Any

from model.config import ModelConfig, YarnConfig, shared_indexer_pattern

# the keys `megatron_args` writes that only newer Megatron versions know (0.19: DSA IndexShare and the ReLU switch)
DSA_KEYS = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_topk_freq",
            "dsa_indexer_skip_topk_offset", "dsa_indexer_rope_interleaved", "dsa_indexer_scoring_relu")


class MegatronMappingError(ValueError):
    """A ModelConfig field whose value Megatron-core cannot express."""


def megatron_args(cfg: ModelConfig) -> dict[str, Any]:
    """The MLATransformerConfig keyword arguments of `cfg` (model shape only: no parallel sizes, no dtype)."""

    def bad(key: str, why: str):
        raise MegatronMappingError(f"{key}: {why}")

    if cfg.attention_bias:
        bad("attention_bias", "Megatron's MLA has no projection biases in temper's layout (add_bias_linear=False)")
    if not cfg.norm_topk_prob:
        bad("norm_topk_prob", "Megatron always renormalises the top-k routing weights")
    if cfg.n_group > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
        bad("n_group", f"Megatron scores a group by its top num_experts_per_tok/topk_group = "
                       f"{cfg.num_experts_per_tok // cfg.topk_group} experts, temper (DeepSeek-V3) by its top 2")
    L, k = cfg.num_hidden_layers, cfg.first_k_dense_replace
    share = _periodic(cfg) if cfg.use_dsa else None
    if cfg.use_dsa and share is None:
        bad("indexer_types", "Megatron describes IndexShare by a frequency and an offset; no (freq, offset) gives "
                             f"this layout: {cfg.layer_indexer_types()}")
    d: dict[str, Any] = {
        "num_layers": L,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "multi_latent_attention": True,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_head_dim": cfg.qk_nope_head_dim,
        "qk_pos_emb_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rotary_base": cfg.rope_theta,
        "normalization": "RMSNorm",
        "layernorm_epsilon": cfg.rms_norm_eps,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "num_moe_experts": cfg.n_routed_experts,
        "moe_ffn_hidden_size": cfg.moe_intermediate_size,
        "moe_router_topk": cfg.num_experts_per_tok,
        "moe_shared_expert_intermediate_size": cfg.moe_intermediate_size * cfg.n_shared_experts or None,
        "moe_router_score_function": cfg.scoring_func,
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": cfg.n_group if cfg.n_group > 1 else None,
        "moe_router_group_topk": cfg.topk_group if cfg.n_group > 1 else None,
        "moe_router_topk_scaling_factor": cfg.routed_scaling_factor,
        "moe_router_load_balancing_type": "none",  # aux-loss-free: only the expert bias balances
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        "moe_layer_freq": [0] * k + [1] * (L - k),
        "mtp_num_layers": cfg.num_nextn_predict_layers or None,
        "share_embeddings_and_output_weights": cfg.tie_word_embeddings,
        "rope_type": "rope",
    }
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        if y.attention_factor is not None:
            bad("rope_scaling.attention_factor", "Megatron's YaRN always infers the cos/sin scale from mscale")
        if not y.truncate:
            bad("rope_scaling.truncate", "Megatron's YaRN rounds the correction range to whole dimensions")
        mscale = y.mscale
        if not (y.mscale and y.mscale_all_dim):  # temper / HF: the scale from the factor alone, m(factor, 1)
            if y.mscale_all_dim:
                bad("rope_scaling.mscale", "Megatron's YaRN scales cos/sin by m(factor, mscale) / m(factor, "
                                           "mscale_all_dim) always; HF's m(factor) without mscale has no equivalent")
            mscale = 1.0  # Megatron's ratio with mscale_all_dim = 0 is then m(factor, 1)
        d.update(rope_type="yarn", rotary_scaling_factor=y.factor,
                 original_max_position_embeddings=y.original_max_position_embeddings, beta_fast=y.beta_fast,
                 beta_slow=y.beta_slow, mscale=mscale, mscale_all_dim=y.mscale_all_dim)
    if cfg.use_dsa:
        d.update(dsa_indexer_n_heads=cfg.index_n_heads, dsa_indexer_head_dim=cfg.index_head_dim,
                 dsa_indexer_topk=cfg.index_topk, dsa_indexer_topk_freq=share[0],
                 dsa_indexer_skip_topk_offset=share[1],
                 dsa_indexer_rope_interleaved=cfg.rope_interleave_indexer,
                 dsa_indexer_scoring_relu=cfg.index_score_relu)
    return d


def _periodic(cfg: ModelConfig) -> tuple[int, int] | None:
    """The (freq, offset >= 1) whose periodic IndexShare layout is `cfg`'s (the config's own pair first)."""
    types, L = cfg.layer_indexer_types(), cfg.num_hidden_layers
    pairs = [(cfg.index_share_freq, max(cfg.index_share_offset, 1))]
    pairs += [(f, o) for f in range(1, L + 1) for o in range(1, L + 1)]
    return next((p for p in pairs if shared_indexer_pattern(L, *p) == types), None)


def model_config_from_megatron(args: dict[str, Any], *, vocab_size: int, model_type: str = "glm_moe_dsa",
                               mtp_input: str = "post_norm", **extra: Any) -> ModelConfig:
    """The ModelConfig of a Megatron model described by `args` (as `megatron_args` writes them). Megatron's GPTModel
    feeds MTP the post-norm state, hence the default `mtp_input`; `extra` sets fields Megatron does not carry
    (token ids, `max_position_embeddings`, `mtp_draft_steps`, ...)."""
    a = dict(args)
    freq = a.get("moe_layer_freq", 1)
    L = a["num_layers"]
    dense = freq.index(1) if isinstance(freq, list) and 1 in freq else (0 if not isinstance(freq, list) else L)
    if isinstance(freq, list) and freq != [0] * dense + [1] * (L - dense):
        raise MegatronMappingError(f"moe_layer_freq: temper needs dense layers first, then MoE; got {freq}")
    yarn = None
    if a.get("rope_type") == "yarn":
        yarn = YarnConfig(factor=a["rotary_scaling_factor"],
                          original_max_position_embeddings=a["original_max_position_embeddings"],
                          beta_fast=a.get("beta_fast", 32.0), beta_slow=a.get("beta_slow", 1.0),
                          mscale=a.get("mscale", 1.0), mscale_all_dim=a.get("mscale_all_dim", 0.0))
    if a.get("add_bias_linear"):
        raise MegatronMappingError("add_bias_linear: temper's layout has no linear biases")
    use_dsa = "dsa_indexer_topk" in a
    shared = a.get("moe_shared_expert_intermediate_size") or 0
    moe_i = a["moe_ffn_hidden_size"]
    if shared % moe_i:
        raise MegatronMappingError(f"moe_shared_expert_intermediate_size: {shared} is not a multiple of "
                                   f"moe_ffn_hidden_size={moe_i}")
    kw: dict[str, Any] = dict(
        model_type=model_type, vocab_size=vocab_size, hidden_size=a["hidden_size"], num_hidden_layers=L,
        first_k_dense_replace=dense, intermediate_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"], q_lora_rank=a.get("q_lora_rank"),
        kv_lora_rank=a["kv_lora_rank"], qk_nope_head_dim=a["qk_head_dim"], qk_rope_head_dim=a["qk_pos_emb_head_dim"],
        v_head_dim=a["v_head_dim"], rope_theta=a.get("rotary_base", 10000.0), rope_scaling=yarn,
        n_routed_experts=a["num_moe_experts"], n_shared_experts=shared // moe_i,
        num_experts_per_tok=a["moe_router_topk"], moe_intermediate_size=moe_i,
        n_group=a.get("moe_router_num_groups") or 1, topk_group=a.get("moe_router_group_topk") or 1,
        routed_scaling_factor=a.get("moe_router_topk_scaling_factor") or 1.0,
        scoring_func=a.get("moe_router_score_function", "softmax"), rms_norm_eps=a.get("layernorm_epsilon", 1e-5),
        num_nextn_predict_layers=a.get("mtp_num_layers") or 0,
        tie_word_embeddings=a.get("share_embeddings_and_output_weights", False), use_dsa=use_dsa,
        mtp_input=mtp_input,
    )
    if use_dsa:
        kw.update(index_n_heads=a["dsa_indexer_n_heads"], index_head_dim=a["dsa_indexer_head_dim"],
                  index_topk=a["dsa_indexer_topk"], index_share_freq=a.get("dsa_indexer_topk_freq", 1),
                  index_share_offset=a.get("dsa_indexer_skip_topk_offset", 1),
                  indexer_rope_interleave=a.get("dsa_indexer_rope_interleaved"),
                  index_score_relu=a.get("dsa_indexer_scoring_relu", True))
    kw.update(extra)
    return ModelConfig(**kw)
