"""The model's GPU-facing paths, checked on the CPU: the whole model on the Triton kernels (under TRITON_INTERPRET=1)
against the torch path, fp32 islands through a bf16 cast, no re-expansion of the cache in chunked prefill,
non-contiguous decode slots, and `impl` validation."""

from __future__ import annotations

import contextlib

import pytest
import torch

import temper_kernels as kernels
from model import KVCache, ModelConfig, Transformer
from model.layers import Rotary


def _model(cfg_factory, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = cfg_factory(kv_lora_rank=32, qk_rope_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=8, **kw)
    return Transformer(cfg).eval()


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed on this platform")
def test_model_on_triton_kernels_matches_the_torch_path(cfg_factory, monkeypatch):
    """Forward and backward of a DSA model (T=20 > top-k 8: the sparse kernel, the indexer kernel, grouped GEMM,
    fused RMSNorm) against the same weights on the references."""
    model = _model(cfg_factory).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))

    def run(mode):
        monkeypatch.setenv("TEMPER_KERNELS", mode)
        model.zero_grad()
        out = model.run(ids)
        out.logits.float().logsumexp(-1).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), grads, out.indexer_calls

    ref_logits, ref_grads, calls = run("reference")
    tri_logits, tri_grads, _ = run("triton")
    assert calls == [0, 2]  # the indexers ran: the sparse paths were exercised
    torch.testing.assert_close(tri_logits, ref_logits, atol=2e-5, rtol=1e-4)
    assert ref_grads.keys() == tri_grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(tri_grads[n], ref_grads[n], atol=1e-5, rtol=1e-3, msg=n)


@pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed on this platform")
def test_the_sparse_attention_recomputes_its_absorbed_query_in_the_backward(cfg_factory, monkeypatch):
    """The sparse MLA's absorbed query is not kept for the backward but made again there, once per sparse layer, and
    the gradients are those of keeping it, bit for bit (the same ops on the same inputs)."""
    import model.attention as attn

    model = _model(cfg_factory).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))  # > top-k 8
    monkeypatch.setenv("TEMPER_KERNELS", "triton")
    made = []
    real = attn._absorbed_query

    def counted(*a):
        made.append(torch.is_grad_enabled())
        return real(*a)

    monkeypatch.setattr(attn, "_absorbed_query", counted)

    def grads():
        model.zero_grad()
        made.clear()
        model.run(ids).logits.float().logsumexp(-1).mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, list(made)

    recomputed, made_now = grads()
    sparse = made_now.count(True)  # the forwards' absorbed queries (the sparse layers)
    assert sparse >= 1 and made_now.count(False) == sparse  # made once more each, in the backward
    monkeypatch.setattr(kernels, "recomputed", lambda t, fn: contextlib.nullcontext())
    kept, made_kept = grads()
    assert made_kept == [True] * sparse
    assert kept.keys() == recomputed.keys() and all(torch.equal(kept[n], recomputed[n]) for n in kept)


def test_bf16_cast_keeps_router_rotary_and_indexer_weights_in_fp32(cfg_factory):
    model = _model(cfg_factory).to(torch.bfloat16)
    moe = model.moe_layers()[0]
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.e_score_correction_bias.dtype == torch.float32
    assert model.rotary.inv_freq.dtype == torch.float32
    assert model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert model.layers[0].self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    logits = model(torch.randint(0, 300, (1, 12)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_rotary_angle_stays_exact_at_long_positions_in_bf16():
    cfg = ModelConfig(vocab_size=16, hidden_size=32, num_hidden_layers=1, intermediate_size=32, num_attention_heads=2,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, n_routed_experts=2,
                      num_experts_per_tok=1, moe_intermediate_size=16, index_head_dim=64)
    rot = Rotary(cfg).to(torch.bfloat16)
    pos = torch.tensor([32767])
    cos, _ = rot(pos, torch.float32)
    want = torch.cos(pos.double()[:, None] * (1.0 / cfg.rope_theta ** (torch.arange(0, 64, 2).double() / 64)))
    assert (cos.double() - want).abs().max() < 1e-2  # an inv_freq rounded to bf16 is off by radians here


def test_chunked_prefill_expands_no_cached_row(cfg_factory):
    """With a DSA selection a prefill chunk reads the selected latent rows in place: kv_b_proj (the expansion)
    is never applied to the cached context, and the logits match one full forward."""
    model = _model(cfg_factory)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    full = model(ids)
    expanded_rows = []
    hooks = [layer.self_attn.kv_b_proj.register_forward_hook(lambda m, a, o: expanded_rows.append(a[0].shape[-2]))
             for layer in model.layers]
    cache = KVCache(model.config, n_slots=1, max_len=64)
    outs = [model(ids[:, i : i + 10], cache=cache) for i in range(0, 40, 10)]
    for h in hooks:
        h.remove()
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-4, rtol=1e-4)
    # chunk 0 (10 keys ≤ ... > top-k 8 → sparse) and later chunks: no expansion of 20/30/40 cached rows
    assert max(expanded_rows, default=0) <= 10, expanded_rows


def test_decode_on_non_contiguous_slots_matches_contiguous(cfg_factory):
    model = _model(cfg_factory)
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 300, (2, 30), generator=g)
    nxt = torch.randint(0, 300, (2, 1), generator=g)
    outs = []
    for slots in ([0, 1], [3, 1]):
        cache = KVCache(model.config, n_slots=4, max_len=40)
        s = torch.tensor(slots)
        model(prompts, cache=cache, slots=s)
        outs.append(model(nxt, cache=cache, slots=s))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_padding_writes_land_in_the_scratch_column(cfg_factory):
    model = _model(cfg_factory)
    cache = KVCache(model.config, n_slots=2, max_len=16)
    model(torch.randint(0, 300, (2, 6)), cache=cache, n_new=torch.tensor([6, 2]))
    assert cache.lengths.tolist() == [6, 2]
    assert cache.kv[0][1, 2:16].abs().max() == 0  # slot 1's padded tokens wrote nothing inside the slot
    assert cache.kv[0][1, 16].abs().max() > 0  # ... they went to the scratch column


def test_unknown_impl_is_refused(cfg_factory):
    model = _model(cfg_factory)
    with pytest.raises(ValueError, match="impl: 'absorbd' is not one of auto, expanded, absorbed"):
        model(torch.zeros(1, 3, dtype=torch.long), impl="absorbd")
