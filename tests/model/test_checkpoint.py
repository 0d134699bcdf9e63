"""HF-layout checkpoints: sharding, dtypes, FP8 dequantisation, MTP, atomicity, clear errors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import Transformer, load_checkpoint, read_checkpoint_meta, save_checkpoint
from model.checkpoint import dequantize_fp8, quantize_fp8


def _model(cfg_factory, **kw):
    torch.manual_seed(0)
    return Transformer(cfg_factory(**kw)).eval()


def _keys(path):
    out = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            out |= set(h.keys())
    return out


def test_round_trip_with_mtp_and_hf_names(cfg_factory, tmp_path):
    m = _model(cfg_factory)
    save_checkpoint(m, tmp_path / "ck", policy_version=7)
    keys = _keys(tmp_path / "ck")
    L = m.config.num_hidden_layers
    assert f"model.layers.{L}.eh_proj.weight" in keys and f"model.layers.{L}.shared_head.norm.weight" in keys
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.1.self_attn.indexer.wq_b.weight" not in keys  # shared layer: no indexer
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["model_type"] == "glm_moe_dsa"
    back = load_checkpoint(tmp_path / "ck")
    for (n, a), (n2, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert n == n2 and torch.equal(a, b), n
    meta = read_checkpoint_meta(tmp_path / "ck")
    assert meta["policy_version"] == 7 and meta["checksum"].startswith("sha256:")


def test_sharded_checkpoint_with_index(cfg_factory, tmp_path):
    m = _model(cfg_factory)
    save_checkpoint(m, tmp_path / "ck", max_shard_bytes=200_000)
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 3 and all((tmp_path / "ck" / f).exists() for f in files)
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path / "ck")(ids), m(ids), atol=0, rtol=0)


def test_bf16_checkpoint_keeps_router_in_fp32(cfg_factory, tmp_path):
    m = _model(cfg_factory)
    save_checkpoint(m, tmp_path / "ck", dtype=torch.bfloat16)
    with safe_open(tmp_path / "ck" / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.self_attn.q_b_proj.weight").get_dtype() == "BF16"
    back = load_checkpoint(tmp_path / "ck")
    assert back.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert back.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert (back(ids).float() - m(ids)).abs().max() < 0.1


def test_fp8_block_scaled_weights_are_dequantised(cfg_factory, tmp_path):
    m = _model(cfg_factory, initializer_range=0.1)
    save_checkpoint(m, tmp_path / "ck")
    path = tmp_path / "ck" / "model.safetensors"
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    want = {}
    for k in list(tensors):
        if k.endswith("proj.weight") and tensors[k].dim() == 2 and "indexer" not in k:
            q, s = quantize_fp8(tensors[k], (16, 16))
            tensors[k], tensors[k + "_scale_inv"] = q, s
            want[k] = dequantize_fp8(q, s, (16, 16))
    save_file(tensors, path)
    (tmp_path / "ck" / "temper.json").unlink()  # an FP8 release from the hub: no checksums of temper's to verify
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    back = load_checkpoint(tmp_path / "ck")
    w = back.layers[0].self_attn.q_b_proj.weight
    ref = m.layers[0].self_attn.q_b_proj.weight
    torch.testing.assert_close(w, want["model.layers.0.self_attn.q_b_proj.weight"])
    assert (w - ref).abs().max() < 0.07 * ref.abs().max()  # e4m3 has a 3-bit mantissa
    # reference: the original model with exactly those weights replaced by their dequantised values
    ref_model = _model(cfg_factory, initializer_range=0.1)
    from model.checkpoint import from_hf_state

    with torch.no_grad():
        sd = ref_model.state_dict()
        sd.update(from_hf_state(ref_model.config, {**{k: v for k, v in tensors.items() if "scale_inv" not in k
                                                       and k not in want}, **want}))
        ref_model.load_state_dict(sd)
        ids = torch.randint(0, 300, (1, 12))
        torch.testing.assert_close(back(ids), ref_model(ids), atol=1e-5, rtol=0)


def test_dequantize_hand_case():
    q = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 10.0]])  # blocks of 2x2: column 2 uses the second scale
    torch.testing.assert_close(dequantize_fp8(q, s, (2, 2)), torch.tensor([[2.0, 4.0, 30.0], [8.0, 10.0, 60.0]]))


def test_mismatched_checkpoint_fails_clearly(cfg_factory, tmp_path):
    m = _model(cfg_factory)
    save_checkpoint(m, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["hidden_size"] = 96
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="embed_tokens.weight has shape"):
        load_checkpoint(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)


def test_failed_save_leaves_previous_checkpoint_intact(cfg_factory, tmp_path, monkeypatch):
    m = _model(cfg_factory)
    save_checkpoint(m, tmp_path / "ck", policy_version=1)
    import model.checkpoint as ck

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(m, tmp_path / "ck", policy_version=2)
    assert read_checkpoint_meta(tmp_path / "ck")["policy_version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left behind
    load_checkpoint(tmp_path / "ck")


def _flip(path, at=-1):
    """One bit of one byte of `path` flipped (at the end: tensor data, so the header still parses)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_naming_the_file(cfg_factory, tmp_path):
    """The checksums temper.json records at save are verified on load: one flipped bit in the tensor data (which
    safetensors itself reads without complaint) is refused, naming the file; sharded, naming the shard."""
    from model.checkpoint import ChecksumError, verify_checkpoint

    m = _model(cfg_factory)
    save_checkpoint(m, tmp_path / "ck")
    meta = read_checkpoint_meta(tmp_path / "ck")
    assert set(meta["files"]) == {"model.safetensors"} and verify_checkpoint(tmp_path / "ck")["checked"]
    _flip(tmp_path / "ck" / "model.safetensors")
    with safe_open(tmp_path / "ck" / "model.safetensors", "pt") as f:  # the corruption is silent to safetensors
        assert len(list(f.keys())) > 0
    with pytest.raises(ChecksumError, match=f"{tmp_path / 'ck' / 'model.safetensors'}: its bytes do not match"):
        load_checkpoint(tmp_path / "ck")
    # sharded: the damaged shard is the one named
    save_checkpoint(m, tmp_path / "sh", max_shard_bytes=200_000)
    shards = sorted(read_checkpoint_meta(tmp_path / "sh")["files"])
    assert len(shards) > 3
    load_checkpoint(tmp_path / "sh")
    _flip(tmp_path / "sh" / shards[2], at=-5)
    with pytest.raises(ChecksumError, match=f"{tmp_path / 'sh' / shards[2]}: its bytes"):
        load_checkpoint(tmp_path / "sh")
    # a checkpoint saved before per-file sums (only the whole checkpoint's checksum) is verified too
    save_checkpoint(m, tmp_path / "old")
    meta = read_checkpoint_meta(tmp_path / "old")
    (tmp_path / "old" / "temper.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    load_checkpoint(tmp_path / "old")
    _flip(tmp_path / "old" / "model.safetensors", at=-9)
    with pytest.raises(ChecksumError, match="model.safetensors: the weights do not match the checksum"):
        load_checkpoint(tmp_path / "old")
    # one imported from the hub (no temper.json) has nothing to verify: it loads
    (tmp_path / "old" / "temper.json").unlink()
    assert not verify_checkpoint(tmp_path / "old")["checked"]
    load_checkpoint(tmp_path / "old")
