"""Numerical parity with transformers' reference classes, in both directions, fp32."""

import pytest
import torch
import transformers  # dev dependency (>= 5.2): the reference implementation
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
)

from model import Transformer, load_checkpoint, save_checkpoint

transformers.logging.set_verbosity_error()

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
    q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, index_topk=8, index_head_dim=16,
    index_n_heads=16, first_k_dense_replace=1, routed_scaling_factor=2.5, initializer_range=0.08,
    max_position_embeddings=256,
)


def _randomise_bias(hf_model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, generator=g) * 0.2)


def _hf_glm(**kw):
    cfg = GlmMoeDsaConfig(**{**COMMON, **kw})
    torch.manual_seed(0)
    return GlmMoeDsaForCausalLM(cfg).eval()


def _hf_v32(**kw):
    cfg = DeepseekV32Config(**{**COMMON, **kw})
    torch.manual_seed(0)
    return DeepseekV32ForCausalLM(cfg).eval()


CASES = {
    "glm_indexshare": lambda: _hf_glm(indexer_types=["full", "shared", "full", "shared"]),
    "glm_fsss": lambda: _hf_glm(indexer_types=["full", "shared", "shared", "shared"]),
    "glm_yarn": lambda: _hf_glm(
        indexer_types=["full", "shared", "shared", "full"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    # YaRN with its cos/sin scale given (`attention_factor`, HF semantics): transformers uses it as is
    "glm_yarn_attention_factor": lambda: _hf_glm(
        indexer_types=["full", "shared", "full", "shared"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 0.5,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    "v32_group_limited": lambda: _hf_v32(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_checkpoint_loads_with_equal_logits(case, tmp_path):
    hf = CASES[case]()
    _randomise_bias(hf)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path)
    assert ours.config.model_type == hf.config.model_type
    assert (ours.config.rope_scaling is not None) == case.startswith("glm_yarn")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(2))
    assert ids.shape[1] > COMMON["index_topk"]
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_our_checkpoint_loads_in_transformers(model_type, tmp_path, cfg_factory):
    kw = dict(model_type=model_type, initializer_range=0.08)
    if model_type == "deepseek_v32":
        kw.update(indexer_types=None, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    torch.manual_seed(3)
    ours = Transformer(cfg_factory(**kw)).eval()
    with torch.no_grad():
        for m in ours.moe_layers():
            m.gate.e_score_correction_bias.uniform_(0, 0.2)
    save_checkpoint(ours, tmp_path)
    cls = GlmMoeDsaForCausalLM if model_type == "glm_moe_dsa" else DeepseekV32ForCausalLM
    hf = cls.from_pretrained(tmp_path).eval()  # the MTP layer is ignored by transformers
    ids = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)
