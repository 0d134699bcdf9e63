"""Fidelity to checkpoints users bring from the hub: transformers' defaults for missing config.json keys, GLM-5's MTP
convention, the MTP layer's own embedding and head, YaRN's `attention_factor` and unknown rotary keys, and a
`deepseek_v32` IndexShare save that transformers would load wrongly.

The references are transformers' own classes (GlmMoeDsaConfig, DeepseekV32Config, its rope initialisers and
models), read programmatically: no expected number here is copied from them by hand.
"""

import json
import logging
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

from model import ModelConfig, Transformer, load_checkpoint, save_checkpoint
from model.checkpoint import from_hf_state, to_hf_state
from model.config import HF_DEFAULTS
from model.layers import rope_inv_freq

HF_CLASSES = {"glm_moe_dsa": GlmMoeDsaConfig, "deepseek_v32": DeepseekV32Config}


# ---- defaults ---------------------------------------------------------------------------------------------------
def _hf_value(hf, key):
    return hf.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(hf, key)


@pytest.mark.parametrize("model_type", list(HF_CLASSES))
def test_missing_keys_take_transformers_defaults(model_type):
    """A config.json with nothing but its model_type reads as transformers reads it: every ModelConfig field that
    transformers' class also has equals the class's default (compared attribute by attribute, not from a copied
    table), and the table `from_hf_dict` uses holds exactly the classes' values."""
    hf = HF_CLASSES[model_type]()
    for key, value in HF_DEFAULTS[model_type].items():
        assert value == _hf_value(hf, key), f"HF_DEFAULTS[{model_type!r}][{key!r}]"
    cfg = ModelConfig.from_hf_dict({"model_type": model_type}, strict=True)
    compared = []
    for field in ModelConfig.model_fields:
        if field in ("dtype", "indexer_types", "rope_scaling") or not (hasattr(hf, field) or field == "rope_theta"):
            continue  # dtype: transformers' None is "the weights' dtype"; the other two are compared below
        assert getattr(cfg, field) == _hf_value(hf, field), field
        compared.append(field)
    # the ones the last round found wrong, and enough of the rest to mean something
    assert {"first_k_dense_replace", "index_n_heads", "rms_norm_eps", "routed_scaling_factor", "q_lora_rank",
            "max_position_embeddings", "bos_token_id", "eos_token_id"} <= set(compared) and len(compared) >= 28
    assert (cfg.rope_scaling is None) == (hf.rope_parameters["rope_type"] == "default")  # (rope_scaling: its alias)
    # IndexShare: transformers' GLM-5 default layout (no freq / offset keys) is every layer running its indexer, and
    # DeepSeek-V3.2 has no sharing at all
    assert cfg.layer_indexer_types() == (getattr(hf, "indexer_types", None) or ["full"] * cfg.num_hidden_layers)
    assert cfg.softmax_scale() == pytest.approx(yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim**-0.5))
    # a key given explicitly wins; a null where transformers allows one (q_lora_rank: no query compression) is kept
    d = {"model_type": model_type, "first_k_dense_replace": 0, "q_lora_rank": None}
    got = ModelConfig.from_hf_dict(d, strict=True)
    assert got.first_k_dense_replace == 0 and got.q_lora_rank is None and got.index_n_heads == hf.index_n_heads


