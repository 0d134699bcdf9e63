"""The indexer's tensor-parallel selection and its KL statistics in query chunks (model/indexer_stats.py) against the
whole-matrix computation they replace: the [B, T, S] scores and [B, H, T, S] attention logits built at once."""

from __future__ import annotations

import pytest
import torch

import model.attention as attn
from model import Transformer, indexer_kl_loss, indexer_parameters
from model.attention import MLA
from model.indexer_stats import indexer_logits, select_topk
from temper_kernels import stable_topk
from temper_kernels.indexer import indexer_topk_reference, scores_reference


def _inputs(b=2, t=11, s=11, h=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g)
    w = torch.randn(b, t, h, generator=g)
    k = torch.randn(b, s, d, generator=g)
    qpos = torch.arange(s - t, s).expand(b, t).contiguous()
    return q, w, k, qpos


def _saved_numel(fn) -> int:
    """Elements of every tensor autograd keeps for the backward of what `fn` builds."""
    total = [0]

    def pack(x):
        total[0] += x.numel()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return total[0]


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("selected", [True, False])
def test_indexer_logits_in_chunks_equal_the_whole_matrix_and_keep_only_their_inputs(relu, selected):
    q, w, k, qpos = _inputs()
    sel = None
    if selected:
        whole = scores_reference(q, w, k).masked_fill(torch.arange(k.shape[1]) > qpos[..., None], float("-inf"))
        sel = stable_topk(whole, 5)
    leaves = [x.clone().requires_grad_() for x in (q, w, k)]
    want = scores_reference(*leaves, relu)
    if sel is not None:
        want = want.gather(-1, sel)
    gout = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    want_grads = torch.autograd.grad(want, leaves, gout)
    for budget in (1, 40, 1 << 20):  # one query row a chunk, a few rows, every row at once
        mine = [x.clone().requires_grad_() for x in (q, w, k)]
        got = indexer_logits(*mine, sel, relu, budget)
        torch.testing.assert_close(got, want)
        for g_got, g_want in zip(torch.autograd.grad(got, mine, gout), want_grads, strict=True):
            torch.testing.assert_close(g_got, g_want)
    # the backward keeps the inputs (q, w, k, the selection), not the [B, T·H, S] head logits autograd would
    kept = _saved_numel(lambda: indexer_logits(*(x.clone().requires_grad_() for x in (q, w, k)), sel, relu, 40))
    assert kept == q.numel() + w.numel() + k.numel() + (0 if sel is None else sel.numel())
    b, t, h, _ = q.shape
    assert _saved_numel(lambda: scores_reference(*(x.clone().requires_grad_() for x in (q, w, k)), relu)) >= (
        b * t * h * k.shape[1])


@pytest.mark.parametrize("fp8", [False, True])
def test_select_topk_over_two_ranks_heads_in_chunks_is_the_kernel_twin_s_selection(fp8):
    """Two 'ranks' each hold half of the indexer heads; `reduce` adds the other rank's partial scores of the same
    chunk (what the all-reduce does), chunk by chunk, one query row at a time."""
    q, w, k, qpos = _inputs(b=2, t=9, s=13, h=4, d=16, seed=1)
    want = indexer_topk_reference(q, w, k, qpos, 6, fp8=fp8)
    partials = []
    select_topk(q[:, :, 2:], w[:, :, 2:], k, qpos, 6, True, fp8, lambda sc: partials.append(sc) or sc, budget=1)
    assert len(partials) == q.shape[1]  # one row a chunk
    got = select_topk(q[:, :, :2], w[:, :, :2], k, qpos, 6, True, fp8, lambda sc: sc + partials.pop(0), budget=1)
    assert torch.equal(got, want) and not partials
    whole = select_topk(q, w, k, qpos, 6, True, fp8, lambda sc: sc, budget=1 << 20)
    assert torch.equal(whole, want)


