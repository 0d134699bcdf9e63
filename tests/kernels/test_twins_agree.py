"""Twins and kernels agree where they used to part (issue R2): NaN in the sparse MLA, exact ties and NaN in routing,
and MoE calls with zero tokens. Each path is checked against an independent slow computation, under
TRITON_INTERPRET=1 on a machine without a GPU. (The indexer top-k's NaN rule: tests/kernels/test_topk.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import temper_kernels as kernels

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed on this platform")
MODES = ("triton", "reference")


@pytest.fixture(autouse=True)
def _interpreting():
    if not torch.cuda.is_available():
        assert kernels.interpreting(), "tests/conftest.py sets TRITON_INTERPRET=1 before kernels is imported"


# ---- sparse MLA: NaN propagates, an unusable NaN row stays out ---------------------------------------------------
def _slow_mla(q, kv, idx, qpos, scale, dv):
    """One softmax per (row, query, head) over the usable keys only, in float64; no usable key → 0."""
    b, t, h, _ = q.shape
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            keys = [int(i) for i in idx[bi, ti] if 0 <= i <= qpos[bi, ti]]
            if keys:
                rows = kv[bi, keys].double()
                for hi in range(h):
                    out[bi, ti, hi] = torch.softmax(rows @ q[bi, ti, hi].double() * scale, 0) @ rows[:, :dv]
    return out


def test_sparse_mla_nan_head_is_nan_and_unusable_nan_rows_stay_out(monkeypatch):
    """Query 0 uses a cache row holding a NaN: every head NaN. Query 1 selects that row past its causal limit: it is
    not used, the output is finite (the twin multiplied it by a zero probability: NaN). Query 2 has one NaN head: that
    head NaN (the twin made it zeros), the other heads exact."""
    g = torch.Generator().manual_seed(0)
    t, h, dv, dr, s = 3, 3, 16, 16, 24
    q = torch.randn(1, t, h, dv + dr, generator=g)
    kv = torch.randn(1, s, dv + dr, generator=g)
    idx = torch.stack([torch.randperm(s, generator=g) for _ in range(t)])
    idx = torch.stack([r[r != 20][:12] for r in idx])[None]
    qpos = torch.tensor([[23, 15, 23]])
    kv[0, 20, 3] = float("nan")
    idx[0, :2, 0] = 20
    q[0, 2, 1, 5] = float("nan")
    want = _slow_mla(q, kv, idx, qpos, 0.3, dv)
    assert want[0, 0].isnan().all() and not want[0, 1].isnan().any() and want[0, 2, 1].isnan().all()
    for mode in MODES:
        monkeypatch.setenv("TEMPER_KERNELS", mode)
        got = kernels.sparse_mla(q, kv, idx, qpos, 0.3, dv)
        assert got[0, 0].isnan().all() and got[0, 2, 1].isnan().all(), mode
        torch.testing.assert_close(got[0, 1].double(), want[0, 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[0, 2, [0, 2]].double(), want[0, 2, [0, 2]], atol=1e-5, rtol=1e-5)


# ---- routing: the lowest id on exact ties, NaN first -------------------------------------------------------------
def _slow_route(logits, bias, k, n_group, topk_group):
    """Per token in Python: choice = sigmoid + bias (fp32, NaN as +inf); groups by the fp32 sum of their two best
    (NaN as +inf), the best `topk_group` kept, ties to the lower group; then experts by (choice desc, id asc), those
    of dropped groups at −inf."""
    choice = (logits.sigmoid() + bias).numpy().astype(np.float32)
    choice[np.isnan(choice)] = np.inf
    n, e = choice.shape
    out = []
    for row in choice:
        c = [float(v) for v in row]
        if n_group > 1 and topk_group < n_group:
            w = e // n_group
            gs = []
            for gi in range(n_group):
                a, b2 = sorted(row[gi * w : (gi + 1) * w])[-2:]
                v = float(np.float32(a) + np.float32(b2))
                gs.append(math.inf if v != v else v)
            kept = sorted(range(n_group), key=lambda gi: (-gs[gi], gi))[:topk_group]
            c = [v if i // w in kept else -math.inf for i, v in enumerate(c)]
        out.append(sorted(range(e), key=lambda i: (-c[i], i))[:k])
    return torch.tensor(out)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf + (-inf), on purpose
@pytest.mark.parametrize("e, k, n_group, topk_group", [(16, 3, 4, 2), (24, 5, 1, 1), (256, 8, 8, 4), (12, 2, 4, 3)])
def test_route_picks_the_lowest_ids_on_exact_ties_on_both_paths(monkeypatch, e, k, n_group, topk_group):
    g = torch.Generator().manual_seed(e)
    logits = torch.randint(-1, 2, (9, e), generator=g).float()  # few distinct values: exact ties everywhere
    logits[0] = 0.0  # a zero-initialised router: every expert alike
    logits[1, [e - 1, 2]] = float("nan")  # two NaN experts: both first, the lower id first
    bias = torch.randint(0, 2, (e,), generator=g) * 0.25
    want = _slow_route(logits, bias, k, n_group, topk_group)
    assert want[1, :2].tolist() == [2, e - 1]
    # a group whose best is a NaN expert and whose others are barred (-inf bias): its score inf + (-inf) is NaN, and
    # it ranks first (it holds a NaN expert)
    barred = bias.clone()
    barred[1 : e // n_group] = float("-inf")
    nan0 = logits.clone()
    nan0[2:, 0] = float("nan")
    want_barred = _slow_route(nan0, barred, k, n_group, topk_group)
    assert (want_barred[2:, 0] == 0).all()
    for mode in MODES:
        monkeypatch.setenv("TEMPER_KERNELS", mode)
        idx, w = kernels.route(logits, bias, k, n_group, topk_group, "sigmoid", True, 2.5)
        assert torch.equal(idx, want), mode
        assert torch.equal(kernels.route(nan0, barred, k, n_group, topk_group, "sigmoid", True, 2.5)[0], want_barred)
        ztied, _ = kernels.route(torch.zeros(3, e), torch.zeros(e), k, n_group, topk_group, "sigmoid", True, 2.5)
        assert ztied.tolist() == [list(range(k))] * 3, mode


# ---- MoE with zero tokens ----------------------------------------------------------------------------------------
def test_moe_calls_with_zero_tokens_return_empty_results(monkeypatch, cfg_factory):
    from model.layers import MoE

    g = torch.Generator().manual_seed(1)
    gu = torch.randn(6, 48, 16, generator=g, requires_grad=True)
    dn = torch.randn(6, 16, 24, generator=g, requires_grad=True)
    cfg = cfg_factory()
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=g)
    for mode in MODES:
        monkeypatch.setenv("TEMPER_KERNELS", mode)
        x = torch.randn(0, 16, requires_grad=True)
        w = torch.rand(0, 2, requires_grad=True)
        y = kernels.moe_experts(x, torch.zeros(0, 2, dtype=torch.long), w, gu, dn)
        assert y.shape == (0, 16) and y.dtype == x.dtype, mode
        gx, gw = torch.autograd.grad(y.sum(), (x, w))
        assert gx.shape == (0, 16) and gw.shape == (0, 2)
        x3 = torch.randn(3, 16)  # k = 0: nothing routed, zeros
        assert torch.equal(kernels.moe_experts(x3, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, 0), gu, dn),
                           torch.zeros(3, 16)), mode
        idx, rw = kernels.route(torch.zeros(0, 16), torch.zeros(16), 2, 4, 2, "sigmoid", True, 2.5)
        assert idx.shape == rw.shape == (0, 2), mode
        assert layer(torch.zeros(2, 0, cfg.hidden_size)).shape == (2, 0, cfg.hidden_size), mode
