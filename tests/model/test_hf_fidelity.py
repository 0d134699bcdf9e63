"""HF config.json fidelity: IndexShare keys (index_topk_freq / index_skip_topk_offset / index_topk_pattern), unknown keys.

Expected layouts are written out by hand from Megatron's rule: 1-based layer L runs its own indexer iff
max(L - max(offset, 1), 0) % freq == 0 (transformers' GlmMoeDsaConfig and SGLang: 0-based i, max(i - offset + 1, 0)).
"""

import json
import logging

import pytest
from transformers import DeepseekV32Config, GlmMoeDsaConfig

import configs
from model import ModelConfig

F, S = "full", "shared"
MODEL_TYPES = ["glm_moe_dsa", "deepseek_v32"]


def _periodic(cfg_factory, model_type, freq, offset, n=8):
    return cfg_factory(model_type=model_type, num_hidden_layers=n, indexer_types=None, index_share_freq=freq,
                       index_share_offset=offset)


def _hf(cfg_factory, model_type="glm_moe_dsa", n=10, **keys):
    """An HF dict with no IndexShare keys but `keys` (as a checkpoint written by another tool would be)."""
    d = cfg_factory(model_type=model_type, num_hidden_layers=n, indexer_types=None).to_hf_dict()
    for k in ("indexer_types", "index_topk_freq", "index_skip_topk_offset", "index_topk_pattern", "temper"):
        d.pop(k, None)
    return {**d, **keys}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("freq", [2, 3])
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_periodic_indexshare_round_trips(cfg_factory, model_type, freq, offset):
    cfg = _periodic(cfg_factory, model_type, freq, offset)
    types = cfg.layer_indexer_types()
    assert types[0] == F and S in types
    d = cfg.to_hf_dict()
    assert (d["index_topk_freq"], d["index_skip_topk_offset"]) == (freq, max(offset, 1))
    assert ModelConfig.hf_unknown_keys(d) == []
    back = ModelConfig.from_hf_dict(json.loads(json.dumps(d)), strict=True)
    assert back.layer_indexer_types() == types
    assert (back.indexer_types, back.index_share_freq, back.index_share_offset) == (None, freq, max(offset, 1))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_explicit_indexshare_round_trips_as_pattern(cfg_factory, model_type):
    cfg = cfg_factory(model_type=model_type, num_hidden_layers=6, indexer_types=[F, S, S, F, F, S])
    d = cfg.to_hf_dict()
    assert d["index_topk_pattern"] == "FSSFFS" and "index_topk_freq" not in d
    back = ModelConfig.from_hf_dict(d, strict=True)
    assert back == cfg and back.layer_indexer_types() == [F, S, S, F, F, S]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_no_sharing_writes_no_indexshare_keys(cfg_factory, model_type):
    d = cfg_factory(model_type=model_type, indexer_types=None).to_hf_dict()
    assert not {"index_topk_freq", "index_skip_topk_offset", "index_topk_pattern"} & set(d)
    assert ModelConfig.from_hf_dict(d).layer_indexer_types() == [F] * 4


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_hand_written_freq_offset(cfg_factory, model_type):
    # GLM-5.2 / 5.3 schedule (freq 4, offset 3): layers 1, 2, 3, 7 (1-based) run the indexer
    cfg = ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, index_topk_freq=4, index_skip_topk_offset=3), strict=True)
    assert cfg.layer_indexer_types() == [F, F, F, S, S, S, F, S, S, S]
    assert (cfg.index_share_freq, cfg.index_share_offset) == (4, 3)
    cfg = ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, n=6, index_topk_freq=2, index_skip_topk_offset=2))
    assert cfg.layer_indexer_types() == [F, F, S, F, S, F]
    cfg = ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, n=7, index_topk_freq=3, index_skip_topk_offset=1))
    assert cfg.layer_indexer_types() == [F, S, S, F, S, S, F]
    # offset absent: HF's default (transformers, SGLang) is 2
    cfg = ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, n=6, index_topk_freq=2))
    assert cfg.layer_indexer_types() == [F, F, S, F, S, F]
    # null pattern (as GLM-5.2's config.json has) defers to freq/offset
    d = _hf(cfg_factory, model_type, n=6, index_topk_freq=2, index_skip_topk_offset=1, index_topk_pattern=None)
    assert ModelConfig.from_hf_dict(d).layer_indexer_types() == [F, S, F, S, F, S]


def test_glm52_style_config_with_all_three_keys(cfg_factory):
    types = [F, F, F, S, S, S, F, S, S, S]
    d = _hf(cfg_factory, index_topk_freq=4, index_skip_topk_offset=3, index_topk_pattern=None, indexer_types=types)
    cfg = ModelConfig.from_hf_dict(d, strict=True)
    assert cfg.layer_indexer_types() == types and cfg.indexer_types is None


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pattern_key(cfg_factory, model_type):
    cfg = ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, n=6, index_topk_pattern="FSSFSF"), strict=True)
    assert cfg.indexer_types == [F, S, S, F, S, F]
    cfg = ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, n=4, index_topk_pattern=["F", "S", "F", "F"]))
    assert cfg.layer_indexer_types() == [F, S, F, F]
    for bad in ("FSXF", "FSF", 7):
        with pytest.raises(ValueError, match="index_topk_pattern"):
            ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, n=4, index_topk_pattern=bad))
    with pytest.raises(ValueError, match="indexer_types"):  # layer 0 has no leader
        ModelConfig.from_hf_dict(_hf(cfg_factory, model_type, n=4, index_topk_pattern="SFFF"))


