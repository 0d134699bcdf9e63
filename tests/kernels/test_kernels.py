"""Every Triton kernel against its torch twin, in fp32 at small shapes, under TRITON_INTERPRET=1 (tests/conftest.py
sets it on a machine without CUDA), plus the twins against independent slow computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import temper_kernels as kernels
from temper_kernels import indexer as kix
from temper_kernels import mla as kmla
from temper_kernels import moe as kmoe
from temper_kernels import norm as knorm
from temper_kernels import rotary as krope

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed on this platform")


# ---- dispatch ------------------------------------------------------------------------------------------------
def test_dispatch_picks_reference_on_cpu_and_obeys_the_override(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delenv("TEMPER_KERNELS", raising=False)
    assert kernels.backend(x) == "reference"
    monkeypatch.setenv("TEMPER_KERNELS", "reference")
    assert kernels.backend(x) == "reference"
    monkeypatch.setenv("TEMPER_KERNELS", "tritn")
    with pytest.raises(ValueError, match="TEMPER_KERNELS: 'tritn'"):
        kernels.backend(x)
    monkeypatch.setenv("TEMPER_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernels.backend(x)


# ---- indexer top-k --------------------------------------------------------------------------------------------
def _slow_topk(q, w, k, qpos, topk):
    """Independent twin: float64 scores from the formula, sorted by (score desc, position asc) per query."""
    b, t, hi, _ = q.shape
    s = k.shape[1]
    out = torch.empty(b, t, min(topk, s), dtype=torch.long)
    for bi in range(b):
        for ti in range(t):
            sc = []
            for si in range(s):
                v = sum(float(w[bi, ti, j]) * max(float(q[bi, ti, j].double() @ k[bi, si].double()), 0.0)
                        for j in range(hi))
                sc.append((-(v if si <= qpos[bi, ti] else -math.inf), si))
            out[bi, ti] = torch.tensor(sorted(p for _, p in sorted(sc)[: out.shape[-1]]))
    return out


def _grid_inputs(b, t, s, hi, d, seed=0):
    """Values on a coarse dyadic grid: every score is exact in fp32 whatever the summation order, and many tie."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (b, t, hi, d), generator=g) * 0.5
    w = torch.randint(-2, 3, (b, t, hi), generator=g) * 0.25
    k = torch.randint(-2, 3, (b, s, d), generator=g) * 0.5
    return q.float(), w.float(), k.float()


@pytest.mark.parametrize("topk,blocks", [(16, None), (12, None), (12, (32, 16, 8, 2))])  # a power of two, one that
def test_indexer_topk_selects_the_identical_set_ties_included(triton_mode, topk, blocks, monkeypatch):  # pads the
    monkeypatch.setattr(kix, "BLOCKS", blocks)  # candidate lists (k < KP), and another tiling (bench/gpu.py's sweep)
    q, w, k = _grid_inputs(1, 4, 40, 2, 16)
    w[0, 1] = 0.0  # query 1: every score is 0 → the earliest positions win
    qpos = torch.tensor([[39, 5, 20, 33]])
    got = kernels.indexer_topk(q, w, k, qpos, topk)
    want = _slow_topk(q, w, k, qpos, topk)
    assert torch.equal(got, want)
    assert torch.equal(got[0, 1], torch.arange(topk))
    assert torch.equal(kix.indexer_topk_reference(q, w, k, qpos, topk), want)