# ---- the MTP convention -----------------------------------------------------------------------------------------
def test_an_imported_checkpoint_feeds_mtp_the_post_norm_state(cfg_factory, tmp_path):
    """GLM-5 / DeepSeek-V3 (and Megatron, vLLM, SGLang) feed the first MTP layer the main model's output after the
    final norm. A checkpoint without temper's config block is someone else's: it reads as post-norm; temper's own
    checkpoints keep the convention they name, and a temper block without the key is temper's older pre-norm."""
    base = cfg_factory().to_hf_dict()
    foreign = {k: v for k, v in base.items() if k != "temper"}
    assert ModelConfig.from_hf_dict(foreign, strict=True).mtp_input == "post_norm"
    assert ModelConfig.from_hf_dict(base, strict=True).mtp_input == "pre_norm"  # temper's, written by temper
    older = {**base, "temper": {k: v for k, v in base["temper"].items() if k != "mtp_input"}}
    assert ModelConfig.from_hf_dict(older, strict=True).mtp_input == "pre_norm"

    torch.manual_seed(0)
    ours = Transformer(cfg_factory()).eval()
    with torch.no_grad():
        ours.norm.weight.uniform_(0.5, 1.5)  # a final norm that is not all ones
    save_checkpoint(ours, tmp_path / "ck")
    (tmp_path / "ck" / "config.json").write_text(json.dumps(foreign))  # as the hub's config.json reads
    back = load_checkpoint(tmp_path / "ck")
    assert back.config.mtp_input == "post_norm"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = ours.run(ids).hidden[:, :-1]
        got = back.mtp(h, ids[:, 1:], 0)[0]
        # by hand: the MTP layer's own steps on the normed state, then the shared head
        layer = ours.mtp_layers[0]
        x = layer.eh_proj(torch.cat([layer.enorm(ours.embed_tokens(ids[:, 1:])), layer.hnorm(ours.norm(h))], -1))
        ctx = ours._context(2, 15, x.device, x.dtype, None, None, None, mtp=True)[0]
        want = ours.lm_head(layer.shared_head_norm(layer.block(x, ctx, None)[0]))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert (got - ours.mtp(h, ids[:, 1:], 0)[0]).abs().max() > 1e-3  # the pre-norm reading differs