def test_disagreeing_layouts_name_the_keys(cfg_factory):
    with pytest.raises(ValueError, match="index_topk_freq.*index_topk_pattern|index_topk_pattern.*index_topk_freq"):
        ModelConfig.from_hf_dict(_hf(cfg_factory, n=4, index_topk_pattern="FFFF", index_topk_freq=2,
                                     index_skip_topk_offset=1))
    with pytest.raises(ValueError, match="indexer_types.*index_topk_freq|index_topk_freq.*indexer_types"):
        ModelConfig.from_hf_dict(_hf(cfg_factory, n=4, indexer_types=[F, S, S, S], index_topk_freq=2))
    with pytest.raises(ValueError, match="index_topk_pattern.*indexer_types"):
        ModelConfig.from_hf_dict(_hf(cfg_factory, n=4, indexer_types=[F, S, F, S], index_topk_pattern="FSSS"))


def test_offset_zero_is_clamped_like_megatron(cfg_factory):
    # Megatron: max(offset, 1), so offset 0 is offset 1 and layer 1 (1-based) always runs its indexer
    cfg = _periodic(cfg_factory, "glm_moe_dsa", 3, 0, n=7)
    assert cfg.layer_indexer_types() == [F, S, S, F, S, S, F]
    assert cfg.layer_indexer_types() == _periodic(cfg_factory, "glm_moe_dsa", 3, 1, n=7).layer_indexer_types()
    hf = ModelConfig.from_hf_dict(_hf(cfg_factory, n=7, index_topk_freq=3, index_skip_topk_offset=0), strict=True)
    assert hf.layer_indexer_types() == [F, S, S, F, S, S, F]
    assert cfg.to_hf_dict()["index_skip_topk_offset"] == 1  # what transformers / SGLang read the same way
    with pytest.raises(ValueError, match="index_skip_topk_offset"):
        ModelConfig.from_hf_dict(_hf(cfg_factory, n=4, index_topk_freq=2, index_skip_topk_offset=-1))
    with pytest.raises(ValueError, match="index_topk_freq"):
        ModelConfig.from_hf_dict(_hf(cfg_factory, n=4, index_topk_freq=0))


def test_unknown_keys_are_reported(cfg_factory, caplog):
    d = {**cfg_factory().to_hf_dict(), "sliding_window": 128, "rope_interleave": False, "mlp_bias": False}
    d["temper"] = {**d["temper"], "future_knob": 1}
    assert ModelConfig.hf_unknown_keys(d) == ["rope_interleave", "sliding_window", "temper.future_knob"]
    with caplog.at_level(logging.WARNING, logger="model.config"):
        cfg = ModelConfig.from_hf_dict(d)
    assert cfg == cfg_factory()
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and all(k in msgs[0] for k in ("sliding_window", "rope_interleave", "temper.future_knob"))
    with pytest.raises(ValueError, match="sliding_window") as e:
        ModelConfig.from_hf_dict(d, strict=True)
    assert "temper.future_knob" in str(e.value) and "mlp_bias" not in str(e.value)


@pytest.mark.parametrize("preset", ["tiny", "glm5", "deepseek_v32"])
def test_own_config_has_no_unknown_keys(preset, caplog):
    cfg = configs.load(preset).model
    d = cfg.to_hf_dict()
    assert ModelConfig.hf_unknown_keys(d) == []
    with caplog.at_level(logging.WARNING, logger="model.config"):
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(d)), strict=True) == cfg
    assert not caplog.records


@pytest.mark.parametrize("freq,offset", [(2, 0), (3, 1), (4, 3)])
@pytest.mark.parametrize("explicit", [False, True])
def test_transformers_reads_the_same_layout(cfg_factory, tmp_path, freq, offset, explicit):
    cfg = _periodic(cfg_factory, "glm_moe_dsa", freq, offset, n=10)
    if explicit:
        cfg = cfg.model_copy(update={"indexer_types": cfg.layer_indexer_types()})
    hf = GlmMoeDsaConfig(**cfg.to_hf_dict())
    assert hf.indexer_types == cfg.layer_indexer_types()
    # ... and without our `indexer_types` list, from index_topk_freq / index_skip_topk_offset / index_topk_pattern alone
    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "indexer_types"}
    assert GlmMoeDsaConfig(**d).indexer_types == cfg.layer_indexer_types()
    hf.save_pretrained(tmp_path)  # what transformers writes back reads strictly and gives the same layout
    back = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()), strict=True)
    assert back.layer_indexer_types() == cfg.layer_indexer_types()


@pytest.mark.parametrize("explicit", [False, True])
def test_deepseek_v32_config_keeps_indexshare_through_transformers(cfg_factory, tmp_path, explicit):
    cfg = _periodic(cfg_factory, "deepseek_v32", 3, 2, n=8)
    if explicit:
        cfg = cfg.model_copy(update={"indexer_types": [F, S, F, F, S, S, F, S]})
    # DeepseekV32Config has no per-layer indexer layout of its own; it must keep the keys SGLang reads
    DeepseekV32Config(**cfg.to_hf_dict()).save_pretrained(tmp_path)
    back = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()), strict=True)
    assert back.model_type == "deepseek_v32"
    assert back.layer_indexer_types() == cfg.layer_indexer_types()
