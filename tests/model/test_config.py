import pytest
import torch

import configs
from model import ModelConfig, Transformer
from model.config import shared_indexer_pattern


def test_presets_load_and_validate():
    assert {"tiny", "micro", "glm5", "deepseek_v32"} <= set(configs.preset_names())
    for name in configs.preset_names():
        cfg = configs.load(name)
        assert cfg.model.num_hidden_layers > 0


def test_tiny_is_a_few_million_parameters():
    m = Transformer(configs.load("tiny").model)
    assert 1e6 < m.num_parameters() < 1e7


@pytest.mark.parametrize(
    "preset,total,active",
    [("glm5", 744e9, 40e9), ("deepseek_v32", 671e9, 37e9)],
)
def test_real_shapes_on_meta_device(preset, total, active):
    with torch.device("meta"):
        m = Transformer(configs.load(preset).model)
    assert abs(m.num_parameters(mtp=False) / total - 1) < 0.02
    assert abs(m.num_parameters(active=True, mtp=False) / active - 1) < 0.02


@pytest.mark.parametrize(
    "override,field",
    [
        ("model.n_group=3", "n_group"),
        ("model.topk_group=4", "topk_group"),
        ("model.qk_rope_head_dim=7", "qk_rope_head_dim"),
        ("model.hidden_size=-1", "model.hidden_size"),
        ("model.no_such_knob=1", "model.no_such_knob"),
        ("train.lr=0", "train.lr"),
        ("model.indexer_types=[shared, full, full, full]", "indexer_types"),
        ("model.indexer_types=[full]", "indexer_types"),
        ("model.scoring_func=tanh", "model.scoring_func"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(configs.ConfigError) as e:
        configs.load("tiny", [override])
    assert field in str(e.value)


def test_unknown_preset_and_malformed_override():
    with pytest.raises(configs.ConfigError, match="not found"):
        configs.load("nope")
    with pytest.raises(configs.ConfigError, match="key.path=value"):
        configs.load("tiny", ["model.hidden_size"])


def test_overrides_apply():
    cfg = configs.load("tiny", {"model.hidden_size": 64, "train.lr": 1e-4})
    assert cfg.model.hidden_size == 64 and cfg.train.lr == 1e-4


def test_indexshare_pattern_matches_megatron_rule():
    # Megatron: 1-based layer n is shared iff max(n - max(offset, 1), 0) % freq != 0
    for freq in (1, 2, 4):
        for offset in (1, 2, 3):
            got = shared_indexer_pattern(12, freq, offset)
            want = ["shared" if max(n - max(offset, 1), 0) % freq else "full" for n in range(1, 13)]
            assert got == want
    assert shared_indexer_pattern(8, 4, 1) == ["full", "shared", "shared", "shared"] * 2


def test_hf_dict_round_trip(cfg_factory):
    from model import YarnConfig

    cfg = cfg_factory(rope_scaling=YarnConfig(factor=4.0, original_max_position_embeddings=64, mscale_all_dim=1.0))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    v32 = cfg_factory(model_type="deepseek_v32", indexer_types=None, n_group=4, topk_group=2)
    back = ModelConfig.from_hf_dict(v32.to_hf_dict())
    assert back == v32 and not back.rope_interleave_indexer
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "model_type": "llama"})
