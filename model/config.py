"""`ModelConfig`: one pydantic model for the GLM-5 / DeepSeek-V3.2 family.

Field names follow the HF `config.json` of `glm_moe_dsa` / `deepseek_v32` where one exists, so a config
converts to and from a checkpoint's `config.json` without a rename table (`from_hf_dict` / `to_hf_dict`).
Extra temper knobs (`use_dsa`, `indexer_rope_interleave`, `mtp_draft_steps`, ...) carry defaults that
reproduce the published models.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

ModelType = Literal["glm_moe_dsa", "deepseek_v32"]
IndexerType = Literal["full", "shared"]

# config.json keys `from_hf_dict` reads (`quantization_config`: `checkpoint.load_checkpoint`), ...
_HF_READ = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace", "intermediate_size",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "attention_bias", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "n_routed_experts",
    "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group", "topk_group",
    "routed_scaling_factor", "scoring_func", "norm_topk_prob", "index_n_heads", "index_head_dim", "index_topk",
    "indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset", "indexer_rope_interleave",
    "num_nextn_predict_layers", "rms_norm_eps", "initializer_range", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "dtype", "torch_dtype", "quantization_config", "temper",
})
# ... standard keys it ignores on purpose (bookkeeping, derived, inference/parallelism settings), ...
_HF_IGNORED = frozenset({
    "transformers_version", "architectures", "auto_map", "use_cache", "num_key_value_heads", "head_dim",
    "qk_head_dim", "attention_dropout", "mlp_layer_types", "layer_types", "output_router_logits", "ep_size",
    "moe_router_dtype", "pretraining_tp",
})
# ... and keys it accepts only at the value temper implements (any other value is reported as unknown).
_HF_FIXED: dict[str, Any] = {
    "hidden_act": "silu", "topk_method": "noaux_tc", "rope_interleave": True, "mlp_bias": False, "moe_layer_freq": 1,
    "index_share_for_mtp_iteration": False,
}
_TEMPER_KEYS = frozenset({"use_dsa", "indexer_rope_interleave", "mtp_draft_steps", "index_score_relu", "mtp_input",
                          "indexer_fp8"})
# HF's default `index_skip_topk_offset` when only `index_topk_freq` is given (transformers GlmMoeDsaConfig, SGLang).
_HF_DEFAULT_SKIP_OFFSET = 2

# What a config.json that leaves a key out means: transformers' class defaults (GlmMoeDsaConfig / DeepseekV32Config,
# which SGLang and vLLM read too), per model_type, for every key `from_hf_dict` reads that those classes define
# (tests/model/test_hf_import.py compares each entry with the classes). `rope_theta` is `rope_parameters.rope_theta`.
_HF_SHARED_DEFAULTS: dict[str, Any] = {
    "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "initializer_range": 0.02, "pad_token_id": None, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "attention_bias": False, "index_topk": 2048, "index_head_dim": 128, "first_k_dense_replace": 3, "rope_theta": 10000.0,
}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm_moe_dsa": {**_HF_SHARED_DEFAULTS, "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
                    "num_hidden_layers": 78, "num_attention_heads": 64, "q_lora_rank": 2048, "v_head_dim": 256,
                    "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "max_position_embeddings": 202752,
                    "rms_norm_eps": 1e-5, "index_n_heads": 32},
    "deepseek_v32": {**_HF_SHARED_DEFAULTS, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                     "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536, "v_head_dim": 128,
                     "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "max_position_embeddings": 163840,
                     "rms_norm_eps": 1e-6, "index_n_heads": 64},
}
# ... and for keys those classes do not define, what transformers' modeling does without them: sigmoid routing
# scores, no MTP layer (it builds none), every layer running its own indexer (no IndexShare keys: freq 1)
_HF_MODELING_DEFAULTS: dict[str, Any] = {"scoring_func": "sigmoid", "num_nextn_predict_layers": 0}
# the keys of `rope_parameters` / `rope_scaling` temper implements, by rope type (transformers' validation lists the
# same ones: `_validate_default_rope_parameters`, `_validate_yarn_rope_parameters`); `type` is the legacy name of
# `rope_type`, `partial_rotary_factor` is accepted at 1.0 only
_ROPE_KEYS = {
    "default": frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"}),
    "yarn": frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
                       "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
                       "mscale_all_dim", "truncate"}),
}


def _rope_dicts(d: dict[str, Any]) -> list[tuple[str, dict]]:
    return [(k, d[k]) for k in ("rope_parameters", "rope_scaling") if isinstance(d.get(k), dict)]


def _rope_type(r: dict) -> str:
    return r.get("rope_type", r.get("type")) or "default"


class YarnConfig(BaseModel):
    """YaRN context extension of the rotary embedding (DeepSeek style)."""

    model_config = ConfigDict(extra="forbid")

    factor: float = Field(gt=1.0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # HF semantics (transformers' `_compute_yarn_parameters`): the cos/sin scale; None: inferred from factor, mscale
    # and mscale_all_dim. `truncate`: round the correction range to whole dimensions (floor / ceil)
    attention_factor: float | None = Field(default=None, gt=0)
    truncate: bool = True


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def shared_indexer_pattern(num_layers: int, freq: int, offset: int) -> list[str]:
    """IndexShare layout. Layer i (0-based) runs its own indexer iff max(i - max(offset, 1) + 1, 0) % freq == 0,
    which is Megatron's rule `(max(layer - max(offset, 1), 0) mod freq) == 0` with 1-based layer numbers, and the
    HF rule (transformers GlmMoeDsaConfig, SGLang: `max(i - index_skip_topk_offset + 1, 0) % index_topk_freq`)
    for offset >= 1. An offset of 0 is clamped to 1 as Megatron does (the HF rule unclamped would make layer 0
    "shared", with no leader); `to_hf_dict` writes the clamped value, so every reader sees the same layout."""
    freq, offset = max(freq, 1), max(offset, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _parse_topk_pattern(pattern: Any, n: int) -> list[str]:
    """`index_topk_pattern`: one marker per layer, "F" (runs the indexer) / "S" (shares), as a string ("FSSF...")
    or a list (of "F"/"S" or "full"/"shared")."""
    names = {"F": "full", "S": "shared", "full": "full", "shared": "shared"}
    if not isinstance(pattern, (str, list)) or any(not isinstance(c, str) or c not in names for c in pattern):
        raise ValueError(f"index_topk_pattern: {pattern!r} is not a string or list of 'F'/'S' per layer")
    if len(pattern) != n:
        raise ValueError(f"index_topk_pattern: has {len(pattern)} entries, need num_hidden_layers={n}")
    return [names[c] for c in pattern]


def _hf_indexshare(d: dict[str, Any], n: int) -> dict[str, Any]:
    """`ModelConfig` IndexShare kwargs from HF keys: `indexer_types` / `index_topk_pattern` -> `indexer_types`,
    `index_topk_freq` -> `index_share_freq`, `index_skip_topk_offset` -> `index_share_offset`. Every layout the
    dict gives must agree; a periodic one is kept as freq/offset so that it round-trips field for field."""
    kw: dict[str, Any] = {}
    layouts: dict[str, list[str]] = {}
    if d.get("indexer_types") is not None:
        kw["indexer_types"] = layouts["indexer_types"] = list(d["indexer_types"])
    if d.get("index_topk_pattern") is not None:
        layouts["index_topk_pattern"] = _parse_topk_pattern(d["index_topk_pattern"], n)
        kw.setdefault("indexer_types", layouts["index_topk_pattern"])
    freq, offset = d.get("index_topk_freq"), d.get("index_skip_topk_offset")
    if freq is not None and (not isinstance(freq, int) or freq < 1):
        raise ValueError(f"index_topk_freq: must be an integer >= 1, got {freq!r}")
    if offset is not None and (not isinstance(offset, int) or offset < 0):
        raise ValueError(f"index_skip_topk_offset: must be an integer >= 0, got {offset!r}")
    if offset is not None:
        kw["index_share_offset"] = offset
    if freq is not None:
        offset = _HF_DEFAULT_SKIP_OFFSET if offset is None else offset
        kw.update(index_share_freq=freq, index_share_offset=offset)
        layouts["index_topk_freq/index_skip_topk_offset"] = periodic = shared_indexer_pattern(n, freq, offset)
        if kw.get("indexer_types") == periodic:
            del kw["indexer_types"]
    keys = list(layouts)
    for key in keys[1:]:
        got, want = layouts[key], layouts[keys[0]]
        if got != want:
            at = next((f"layer {i}: {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(got, want)) if a != b), "lengths")
            raise ValueError(f"{key}: disagrees with {keys[0]} on the IndexShare layout ({at})")
    return kw


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model_type: ModelType = "glm_moe_dsa"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    # dense layers
    first_k_dense_replace: int = Field(default=1, ge=0)
    intermediate_size: int = Field(gt=0)
    # MLA
    num_attention_heads: int = Field(gt=0)
    q_lora_rank: int | None = Field(default=None, gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    attention_bias: bool = False
    # rotary
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: YarnConfig | None = None
    max_position_embeddings: int = Field(default=4096, gt=0)
    # MoE
    n_routed_experts: int = Field(gt=0)
    n_shared_experts: int = Field(default=1, ge=0)
    num_experts_per_tok: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    scoring_func: Literal["sigmoid", "softmax"] = "sigmoid"
    norm_topk_prob: bool = True
    # DSA lightning indexer
    use_dsa: bool = True
    index_n_heads: int = Field(default=4, gt=0)
    index_head_dim: int = Field(default=32, gt=0)
    index_topk: int = Field(default=64, gt=0)
    indexer_rope_interleave: bool | None = None  # None: by model_type (GLM-5 interleaved, V3.2 half-split)
    indexer_types: list[IndexerType] | None = None
    index_share_freq: int = Field(default=1, gt=0)
    index_share_offset: int = Field(default=1, ge=0)  # 0 acts as 1, as in Megatron (see shared_indexer_pattern)
    # the indexer score's convention: Σ_j w_j·ReLU(q_j·k) (True: transformers' GLM-5 and DeepSeek-V3.2, temper's
    # default) or Σ_j w_j·(q_j·k) (False: Megatron's `dsa_indexer_scoring_relu=False`, its GLM-5 setting)
    index_score_relu: bool = True
    # the indexer's top-k from FP8 e4m3 queries and keys (per-token / per-head scales; GLM-5 and DeepSeek-V3.2 select
    # this way): e4m3 tensor cores on a GPU, its quantise-dequantise twin elsewhere (temper_kernels/indexer.py)
    indexer_fp8: bool = False
    # MTP
    num_nextn_predict_layers: int = Field(default=1, ge=0)
    mtp_draft_steps: int = Field(default=1, ge=1)
    # which hidden state the first MTP layer reads: the last layer's output before the final norm ("pre_norm": temper's
    # convention) or after it ("post_norm": GLM-5's and DeepSeek-V3's, as Megatron's GPTModel, vLLM and SGLang feed it;
    # what `from_hf_dict` gives a checkpoint that does not carry temper's block)
    mtp_input: Literal["pre_norm", "post_norm"] = "pre_norm"
    # misc
    rms_norm_eps: float = Field(default=1e-5, gt=0)
    initializer_range: float = Field(default=0.02, gt=0)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        def bad(field: str, why: str):
            raise ValueError(f"{field}: {why}")

        if self.first_k_dense_replace > self.num_hidden_layers:
            bad("first_k_dense_replace", f"{self.first_k_dense_replace} > num_hidden_layers")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even (rotary pairs)")
        if self.n_routed_experts % self.n_group:
            bad("n_group", f"{self.n_group} does not divide n_routed_experts={self.n_routed_experts}")
        if self.topk_group > self.n_group:
            bad("topk_group", f"{self.topk_group} > n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            bad("n_group", "group-limited routing scores a group by its top-2 experts: need >= 2 per group")
        if self.num_experts_per_tok > self.topk_group * per_group:
            bad("num_experts_per_tok", f"{self.num_experts_per_tok} > experts reachable in topk_group groups")
        if self.use_dsa:
            if self.index_head_dim < self.qk_rope_head_dim:
                bad("index_head_dim", f"must be >= qk_rope_head_dim={self.qk_rope_head_dim}")
            if self.indexer_types is not None:
                if len(self.indexer_types) != self.num_hidden_layers:
                    bad("indexer_types", f"has {len(self.indexer_types)} entries, need {self.num_hidden_layers}")
                if self.indexer_types[0] != "full":
                    bad("indexer_types", "layer 0 must be 'full' (a shared layer needs a leader before it)")
        if self.rope_scaling is not None and self.rope_scaling.original_max_position_embeddings <= 0:
            bad("rope_scaling.original_max_position_embeddings", "must be > 0")
        return self

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_interleave_indexer(self) -> bool:
        if self.indexer_rope_interleave is not None:
            return self.indexer_rope_interleave
        return self.model_type == "glm_moe_dsa"

    def layer_indexer_types(self) -> list[str]:
        """Per-layer "full" (runs an indexer) / "shared" (reuses its group leader's top-k)."""
        if not self.use_dsa:
            return ["none"] * self.num_hidden_layers
        if self.indexer_types is not None:
            return list(self.indexer_types)
        return shared_indexer_pattern(self.num_hidden_layers, self.index_share_freq, self.index_share_offset)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        y = self.rope_scaling
        if y is not None and y.mscale_all_dim:
            m = yarn_mscale(y.factor, y.mscale_all_dim)
            scale = scale * m * m
        return scale

    # ---- HF config.json ---------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        arch = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(rope_type="yarn", **self.rope_scaling.model_dump(exclude_none=True))
        n_dense = self.first_k_dense_replace
        d: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "n_shared_experts": self.n_shared_experts,
            "n_routed_experts": self.n_routed_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "head_dim": self.qk_rope_head_dim,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc",
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": rope,
            "attention_bias": self.attention_bias,
            "first_k_dense_replace": n_dense,
            "mlp_layer_types": ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense),
            "index_topk": self.index_topk,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": self.dtype,
            "temper": {
                "use_dsa": self.use_dsa,
                "indexer_rope_interleave": self.indexer_rope_interleave,
                "mtp_draft_steps": self.mtp_draft_steps,
                "index_score_relu": self.index_score_relu,
                "indexer_fp8": self.indexer_fp8,
                "mtp_input": self.mtp_input,
            },
        }
        if self.model_type == "glm_moe_dsa":
            d["indexer_types"] = self.layer_indexer_types() if self.use_dsa else None
            d["indexer_rope_interleave"] = self.rope_interleave_indexer  # SGLang / vLLM read it (default False)
        d.update(self._hf_indexshare_keys())
        return d

    def _hf_indexshare_keys(self) -> dict[str, Any]:
        """The standard keys transformers / SGLang read an IndexShare layout from, written (as in GLM-5.2's
        config.json) only when some layer shares: `index_topk_freq` / `index_skip_topk_offset` for the periodic
        layout (offset clamped to >= 1, see `shared_indexer_pattern`), else `index_topk_pattern` ("F"/"S")."""
        types = self.layer_indexer_types()
        if "shared" not in types:
            return {}
        if self.indexer_types is None:
            return {"index_topk_freq": self.index_share_freq, "index_skip_topk_offset": max(self.index_share_offset, 1)}
        return {"index_topk_pattern": "".join("F" if t == "full" else "S" for t in types)}

    @staticmethod
    def hf_unknown_keys(d: dict[str, Any]) -> list[str]:
        """Keys of an HF config dict that `from_hf_dict` does not understand (`temper.<key>` for the temper block,
        `rope_parameters.<key>` / `rope_scaling.<key>` inside the rotary settings), including keys it accepts only at
        one value (`rope_interleave`, ...) when they hold another."""
        unknown = [k for k in d if k not in _HF_READ | _HF_IGNORED and (k not in _HF_FIXED or d[k] != _HF_FIXED[k])]
        unknown += [f"temper.{k}" for k in d.get("temper") or {} if k not in _TEMPER_KEYS]
        for name, r in _rope_dicts(d):
            known = _ROPE_KEYS.get(_rope_type(r), _ROPE_KEYS["default"])
            unknown += [f"{name}.{k}" for k in r if k not in known
                        or (k == "partial_rotary_factor" and r[k] not in (None, 1, 1.0))]
        return sorted(unknown)

    @staticmethod
    def _hf_yarn(d: dict[str, Any]) -> YarnConfig | None:
        """The YaRN settings of `rope_parameters` (or the legacy `rope_scaling`), read as transformers reads them."""
        for name, r in _rope_dicts(d):
            if _rope_type(r) not in _ROPE_KEYS:
                raise ValueError(f"{name}.rope_type: {_rope_type(r)!r} is not supported (temper implements "
                                 f"{', '.join(_ROPE_KEYS)})")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if _rope_type(rope) == "yarn" else None)
        if not scaling or _rope_type(scaling) != "yarn":
            return None
        orig = scaling.get("original_max_position_embeddings") or d.get("max_position_embeddings")
        factor = scaling.get("factor")
        if factor is None and orig:  # transformers: the ratio of the context lengths
            factor = d.get("max_position_embeddings", orig) / orig
        # mscale absent (or 0): transformers takes the cos/sin scale from the factor alone, not the mscale ratio; 0 keeps
        # that reading (`layers.rope_inv_freq` takes the ratio only when both are set, as transformers does)
        return YarnConfig(factor=factor, original_max_position_embeddings=orig,
                          beta_fast=scaling.get("beta_fast") or 32.0, beta_slow=scaling.get("beta_slow") or 1.0,
                          mscale=scaling.get("mscale") or 0.0, mscale_all_dim=scaling.get("mscale_all_dim") or 0.0,
                          attention_factor=scaling.get("attention_factor"), truncate=scaling.get("truncate", True))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], strict: bool = False) -> ModelConfig:
        """Build from a `config.json` dict. Keys it does not understand (`hf_unknown_keys`) are logged as a
        warning, or raise a ValueError naming them if `strict`. A key left out takes transformers' default for the
        model type (`HF_DEFAULTS`). A checkpoint without temper's block (one from the hub, Megatron or another tool)
        feeds its MTP layer the post-norm state, as GLM-5, DeepSeek-V3, Megatron, vLLM and SGLang do."""
        mt = d.get("model_type")
        if mt not in ("glm_moe_dsa", "deepseek_v32"):
            raise ValueError(f"model_type: {mt!r} is not supported (expected 'glm_moe_dsa' or 'deepseek_v32')")
        if unknown := cls.hf_unknown_keys(d):
            msg = f"config.json keys temper does not understand: {', '.join(unknown)}"
            if strict:
                raise ValueError(msg)
            logger.warning("%s (ignored)", msg)
        hf = {**HF_DEFAULTS[mt], **_HF_MODELING_DEFAULTS}

        def get(key: str, nullable: bool = False) -> Any:
            """`d[key]`; transformers' default where the key is absent (or null, for a key that cannot be null)."""
            v = d.get(key, hf[key])
            return hf[key] if v is None and not nullable else v

        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", hf["rope_theta"]))
        yarn = cls._hf_yarn(d)
        temper_block = d.get("temper")
        t = temper_block or {}
        eos = get("eos_token_id", nullable=True)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        n_layers = get("num_hidden_layers")
        indexshare = _hf_indexshare(d, n_layers)
        interleave = t.get("indexer_rope_interleave", d.get("indexer_rope_interleave"))
        # temper's own checkpoints name their MTP convention; one without the block is someone else's: post-norm
        mtp_input = t.get("mtp_input", "pre_norm" if temper_block is not None else "post_norm")
        return cls(
            model_type=mt,
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            num_hidden_layers=n_layers,
            first_k_dense_replace=get("first_k_dense_replace"),
            intermediate_size=get("intermediate_size"),
            num_attention_heads=get("num_attention_heads"),
            q_lora_rank=get("q_lora_rank", nullable=True),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            attention_bias=get("attention_bias"),
            rope_theta=theta,
            rope_scaling=yarn,
            max_position_embeddings=get("max_position_embeddings"),
            n_routed_experts=get("n_routed_experts"),
            n_shared_experts=d.get("n_shared_experts", hf["n_shared_experts"]) or 0,
            num_experts_per_tok=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            n_group=get("n_group"),
            topk_group=get("topk_group"),
            routed_scaling_factor=get("routed_scaling_factor"),
            scoring_func=get("scoring_func"),
            norm_topk_prob=get("norm_topk_prob"),
            use_dsa=t.get("use_dsa", True),
            index_n_heads=get("index_n_heads"),
            index_head_dim=get("index_head_dim"),
            index_topk=get("index_topk"),
            indexer_rope_interleave=interleave,
            **indexshare,
            num_nextn_predict_layers=get("num_nextn_predict_layers"),
            mtp_draft_steps=t.get("mtp_draft_steps", 1),
            index_score_relu=t.get("index_score_relu", True),
            indexer_fp8=t.get("indexer_fp8", False),
            mtp_input=mtp_input,
            rms_norm_eps=get("rms_norm_eps"),
            initializer_range=get("initializer_range"),
            tie_word_embeddings=get("tie_word_embeddings"),
            bos_token_id=get("bos_token_id", nullable=True),
            eos_token_id=eos,
            pad_token_id=get("pad_token_id", nullable=True),
            dtype="bfloat16" if str(dtype) in ("bfloat16", "torch.bfloat16") else "float32",
        )

    def transformers_caveats(self) -> list[str]:
        """What transformers would read differently from a checkpoint of this config (empty: nothing). Its
        DeepseekV32ForCausalLM has no IndexShare: it builds an indexer in every layer and initialises the shared
        layers' at random (SGLang reads `index_topk_freq` / `index_topk_pattern` and shares as temper does)."""
        shared = [i for i, t in enumerate(self.layer_indexer_types()) if t == "shared"]
        if self.model_type == "deepseek_v32" and shared:
            return [f"transformers' DeepseekV32ForCausalLM ignores IndexShare: it would build indexers for the shared "
                    f"layers {shared} and initialise them at random (different top-k, different logits); SGLang reads "
                    "the layout from index_topk_freq / index_topk_pattern"]
        return []