# ---- the model's statistics against the whole matrices ------------------------------------------------------------
def _whole_target(layer: MLA, q_nope, q_pe, keys, ctx, sel) -> torch.Tensor:
    """The head-summed attention of one layer over every key [B, T, S], all heads and queries at once."""
    cfg = layer.cfg
    b, t, H, _ = q_nope.shape
    s = keys.shape[1]
    nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    kv = layer.kv_b_proj(keys[..., :r]).view(b, s, H, nope + cfg.v_head_dim)
    kk = torch.cat([kv[..., :nope], keys[..., None, r:].expand(b, s, H, cfg.qk_rope_head_dim)], -1)
    logits = torch.einsum("bthd,bshd->bhts", torch.cat([q_nope, q_pe], -1), kk).float() * layer.scale
    allowed = torch.arange(s) <= ctx.qpos[..., None]
    if sel is not None:
        allowed = allowed & torch.zeros_like(allowed).scatter_(-1, sel, True)
    return logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1).sum(1)


def _kl_over_keys(logits, target, sel):
    """The KL of whole-key matrices restricted to the selection by masking (what temper computed before)."""
    if sel is not None:
        keep = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, sel, True)
        logits, target = logits.masked_fill(~keep, float("-inf")), target.masked_fill(~keep, 0.0)
    p = target / target.sum(-1, keepdim=True)
    logq = logits.log_softmax(-1)
    return torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), 0.0).sum(-1).mean()


@pytest.mark.parametrize("mode", ["sparse", "sparse, heads split", "dense"])
def test_the_model_s_statistics_in_chunks_equal_the_whole_matrices(cfg_factory, monkeypatch, mode):
    """One-row chunks everywhere (CHUNK_ELEMS = 1) against [B, T, S] indexer scores and [B, H, T, S] attention
    computed at once from the same layer inputs: the selection, the logits and targets at the selected keys, the KL
    and the indexer's gradients. 'heads split' takes the tensor-parallel path (`select_topk`) on one rank."""
    torch.manual_seed(0)
    m = Transformer(cfg_factory(index_topk=8, initializer_range=0.1))
    ids = torch.randint(0, 300, (2, 21), generator=torch.Generator().manual_seed(2))
    seen: dict = {"index": [], "attn": []}
    real_logits, real_collect = attn.indexer_stats.indexer_logits, MLA._collect_attention

    def spy_logits(q, w, k, sel, relu, budget):
        seen["index"].append((q, w, k, sel, relu))
        return real_logits(q, w, k, sel, relu, budget)

    def spy_collect(self, q_nope, q_pe, keys, ctx, sel):
        seen["attn"].append(_whole_target(self, q_nope, q_pe, keys, ctx, sel))
        return real_collect(self, q_nope, q_pe, keys, ctx, sel)

    monkeypatch.setattr(attn, "CHUNK_ELEMS", 1)
    monkeypatch.setattr(attn.indexer_stats, "indexer_logits", spy_logits)
    monkeypatch.setattr(MLA, "_collect_attention", spy_collect)
    if mode == "sparse, heads split":
        monkeypatch.setattr(MLA, "_split_heads", property(lambda self: True))
    out = m.run(ids, dense=mode == "dense", collect_indexer=True, detach_indexer_input=True)
    stats = out.indexer_stats
    assert len(stats) == len(seen["index"]) == 2 and len(seen["attn"]) == 4  # two groups of two layers
    kl_want = []
    for g, (st, (q, w, k, sel, relu)) in enumerate(zip(stats, seen["index"], strict=True)):
        whole = scores_reference(q, w, k, relu).masked_fill(torch.arange(k.shape[1]) > out_qpos(ids)[..., None],
                                                            float("-inf"))
        target = seen["attn"][2 * g] + seen["attn"][2 * g + 1]
        if mode == "dense":
            assert st["sel"] is None and sel is None
            torch.testing.assert_close(st["index_logits"], whole)
            torch.testing.assert_close(st["target"], target)
        else:
            assert torch.equal(st["sel"], stable_topk(whole.detach(), 8)) and st["sel"] is sel
            torch.testing.assert_close(st["index_logits"], whole.gather(-1, sel))
            torch.testing.assert_close(st["target"], target.gather(-1, sel))
            assert st["target"].shape == sel.shape  # O(T·k): nothing over every key is kept
        kl_want.append(_kl_over_keys(whole, target, sel))
    kl, kl_ref = indexer_kl_loss(stats), torch.stack(kl_want).mean()
    torch.testing.assert_close(kl, kl_ref)
    params = indexer_parameters(m)
    got = torch.autograd.grad(kl, params, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(kl_ref, params, allow_unused=True)
    assert any(g is not None for g in want)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


def out_qpos(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)
