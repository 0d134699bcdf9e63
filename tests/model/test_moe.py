"""MoE gate, grouped dispatch and aux-loss-free balancing."""

import torch
import torch.nn.functional as F

from model.layers import MoE


def _moe(cfg_factory, **kw):
    torch.manual_seed(0)
    m = MoE(cfg_factory(**kw))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def _naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop straight from the formulas (slow twin)."""
    cfg = moe.cfg
    out = []
    for tok in x:
        s = torch.sigmoid(moe.gate.weight.float() @ tok.float())
        choice = s + moe.gate.e_score_correction_bias
        if cfg.n_group > 1:
            groups = choice.view(cfg.n_group, -1)
            gscore = groups.topk(2, -1).values.sum(-1)
            keep = gscore.topk(cfg.topk_group).indices
            allowed = torch.zeros(cfg.n_group, dtype=torch.bool)
            allowed[keep] = True
            choice = choice.masked_fill(~allowed.repeat_interleave(groups.shape[1]), float("-inf"))
        idx = choice.topk(cfg.num_experts_per_tok).indices
        w = s[idx] / s[idx].sum() * cfg.routed_scaling_factor
        y = moe.shared_experts(tok)
        for e, we in zip(idx.tolist(), w):
            gu = moe.experts.gate_up_proj[e] @ tok
            g, u = gu.chunk(2)
            y = y + we * (moe.experts.down_proj[e] @ (F.silu(g) * u))
        out.append(y)
    return torch.stack(out)


def test_grouped_dispatch_equals_per_token_loop(cfg_factory):
    for kw in ({}, {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}):
        moe = _moe(cfg_factory, **kw)
        with torch.no_grad():
            moe.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
            x = torch.randn(3, 7, 64)
            torch.testing.assert_close(moe(x), _naive(moe, x.view(-1, 64)).view(3, 7, 64), atol=1e-5, rtol=1e-5)


def test_group_limited_routing_only_picks_from_kept_groups(cfg_factory):
    moe = _moe(cfg_factory, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    idx, _ = moe.gate(torch.randn(200, 64))
    groups = idx // 4
    assert all(len(set(row)) <= 2 for row in groups.tolist())


def test_bias_changes_selection_but_not_weights(cfg_factory):
    moe = _moe(cfg_factory)
    x = torch.randn(64, 64)
    with torch.no_grad():
        idx0, w0 = moe.gate(x)
        moe.gate.e_score_correction_bias[3] = 10.0  # force expert 3 into every choice
        idx1, w1 = moe.gate(x)
    assert (idx1 == 3).any(-1).all() and not (idx0 == 3).any(-1).all()
    # weights are the *unbiased* sigmoid scores of the chosen experts, normalised, times the scale
    s = torch.sigmoid(x @ moe.gate.weight.T)
    want = s.gather(1, idx1)
    torch.testing.assert_close(w1, want / want.sum(-1, keepdim=True) * 2.5)
    # rows whose choice did not change keep exactly the same weights
    same = (idx0.sort(-1).values == idx1.sort(-1).values).all(-1)
    for r in same.nonzero().flatten().tolist():
        order0, order1 = idx0[r].argsort(), idx1[r].argsort()
        torch.testing.assert_close(w0[r][order0], w1[r][order1])


def test_bias_update_moves_loads_toward_uniform(cfg_factory):
    moe = _moe(cfg_factory)
    with torch.no_grad():
        moe.gate.weight[0] += 1.0  # expert 0 attracts far more than its share
    x = torch.randn(512, 64) + 0.5
    moe.train()

    def imbalance() -> float:
        with torch.no_grad():
            moe(x)
        load = moe.expert_load.clone()
        moe.update_bias(rate=0.02)
        return float(load.max() / load.mean())

    first = imbalance()
    for _ in range(150):
        last = imbalance()
    assert first > 2.0 and last < 0.6 * first
    assert moe.gate.e_score_correction_bias[0] < 0


def test_bf16_router_gradients_are_the_plain_expressions_bit_for_bit(cfg_factory):
    """A bf16 model's router computes its logits in fp32 from the bf16 input and keeps the input itself, not its
    fp32 copy, for the backward (`_LinearFP32`). Its output and the gradients of the input and the fp32 weight are
    autograd's of `F.linear(x.float(), w)`, bit for bit; and the saved tensors hold no fp32 copy of x."""
    from model.layers import Router

    r = Router(cfg_factory())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, r.weight.shape[1], generator=g).to(torch.bfloat16).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        idx, w = r(x)
    assert saved and not [t for t in saved if t.dtype == torch.float32 and t.shape == x.shape]
    # the router's own fp32 logits: through `_LinearFP32`, against the plain expression
    from model.layers import _LinearFP32

    w_a = r.weight.detach().clone().requires_grad_()
    w_b = r.weight.detach().clone().requires_grad_()
    out_a, out_b = _LinearFP32.apply(x, w_a), F.linear(x2.float(), w_b)
    assert torch.equal(out_a, out_b)
    gout = torch.randn(out_a.shape, generator=g)
    ga, gb = torch.autograd.grad(out_a, (x, w_a), gout), torch.autograd.grad(out_b, (x2, w_b), gout)
    assert ga[0].dtype == torch.bfloat16 and all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
    assert w.dtype == torch.bfloat16 and idx.shape == (9, r.cfg.num_experts_per_tok)