def test_stable_topk_never_picks_a_nan_and_reads_nothing_back():
    """NaN scores lose (torch.topk would rank them first; the position-based selection then returned an index past
    the end); and no op that makes CUDA wait for the host runs (seen on the CPU through a dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    s = torch.tensor([[1.0, float("nan"), 2.0, 2.0], [float("nan")] * 3 + [0.0]])
    assert kix.stable_topk(s, 2).tolist() == [[2, 3], [0, 3]]
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("nonzero", "_local_scalar_dense", "bincount", "masked_select"):
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    scores = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0)).round()  # ties
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))
    with Watch():
        kix.stable_topk(scores, 8)
        kmoe.route(logits, torch.zeros(16), 4, 4, 2, "sigmoid", True, 2.5)
    assert seen == []
    with Watch():  # the watch can fail
        torch.bincount(torch.tensor([1, 2]))
    assert seen == ["bincount"]


def test_indexer_topk_random_scores_and_fewer_keys_than_topk(triton_mode):
    g = torch.Generator().manual_seed(1)
    q, w, k = torch.randn(2, 3, 2, 16, generator=g), torch.randn(2, 3, 2, generator=g), torch.randn(2, 20, 16, generator=g)
    qpos = torch.tensor([[3, 10, 19], [19, 0, 7]])
    assert torch.equal(kernels.indexer_topk(q, w, k, qpos, 16), kix.indexer_topk_reference(q, w, k, qpos, 16))
    few = kernels.indexer_topk(q[:, :, :, :], w, k[:, :12], qpos.clamp_max(11), 16)  # S=12 < topk
    assert few.shape == (2, 3, 12) and torch.equal(few, torch.arange(12).expand(2, 3, 12))


def test_indexer_fp8_mode_matches_its_twin_and_mostly_agrees_with_fp32(triton_mode):
    g = torch.Generator().manual_seed(2)
    q, w, k = torch.randn(1, 3, 2, 16, generator=g), torch.randn(1, 3, 2, generator=g), torch.randn(1, 48, 16, generator=g)
    qpos = torch.tensor([[47, 47, 30]])
    got = kernels.indexer_topk(q, w, k, qpos, 16, fp8=True)
    assert torch.equal(got, kix.indexer_topk_reference(q, w, k, qpos, 16, fp8=True))
    full = kix.indexer_topk_reference(q, w, k, qpos, 16)
    shared = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(got[0], full[0], strict=True))
    assert shared / full[0].numel() >= 0.75  # e4m3 keeps 3 mantissa bits: near-ties may swap, most keys stay


def test_fp8_quantisation_round_trips_within_e4m3_precision():
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 30.0, 500.0, 1e4])[:, None]
    v, s = kix.quantize_fp8(x)
    assert v.dtype == torch.float8_e4m3fn and s.shape == (5,)
    rel = ((v.float() * s[:, None] - x).abs() / x.abs().amax(-1, keepdim=True)).max()
    assert rel <= 2**-4  # 3 mantissa bits: half an ulp at the row maximum is 1/16


def test_model_stable_topk_is_the_kernel_twin():
    from model.attention import stable_topk

    assert stable_topk is kix.stable_topk


# ---- sparse MLA ------------------------------------------------------------------------------------------------
def _slow_sparse_mla(q, kv, idx, qpos, scale, dv, slots):
    """Independent twin: one softmax per (row, query, head) in float64 loops."""
    b, t, h, _ = q.shape
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            keys = [int(i) for i in idx[bi, ti] if 0 <= i <= qpos[bi, ti]]
            if not keys:
                continue
            rows = kv[slots[bi], keys].double()
            for hi in range(h):
                p = torch.softmax(rows @ q[bi, ti, hi].double() * scale, 0)
                out[bi, ti, hi] = p @ rows[:, :dv]
    return out


def _mla_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t, h, dv, dr, s, kk = 2, 3, 5, 16, 16, 30, 20  # 5 heads: a partial head block
    q = torch.randn(b, t, h, dv + dr, generator=g, requires_grad=True)
    kv = torch.randn(3, s, dv + dr, generator=g, requires_grad=True)  # a pool of 3 slots
    idx = torch.stack([torch.randperm(s, generator=g)[:kk] for _ in range(b * t)]).view(b, t, kk)
    idx[0, 0, :4] = -1  # padding
    qpos = torch.tensor([[12, 25, 29], [29, 4, 17]])
    idx[1, 1] = torch.arange(10, 30)  # every selected key is in the future: no usable key → 0
    return q, kv, idx, qpos, torch.tensor([2, 0])


def test_sparse_mla_reference_matches_a_slow_twin():
    q, kv, idx, qpos, slots = _mla_inputs()
    got = kmla.sparse_mla_reference(q, kv, idx, qpos, 0.3, 16, slots)
    want = _slow_sparse_mla(q.detach(), kv.detach(), idx, qpos, 0.3, 16, slots)
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert got[1, 1].abs().max() == 0


def test_sparse_mla_reference_with_every_pick_usable_matches_the_slow_twin_forward_and_backward():
    """The CPU's fast path (every selected key usable: no masks; a contiguous pool gathered by index_select) against
    the float64 loops, values and gradients; a strided pool (advanced indexing) gives the same bits."""
    g = torch.Generator().manual_seed(3)
    b, t, h, dv, dr, s, kk = 2, 4, 3, 16, 16, 30, 8
    q = torch.randn(b, t, h, dv + dr, generator=g, requires_grad=True)
    kv = torch.randn(3, s, dv + dr, generator=g, requires_grad=True)
    qpos = torch.tensor([[20, 21, 22, 23], [9, 10, 11, 29]])
    idx = torch.stack([torch.randperm(int(p) + 1, generator=g)[:kk].sort().values for p in qpos.flatten()]).view(b, t, kk)
    slots = torch.tensor([1, 2])
    got = kmla.sparse_mla_reference(q, kv, idx, qpos, 0.3, dv, slots)
    qd, kvd = q.detach().double().requires_grad_(), kv.detach().double().requires_grad_()
    want = _slow_sparse_mla(qd, kvd, idx, qpos, 0.3, dv, slots)
    assert torch.allclose(got.double(), want, atol=1e-5)
    w = torch.randn(got.shape, generator=g)
    (got * w).sum().backward()
    (want * w.double()).sum().backward()
    assert torch.allclose(q.grad.double(), qd.grad, atol=1e-5) and torch.allclose(kv.grad.double(), kvd.grad, atol=1e-5)
    wide = torch.zeros(3, s, 2 * (dv + dr))
    wide[..., : dv + dr] = kv.detach()
    strided = wide[..., : dv + dr]
    assert not strided.is_contiguous()
    assert torch.equal(kmla.sparse_mla_reference(q.detach(), strided, idx, qpos, 0.3, dv, slots), got.detach())


@pytest.mark.parametrize("blocks", [None, (32, 16, 8)])  # the default tiles, and a sweep point of bench/gpu.py
def test_sparse_mla_kernel_forward_and_backward_match_the_twin(triton_mode, blocks, monkeypatch):
    monkeypatch.setattr(kmla, "BLOCKS", blocks)
    q, kv, idx, qpos, slots = _mla_inputs()
    got = kernels.sparse_mla(q, kv, idx, qpos, 0.3, 16, slots)
    want = kmla.sparse_mla_reference(q, kv, idx, qpos, 0.3, 16, slots)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    gout = torch.randn_like(got)
    dq, dkv = torch.autograd.grad(got, (q, kv), gout)
    rq, rkv = torch.autograd.grad(want, (q, kv), gout)
    torch.testing.assert_close(dq, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dkv, rkv, atol=1e-5, rtol=1e-5)
    assert dkv[1].abs().max() == 0  # slot 1 is in no row of the batch


# ---- MoE -------------------------------------------------------------------------------------------------------
def _moe_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    n, h, i, e, k = 37, 16, 24, 6, 2
    x = torch.randn(n, h, generator=g, requires_grad=True)
    gu = torch.randn(e, 2 * i, h, generator=g, requires_grad=True)
    dn = torch.randn(e, h, i, generator=g, requires_grad=True)
    experts = torch.tensor([0, 1, 2, 4, 5])  # expert 3 gets no token
    idx = torch.stack([experts[torch.randperm(5, generator=g)[:k]] for _ in range(n)])
    w = torch.rand(n, k, generator=g, requires_grad=True)
    return x, idx, w, gu, dn


def _slow_moe(x, idx, w, gu, dn):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g, u = (gu[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (dn[e] @ (F.silu(g) * u))
    return out


def test_moe_reference_matches_a_per_token_twin():
    x, idx, w, gu, dn = _moe_inputs()
    torch.testing.assert_close(kmoe.moe_experts_reference(x, idx, w, gu, dn), _slow_moe(x, idx, w, gu, dn),
                               atol=1e-4, rtol=1e-5)


def test_moe_grouped_gemm_forward_and_backward_match_the_twin(triton_mode):
    x, idx, w, gu, dn = _moe_inputs()
    got = kernels.moe_experts(x, idx, w, gu, dn)
    want = kmoe.moe_experts_reference(x, idx, w, gu, dn)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    gout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (x, w, gu, dn), gout), torch.autograd.grad(want, (x, w, gu, dn), gout),
                    strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-5)


def test_grouped_linear_kernel_and_twin_match_per_expert_matmuls(triton_mode, monkeypatch):
    """`grouped_linear` (Megatron's GroupedExperts calls it): rows [ends[e-1], ends[e]) times w[e]ᵀ, an empty expert
    included, forward and both gradients; the Triton kernel (interpreted) and the twin against a hand slice loop."""
    g = torch.Generator().manual_seed(3)
    xs = torch.randn(45, 24, generator=g, requires_grad=True)
    w = torch.randn(4, 40, 24, generator=g, requires_grad=True)
    counts = torch.tensor([7, 0, 33, 5])
    want = torch.cat([xs[0:7] @ w[0].T, xs[7:40] @ w[2].T, xs[40:45] @ w[3].T])
    gout = torch.randn(want.shape, generator=g)
    wgrads = torch.autograd.grad(want, (xs, w), gout)
    assert torch.count_nonzero(wgrads[1][1]) == 0  # the empty expert gets no gradient
    for mode in ("triton", "reference"):
        monkeypatch.setenv("TEMPER_KERNELS", mode)
        got = kernels.grouped_linear(xs, w, counts.cumsum(0))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        for a, b in zip(torch.autograd.grad(got, (xs, w), gout), wgrads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-5)
    with pytest.raises(ValueError, match="cover 44 rows of 45"):
        kmoe.grouped_mm_reference(xs, w, torch.tensor([7, 7, 40, 44]))


def test_grouped_gemm_schedule_covers_every_row_once():
    ends = torch.tensor([0, 70, 70, 75, 200], dtype=torch.int32)  # an empty first expert, a 5-row one
    expert, row = kmoe._schedule(ends, 200)
    real = expert < 5
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1].long()])
    covered = torch.cat([torch.arange(int(r), min(int(r) + kmoe.BM, int(ends[e]))) for e, r in
                         zip(expert[real], row[real], strict=True)])
    assert torch.equal(covered.sort().values, torch.arange(200))
    assert all(starts[e] <= r < ends[e] for e, r in zip(expert[real].tolist(), row[real].tolist(), strict=True))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_torch_grouped_mm_call_convention():
    """The CUDA path calls torch._grouped_mm(x, wᵀ, offs=ends): check that convention where it runs (fp32 CPU)."""
    x, w = torch.randn(10, 8), torch.randn(3, 6, 8)
    ends = torch.tensor([3, 3, 10], dtype=torch.int32)
    try:
        y = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    except RuntimeError as e:  # a build without the CPU fallback
        pytest.skip(f"torch._grouped_mm does not run on the CPU here: {e}")
    torch.testing.assert_close(y, torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T]))


def test_route_matches_the_model_router(cfg_factory):
    from model.layers import Router

    cfg = cfg_factory(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    r = Router(cfg)
    torch.nn.init.normal_(r.weight)
    r.e_score_correction_bias.normal_()
    x = torch.randn(11, cfg.hidden_size)
    idx, w = r(x)
    i2, w2 = kmoe.route(x @ r.weight.T, r.e_score_correction_bias, 3, 4, 2, "sigmoid", True, cfg.routed_scaling_factor)
    assert torch.equal(idx, i2)
    torch.testing.assert_close(w, w2)


@pytest.mark.parametrize("e, k, n_group, topk_group", [(16, 3, 4, 2), (24, 5, 1, 1), (12, 2, 4, 3), (256, 8, 8, 4),
                                                       (64, 6, 8, 8)])
def test_route_kernel_selects_the_twin_s_experts_in_its_order(triton_mode, e, k, n_group, topk_group):
    """The fused selection (one program a token) against `route_reference` (torch's topk over the masked groups):
    the same experts in the same order, the same weights, and their gradient. Shapes: group-limited, no groups, a
    group width that is not a power of two (3), GLM-5's and DeepSeek-V3's 256 experts in 8 groups keeping 4, and
    every group kept (no limit)."""
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(37, e, generator=g, requires_grad=True)
    bias = torch.randn(e, generator=g) * 0.1
    idx, w = kmoe.route(logits, bias, k, n_group, topk_group, "sigmoid", True, 2.5)
    ridx, rw = kmoe.route_reference(logits, bias, k, n_group, topk_group, "sigmoid", True, 2.5)
    assert idx.dtype == torch.long and torch.equal(idx, ridx)
    torch.testing.assert_close(w, rw)
    gw = torch.randn(w.shape, generator=g)
    torch.testing.assert_close(torch.autograd.grad(w, logits, gw)[0], torch.autograd.grad(rw, logits, gw)[0])
    if n_group > 1 and topk_group < n_group:  # every pick within the kept groups, by the groups' top-2 sums
        choice = (logits.detach().sigmoid() + bias).view(37, n_group, -1)
        kept = choice.topk(2, -1).values.sum(-1).topk(topk_group, -1).indices
        assert all(set((idx[t] // (e // n_group)).tolist()) <= set(kept[t].tolist()) for t in range(37))
    # ties (a zero-initialised router scores every expert alike) go to the lowest group and expert ids
    tied, _ = kmoe.route(torch.zeros(3, e), torch.zeros(e), k, n_group, topk_group, "sigmoid", True, 2.5)
    assert tied.tolist() == [list(range(k))] * 3
    # a NaN score ranks first (as in topk), a whole NaN row still gives k distinct real experts, and experts barred by
    # a -inf bias are picked last and never twice
    bad = torch.randn(3, e, generator=g)
    bad[0, e // 2] = float("nan")
    bad[1] = float("nan")
    barred = torch.zeros(e)
    barred[1:] = float("-inf")
    for lg, b in ((bad, bias), (torch.randn(3, e, generator=g), barred)):
        got, _ = kmoe.route(lg, b, k, n_group, topk_group, "sigmoid", True, 2.5)
        assert all(len(set(r)) == k and min(r) >= 0 and max(r) < e for r in got.tolist())
        if lg is bad:
            assert got[0, 0] == e // 2
        else:  # only expert 0 is finite: it comes first, then -inf experts
            assert (got[:, 0] == 0).all()


# ---- RMSNorm, chunked cross-entropy ---------------------------------------------------------------------------
def test_rms_norm_kernel_forward_and_backward(triton_mode):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 48, generator=g, requires_grad=True)  # 48: a masked tail in a 64-wide tile
    wt = (1 + torch.randn(48, generator=g) * 0.1).requires_grad_()
    got = kernels.rms_norm(x, wt, 1e-6)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * wt  # hand-written, not the twin
    torch.testing.assert_close(got, want)
    gout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (x, wt), gout), torch.autograd.grad(want, (x, wt), gout), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(7, 2, 2 * 48), (5, 2 * 1100)])  # a masked tail; two column blocks of 1,024
def test_swiglu_kernel_forward_and_backward_on_strided_halves(triton_mode, shape):
    """The fused SwiGLU on the two halves of one [g | u] tensor, read in place (rows strided), against the formula
    written out by hand, forward and both gradients."""
    g0 = torch.Generator().manual_seed(4)
    gu = (torch.randn(*shape, generator=g0) * 3).requires_grad_()
    g, u = gu.chunk(2, dim=-1)
    assert g.stride(-2) == shape[-1] and not g.is_contiguous()
    got = kernels.swiglu(g, u)
    want = g / (1 + torch.exp(-g)) * u  # hand-written, not the twin
    torch.testing.assert_close(got, want)
    gout = torch.randn_like(got)
    torch.testing.assert_close(torch.autograd.grad(got, gu, gout)[0], torch.autograd.grad(want, gu, gout)[0],
                               atol=1e-5, rtol=1e-5)
    # with a row weight (the MoE's routing weight): y = r · silu(g) ⊙ u, and dr from the hand formula, in float64
    # (dr sums a row's 1,100 products: an fp32 reference's own summation order would differ from the kernel's by
    # as much as the tolerance, with the thread count)
    r = torch.rand(shape[:-1], generator=g0).requires_grad_()
    got = kernels.swiglu(g, u, r)
    gu64, r64 = gu.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    g64, u64 = gu64.chunk(2, dim=-1)
    want = g64 / (1 + torch.exp(-g64)) * u64 * r64[..., None]
    torch.testing.assert_close(got, want.float())
    for a, b in zip(torch.autograd.grad(got, (gu, r), gout),
                    torch.autograd.grad(want, (gu64, r64), gout.double()), strict=True):
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-5)


def test_moe_keeps_only_its_rows_projections_and_activation_for_the_backward(monkeypatch):
    """What one MoE layer's routed experts keep for the backward on the CUDA path (the `meta` device, bf16), counted
    by a saved-tensors hook against a hand count: the first GEMM's output [g | u] (n·k × 2I) for the SwiGLU, and the
    SwiGLU's weighted output (n·k × I) for the second GEMM. Not the rows sorted by expert (n·k × H: a recipe, a
    gather from x, made again in the backward), not silu(g), not the second GEMM's output (the routing weights apply
    inside the SwiGLU), and not a copy of the rows for the unpermute."""
    from temper_kernels.meta import on_meta

    n, k, h, i, e = 64, 4, 32, 48, 8
    with torch.device("meta"):
        x = torch.empty(n, h, dtype=torch.bfloat16, requires_grad=True)
        idx = torch.empty(n, k, dtype=torch.long)
        w = torch.empty(n, k, dtype=torch.bfloat16, requires_grad=True)
        gu = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, requires_grad=True)
        dn = torch.empty(e, h, i, dtype=torch.bfloat16, requires_grad=True)
    seen = {}

    def pack(t):
        seen.setdefault(t.untyped_storage()._cdata, t)
        return t

    weights = {gu.untyped_storage()._cdata, dn.untyped_storage()._cdata}
    with on_meta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kernels.moe_experts(x, idx, w, gu, dn)
    big = sorted(t.untyped_storage().nbytes() // 2 for key, t in seen.items()
                 if key not in weights and t.dtype == torch.bfloat16 and t.untyped_storage().nbytes() > 2 * n * k)
    assert big == sorted([n * k * 2 * i, n * k * i]), big


def test_chunked_cross_entropy_equals_the_full_logits_loss():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(50, 16, generator=g, requires_grad=True)
    wt = torch.randn(40, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 40, (50,), generator=g)
    t[::7] = -100
    got = knorm.chunked_cross_entropy(h, wt, t, chunk=8)
    want = F.cross_entropy(h @ wt.T, t, ignore_index=-100)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (h, wt)), torch.autograd.grad(want, (h, wt)), strict=True):
        torch.testing.assert_close(a, b)


def _rope_by_hand(x: torch.Tensor, theta: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The textbook rotation, pair by pair with complex numbers, then laid out half-split (independent of the twin)."""
    d = x.shape[-1]
    pairs = x.unflatten(-1, (d // 2, 2)) if interleave else torch.stack([x[..., : d // 2], x[..., d // 2 :]], -1)
    z = torch.view_as_complex(pairs.double().contiguous()) * torch.polar(torch.ones_like(theta.double()),
                                                                         theta.double())
    return torch.cat([z.real, z.imag], -1).to(x.dtype)


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_kernel_forward_and_backward_on_the_models_shapes(triton_mode, interleave):
    """The three calls the model makes: a query's rotary slice [B, T, H, nope + r][..., nope:] with cos [B, T, 1, r/2],
    the latent's slice [B, T, kv + r][..., kv:] with cos [B, T, r/2], and an odd head count (a masked tail of the
    head tile): values against the rotation by hand, gradients against the torch twin's autograd."""
    g = torch.Generator().manual_seed(7)
    b, t, r = 2, 5, 16
    theta = torch.randn(b, t, r // 2, generator=g) * 3
    for full, heads in (((b, t, 3, 8 + r), (2,)), ((b, t, 12 + r), ()), ((b, t, 17, r), (2,))):
        base = torch.randn(*full, generator=g, requires_grad=True)
        x = base[..., full[-1] - r :]
        cos, sin = theta.cos(), theta.sin()
        if heads:
            cos, sin, th = cos.unsqueeze(2), sin.unsqueeze(2), theta.unsqueeze(2)
        else:
            th = theta
        got = kernels.rope(x, cos, sin, interleave)
        assert got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, _rope_by_hand(x.detach(), th.expand(*x.shape[:-1], r // 2), interleave))
        want = krope.rope_reference(x, cos, sin, interleave)
        gout = torch.randn(got.shape, generator=g)
        (ga,) = torch.autograd.grad(got, base, gout)
        (gb,) = torch.autograd.grad(want, base, gout)
        torch.testing.assert_close(ga, gb, atol=1e-6, rtol=1e-5)
        if full[-1] > r:  # only the rotary slice gets a gradient
            assert ga[..., : full[-1] - r].abs().max() == 0 and ga[..., full[-1] - r :].abs().max() > 0


def test_rope_falls_back_to_the_twin_where_the_kernel_does_not_apply(triton_mode, monkeypatch):
    """cos/sin that need a gradient or do not broadcast as positions × heads take the twin (values still right)."""
    calls = []
    monkeypatch.setattr(krope._Rope, "apply", lambda *a: calls.append(a) or krope.rope_reference(*a[:4]))
    x = torch.randn(2, 3, 4, 8)
    c, s = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    kernels.rope(x, c, s, True)
    assert len(calls) == 1
    kernels.rope(x, c.requires_grad_(), s, True)  # a gradient for cos: the twin
    kernels.rope(x, torch.randn(3, 1, 4), torch.randn(3, 1, 4), True)  # cos not indexed by x's leading dims
    assert len(calls) == 1
