"""`model.indexer_fp8`: the presets that run the indexer in FP8 e4m3, the key's round trip through a checkpoint's
config, and the model selecting with the FP8 twin (on a CPU: quantise, dequantise, score) on every path."""

from __future__ import annotations

import pytest
import torch

import configs
import model.attention as attn
from model import ModelConfig, Transformer
from temper_kernels.indexer import indexer_topk_reference


def test_glm5_and_deepseek_v32_select_in_fp8_and_the_cpu_presets_do_not():
    assert {p: configs.load(p).model.indexer_fp8 for p in ("glm5", "deepseek_v32", "tiny", "micro")} == {
        "glm5": True, "deepseek_v32": True, "tiny": False, "micro": False}


def test_the_key_survives_a_checkpoint_config():
    cfg = configs.load("glm5").model
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict(), strict=True).indexer_fp8 is True
    off = cfg.model_copy(update={"indexer_fp8": False})
    assert ModelConfig.from_hf_dict(off.to_hf_dict(), strict=True).indexer_fp8 is False


@pytest.mark.parametrize("fp8", [False, True])
def test_the_model_selects_with_the_indexer_twin_of_its_mode_with_and_without_statistics(cfg_factory, monkeypatch, fp8):
    torch.manual_seed(0)
    m = Transformer(cfg_factory(index_topk=8, indexer_fp8=fp8, initializer_range=0.1)).eval()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(4))
    calls = []
    real = attn.kernels.indexer_topk

    def spy(q, w, k, qpos, topk, **kw):
        sel = real(q, w, k, qpos, topk, **kw)
        calls.append((q, w, k, qpos, topk, kw, sel))
        return sel

    monkeypatch.setattr(attn.kernels, "indexer_topk", spy)
    with torch.no_grad():
        m.run(ids)
    assert len(calls) == 2  # one indexer per group of two layers
    plain = []
    for q, w, k, qpos, topk, kw, sel in calls:
        assert kw["fp8"] is fp8
        assert torch.equal(sel, indexer_topk_reference(q, w, k, qpos, topk, fp8=fp8))
        plain.append(sel)
    calls.clear()
    out = m.run(ids, collect_indexer=True)  # the statistics path selects the same keys
    assert [torch.equal(st["sel"], s) for st, s in zip(out.indexer_stats, plain, strict=True)] == [True, True]
    if fp8:  # the mode matters: somewhere the fp32 selection differs
        assert any(not torch.equal(s, indexer_topk_reference(q, w, k, qpos, topk)) for q, w, k, qpos, topk, _, s in
                   calls)