# ---- the MTP layer's own embedding and head ---------------------------------------------------------------------
def _with_mtp_copies(model, path, perturb: str | None = None, tied: bool = False):
    """`model` saved, then its MTP layer given its own embed_tokens / shared_head.head as DeepSeek-V3 / GLM-5 save
    them (temper.json removed: a checkpoint from the hub carries no checksums of temper's)."""
    save_checkpoint(model, path)
    t = load_file(path / "model.safetensors")
    L = model.config.num_hidden_layers
    t[f"model.layers.{L}.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    t[f"model.layers.{L}.shared_head.head.weight"] = t["model.embed_tokens.weight" if tied else "lm_head.weight"].clone()
    if perturb:
        t[f"model.layers.{L}.{perturb}"][3, 5] += 0.01
    save_file(t, path / "model.safetensors")
    (path / "temper.json").unlink()
    return path


@pytest.mark.parametrize("tied", [False, True])
def test_mtp_copies_of_the_embedding_and_head_load_only_when_they_are_the_shared_ones(cfg_factory, tmp_path, tied):
    torch.manual_seed(0)
    m = Transformer(cfg_factory(tie_word_embeddings=tied)).eval()
    back = load_checkpoint(_with_mtp_copies(m, tmp_path / "same", tied=tied))  # equal copies: loaded by sharing
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        h = m.run(ids).hidden[:, :-1]
        torch.testing.assert_close(back.mtp(h, ids[:, 1:], 0)[0], m.mtp(h, ids[:, 1:], 0)[0], rtol=0, atol=0)
    L = m.config.num_hidden_layers
    for rest, main in (("embed_tokens.weight", "model.embed_tokens.weight"),
                       ("shared_head.head.weight", "model.embed_tokens.weight" if tied else "lm_head.weight")):
        path = _with_mtp_copies(m, tmp_path / rest, perturb=rest, tied=tied)
        with pytest.raises(ValueError, match=rf"^model\.layers\.{L}\.{rest}: MTP layer 0's own copy differs from "
                                             rf"{main} \(max \|diff\| 0\.01\).*refused"):
            load_checkpoint(path)
    # the name mapping alone: a copy of another shape is refused too, naming it
    hf = dict(to_hf_state(m))
    hf[f"model.layers.{L}.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"embed_tokens.weight: MTP layer 0's own copy differs .*shape \(3, 3\)"):
        from_hf_state(m.config, hf)


# ---- YaRN ---------------------------------------------------------------------------------------------------------
YARN = {
    "attention_factor": {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.5},
    "attention_factor_with_mscale": {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 0.75,
                                     "mscale": 1.0, "mscale_all_dim": 1.0},
    "mscale_ratio": {"factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707, "mscale_all_dim": 1.0},
    "mscale_alone": {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707},
    # mscale absent: transformers infers the scale from the factor alone (not the mscale / mscale_all_dim ratio)
    "mscale_all_dim_alone": {"factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dim": 1.0},
    # a correction range of fractional dimensions (1.31 to 2.81 of 8): rounding it out changes the ramp
    "untruncated": {"factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False},
    "untruncated_betas": {"factor": 8.0, "original_max_position_embeddings": 2048, "truncate": False, "beta_fast": 16.0,
                          "beta_slow": 2.0},
}


@pytest.mark.parametrize("case", list(YARN))
def test_yarn_matches_transformers_rope_init(cfg_factory, case):
    """temper's inverse frequencies, cos/sin scale and softmax scale against transformers' own YaRN initialiser on
    the same config.json (attention_factor used as given; truncate honoured)."""
    d = {**cfg_factory(max_position_embeddings=256).to_hf_dict(),
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, **YARN[case]}}
    hf = GlmMoeDsaConfig(**d)
    want_inv, want_att = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_hf_dict(d, strict=True)
    inv, att = rope_inv_freq(cfg)
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=0)
    assert att == pytest.approx(want_att, rel=1e-12)
    assert cfg.softmax_scale() == pytest.approx(yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim**-0.5))
    if "attention_factor" in YARN[case]:
        assert att == YARN[case]["attention_factor"]
    back = ModelConfig.from_hf_dict(cfg.to_hf_dict(), strict=True)  # and it round-trips
    assert back == cfg and rope_inv_freq(back)[1] == att


def test_unknown_rotary_keys_are_reported_and_refused_under_strict(cfg_factory, caplog):
    base = cfg_factory().to_hf_dict()
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    d = {**base, "rope_parameters": {**rope, "low_freq_factor": 1.0, "partial_rotary_factor": 0.5}}
    assert ModelConfig.hf_unknown_keys(d) == ["rope_parameters.low_freq_factor", "rope_parameters.partial_rotary_factor"]
    with pytest.raises(ValueError, match="rope_parameters.low_freq_factor, rope_parameters.partial_rotary_factor"):
        ModelConfig.from_hf_dict(d, strict=True)
    with caplog.at_level(logging.WARNING, logger="model.config"):
        assert ModelConfig.from_hf_dict(d).rope_scaling.factor == 4.0
    assert any("rope_parameters.low_freq_factor" in r.getMessage() for r in caplog.records)
    # a key of YaRN's is unknown under the default rope type, and the legacy `rope_scaling` is checked the same way
    assert ModelConfig.hf_unknown_keys({**base, "rope_parameters": {"rope_type": "default", "factor": 2.0}}) == \
        ["rope_parameters.factor"]
    assert ModelConfig.hf_unknown_keys({**base, "rope_scaling": {"type": "yarn", "factor": 4.0, "beta": 1}}) == \
        ["rope_scaling.beta"]
    assert ModelConfig.hf_unknown_keys({**base, "rope_parameters": {**rope, "partial_rotary_factor": 1.0}}) == []
    # a rope type temper does not implement is an error whatever `strict` says: ignoring it changes the model
    with pytest.raises(ValueError, match=r"^rope_parameters.rope_type: 'linear' is not supported"):
        ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


# ---- deepseek_v32 + IndexShare ------------------------------------------------------------------------------------
def _v32(cfg_factory, types):
    torch.manual_seed(3)
    return Transformer(cfg_factory(model_type="deepseek_v32", indexer_types=types, n_routed_experts=16, n_group=4,
                                   topk_group=2, num_experts_per_tok=4, initializer_range=0.08)).eval()


def test_a_deepseek_v32_indexshare_save_warns_that_transformers_would_misread_it(cfg_factory, tmp_path):
    shared = _v32(cfg_factory, ["full", "shared", "full", "shared"])
    with pytest.warns(UserWarning, match=r"DeepseekV32ForCausalLM ignores IndexShare: .*shared layers \[1, 3\]"):
        save_checkpoint(shared, tmp_path / "shared")
    # the warning is true: transformers builds the missing indexers at random and its logits differ from temper's
    hf = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "shared").eval()
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    assert ids.shape[1] > shared.config.index_topk  # the selection matters
    with torch.no_grad():
        assert (hf(ids).logits - shared(ids)).abs().max() > 1e-2
        assert torch.equal(load_checkpoint(tmp_path / "shared")(ids), shared(ids))  # temper reads what it wrote
    # no sharing, or GLM-5's model type (transformers implements its IndexShare): no warning
    for model in (_v32(cfg_factory, ["full"] * 4), Transformer(cfg_factory())):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            save_checkpoint(model, tmp_path / "quiet")
