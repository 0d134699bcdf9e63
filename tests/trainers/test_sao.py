"""SAO math against hand computations: GAE variants, the band mask, normalisation, staleness, OPD."""

import math

import pytest
import torch

import configs
from model import Transformer
from rollout.types import Segment, Trajectory
from trainers.advantages import adaptive_lambda, gae, grpo_advantages, returns
from trainers.rl_losses import LossConfig, band_mask, kl_penalty, opd_advantage, policy_loss
from trainers.sao import SAOConfig, SAOTrainer, layout


def test_gae_hand_computation():
    v = torch.tensor([0.5, 0.2, 0.1])
    # δ = [0.2-0.5, 0.1-0.2, 1-0.1] = [-0.3, -0.1, 0.9]; λ = 0.5
    torch.testing.assert_close(gae(v, 1.0, gamma=1.0, lam=0.5), torch.tensor([-0.125, 0.35, 0.9]))
    # λ = 1, γ = 1: A = R − V
    torch.testing.assert_close(gae(v, 1.0, 1.0, 1.0), 1.0 - v)
    # γ < 1 discounts the terminal reward
    torch.testing.assert_close(returns(3, 2.0, gamma=0.5), torch.tensor([0.5, 1.0, 2.0]))
    assert adaptive_lambda(10, 0.5) == pytest.approx(0.8) and adaptive_lambda(1, 0.5) == 0.0
    assert gae(torch.zeros(0), 1.0).numel() == 0


def _traj(segments, reward=1.0, versions=None, status="completed", env="e"):
    segs = []
    for toks, mask in segments:
        ver = versions if versions is not None else 0
        segs.append(Segment(list(toks), list(mask), [-1.0 if m else 0.0 for m in mask],
                            [ver if m else -1 for m in mask]))
    return Trajectory("t", env, "f", "math", "h", "v", 0, segs, reward, status)


class ConstCritic(torch.nn.Module):
    """Value = a fixed function of the token id at the position (a stand-in with known values)."""

    def __init__(self, table):
        super().__init__()
        self.table = table
        self.p = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return self.table[ids] + 0 * self.p


def test_skip_observation_and_cross_segment_gae():
    cfg = configs.load("micro").model
    actor = Transformer(cfg)
    table = torch.zeros(cfg.vocab_size)
    table[10], table[11], table[12], table[13] = 0.4, 0.3, 0.2, 0.1
    tr = SAOTrainer(actor, SAOConfig(alpha=10.0, gamma=1.0), critic=ConstCritic(table))
    # segment 1: prompt 1 2 | action 10 11 | obs 5 5 ; segment 2 (after compaction): prompt 1 | action 12 13
    t = _traj([([1, 2, 10, 11, 5, 5], [0, 0, 1, 1, 0, 0]), ([1, 12, 13], [0, 1, 1])], reward=1.0)
    rows = layout([t])
    adv, ret = tr.advantages([t], rows)
    v = torch.tensor([0.4, 0.3, 0.2, 0.1])  # values of the four trainable tokens, in order
    lam = adaptive_lambda(4, 10.0)
    want = gae(v, 1.0, 1.0, lam)  # the TD chain skips observations and crosses the segment boundary
    torch.testing.assert_close(adv[0][rows.mask[0]], want[:2])
    torch.testing.assert_close(adv[1][rows.mask[1]], want[2:])
    assert adv[0][~rows.mask[0]].abs().sum() == 0 and adv[1][~rows.mask[1]].abs().sum() == 0
    assert (ret[rows.mask] == 1.0).all()
    # with zero values the first segment's advantages are the second's scaled by (γλ)^(trainable after it)
    zero = SAOTrainer(actor, SAOConfig(alpha=10.0), critic=ConstCritic(torch.zeros(cfg.vocab_size)))
    adv0, _ = zero.advantages([t], rows)
    seg1, seg2 = adv0[0][rows.mask[0]], adv0[1][rows.mask[1]]
    torch.testing.assert_close(seg1, seg2 * lam**2)
    torch.testing.assert_close(seg2, torch.tensor([lam, 1.0]))


def test_band_mask_edges():
    r = torch.tensor([0.8, 0.8000001, 1.0, 4.9999, 5.0, 7.0])
    assert band_mask(r, 0.2, 4.0).tolist() == [False, True, True, True, False, False]


def test_sao_loss_gradient_and_normalisation():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.2], [0.4, 0.1, 0.1]])).requires_grad_(True)
    roll = torch.log(torch.tensor([[0.5, 0.25, 0.2], [0.4, 0.1, 0.9]]))  # ratios [1, 2, 1], [1, 1, 1/9]
    adv = torch.tensor([[1.0, 2.0, -1.0], [0.5, 1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    loss, st = policy_loss(logp, roll, adv, mask, LossConfig("sao", eps_low=0.2, eps_high=4.0))
    # token-level mean over the 5 trainable tokens; the ratio 1/9 token is outside the band: no gradient
    want = -(1 * 1 * logp[0, 0] + 2 * 2 * logp[0, 1] + 1 * -1 * logp[0, 2] + 1 * 0.5 * logp[1, 0]) / 5
    torch.testing.assert_close(loss, want)
    loss.backward()
    assert logp.grad[1, 2] == 0 and logp.grad[1, 1] == 0
    assert st["clip_frac"] == pytest.approx(1 / 5) and st["tokens"] == 5
    # PPO (naive async) and TIS run on the same inputs
    for kind in ("ppo", "tis", "grpo"):
        lo, _ = policy_loss(logp.detach().requires_grad_(True), roll, adv, mask, LossConfig(kind))
        assert torch.isfinite(lo)


def test_micro_batching_equals_one_batch():
    torch.manual_seed(0)
    cfg = configs.load("micro").model
    trajs = [_traj([(torch.randint(0, 200, (n,)).tolist(), [0] * 3 + [1] * (n - 3))], reward=float(i % 2))
             for i, n in enumerate([9, 14, 20, 7, 12])]
    grads = []
    for micro in (1, 5):
        torch.manual_seed(1)
        actor = Transformer(cfg)
        tr = SAOTrainer(actor, SAOConfig(micro_rows=micro, critic_updates=0, loss="tis"))
        tr.step(trajs, current_version=0)
        grads.append({n: p.detach().clone() for n, p in actor.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=2e-6, rtol=1e-4)


def test_staleness_bound_and_exclusions():
    cfg = configs.load("micro").model
    tr = SAOTrainer(Transformer(cfg), SAOConfig(staleness=2, critic_updates=0))
    ok = _traj([([1, 2, 3, 4], [0, 1, 1, 1])], versions=8)
    stale = _traj([([1, 2, 3, 4], [0, 1, 1, 1])], versions=7)
    crashed = _traj([([1, 2, 3], [0, 1, 1])], versions=10, status="crashed")
    kept = tr.select([ok, stale, crashed], current_version=10)
    assert kept == [ok] and tr.dropped == {"stale": 1, "crashed": 1, "empty": 0}
    naive = SAOTrainer(Transformer(cfg), SAOConfig(loss="ppo", staleness=2, critic_updates=0))
    assert len(naive.select([ok, stale], current_version=10)) == 2  # the naive baseline has no bound


def test_grpo_and_opd_hand_cases():
    a = grpo_advantages([1.0, 0.0, 1.0, 0.5, 0.5], ["x", "x", "x", "y", "y"])
    s = math.sqrt(2 / 9)
    assert a[0] == pytest.approx((1 - 2 / 3) / s, rel=1e-4) and a[1] == pytest.approx((0 - 2 / 3) / s, rel=1e-4)
    assert a[3] == 0 and a[4] == 0
    lt = torch.tensor([-1.0, -0.5, -3.0])
    ls = torch.tensor([-2.0, -0.5, -1.0], requires_grad=True)
    adv = opd_advantage(lt, ls, outcome=1.0, alpha=0.5)
    torch.testing.assert_close(adv, torch.tensor([1.5, 0.5, -1.5]))
    assert not adv.requires_grad


def test_sao_step_runs_and_reports(tmp_path):
    cfg = configs.load("micro").model
    torch.manual_seed(0)
    tr = SAOTrainer(Transformer(cfg), SAOConfig(critic_updates=2))
    trajs = [_traj([(torch.randint(0, 200, (16,)).tolist(), [0] * 6 + [1] * 10)], reward=float(i % 2), versions=3)
             for i in range(4)]
    pre = tr.value_pretrain(trajs, steps=5)
    assert pre[-1] < pre[0]
    st = tr.step(trajs, current_version=4)
    for k in ("clip_frac", "ratio_mean", "kl", "entropy", "value_loss", "grad_norm", "reward_mean"):
        assert k in st and math.isfinite(st[k])
    assert st["trajectories"] == 4 and st["tokens"] == 40


def test_a_bf16_policy_and_critic_train_through_fp32_main_weights():
    """A bf16 checkpoint on the torch backend (the GPU deployment's): the actor's and the critic's optimizers keep fp32
    main weights (trainers/optim.py), their bf16 weights' gradients land in fp32 `main_grad`s, and a step moves
    both."""
    from trainers.optim import ShardedAdamW

    cfg = configs.load("micro").model
    torch.manual_seed(0)
    tr = SAOTrainer(Transformer(cfg).to(torch.bfloat16), SAOConfig(critic_updates=2))
    assert isinstance(tr.opt, ShardedAdamW) and isinstance(tr.copt, ShardedAdamW)
    before = [p.detach().clone() for p in tr.actor.parameters()], [p.detach().clone() for p in tr.critic.parameters()]
    trajs, mask = [], [0] * 6 + [1] * 10
    for i in range(4):  # on-policy: the rollout log-probs are the actor's own, so the ratio is 1 and nothing clips
        toks = torch.randint(0, 200, (16,)).tolist()
        with torch.no_grad():
            lp = tr.actor(torch.tensor([toks])).float()[0, :-1].log_softmax(-1)
        logps = [float(lp[j - 1, t]) if m else 0.0 for j, (t, m) in enumerate(zip(toks, mask, strict=True))]
        seg = Segment(toks, mask, logps, [3 if m else -1 for m in mask])
        trajs.append(Trajectory("t", "e", "f", "math", "h", "v", 0, [seg], float(i % 2), "completed"))
    st = tr.step(trajs, current_version=4)
    assert math.isfinite(st["grad_norm"]) and st["grad_norm"] > 0 and math.isfinite(st["value_loss"])
    bf16 = [p for p in tr.actor.parameters() if p.dtype == torch.bfloat16]
    assert bf16 and all(p.grad is None for p in bf16)
    assert any(p.main_grad is not None and p.main_grad.dtype == torch.float32 for p in bf16)
    for now, then in zip((list(tr.actor.parameters()), list(tr.critic.parameters())), before, strict=True):
        assert any(not torch.equal(p, q) for p, q in zip(now, then, strict=True))


def test_value_pretrain_cycles_through_batches():
    """With a batch size, each update fits one batch, in order and cycling, and its loss is that batch's mean:
    the same as an update on that batch alone (so pre-training on 80 stored rollouts costs what 10 batches cost)."""
    cfg = configs.load("micro").model
    trajs = [_traj([(torch.randint(0, 200, (10 + i,)).tolist(), [0] * 4 + [1] * (6 + i))], reward=float(i % 2),
                   versions=1) for i in range(5)]
    seen = []

    def spy(tr):
        real = tr._critic_update

        def update(rows, ret, n):
            seen.append((int(rows.mask.sum()), n))
            return real(rows, ret, n)
        tr._critic_update = update
        return tr

    torch.manual_seed(0)
    tr = spy(SAOTrainer(Transformer(cfg), SAOConfig(critic_updates=1)))
    losses = tr.value_pretrain(trajs, steps=4, batch_size=2)
    sizes = [sum(t.n_trainable for t in trajs[i:i + 2]) for i in (0, 2, 4, 0)]  # batches [0,1] [2,3] [4] [0,1]
    assert [s for s, _ in seen] == sizes and [n for _, n in seen] == sizes
    torch.manual_seed(0)
    alone = SAOTrainer(Transformer(cfg), SAOConfig(critic_updates=1))
    assert losses[0] == pytest.approx(alone.value_pretrain(trajs[:2], steps=1)[0], rel=1e-6)
    seen.clear()
    spy(alone).value_pretrain(trajs, steps=2)  # no batch size: every update fits all of them
    assert [s for s, _ in seen] == [sum(t.n_trainable for t in trajs)] * 2


def test_actor_lr_warmup_reaches_the_configured_lr():
    cfg = configs.load("micro").model
    torch.manual_seed(0)
    tr = SAOTrainer(Transformer(cfg), SAOConfig(lr=1e-3, warmup_steps=4, critic_updates=0, loss="tis"))
    assert [tr.lr_at(s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert SAOTrainer(Transformer(cfg), SAOConfig(lr=1e-3, critic_updates=0)).lr_at(0) == 1e-3  # no warmup
    trajs = [_traj([(torch.randint(0, 200, (12,)).tolist(), [0] * 4 + [1] * 8)], reward=float(i % 2), versions=1)
             for i in range(4)]
    before = {n: p.detach().clone() for n, p in tr.actor.named_parameters()}
    st = tr.step(trajs, current_version=1)
    assert st["lr"] == pytest.approx(2.5e-4) and tr.opt.param_groups[0]["lr"] == pytest.approx(2.5e-4)
    # Adam's first update moves a parameter by at most ~lr: the warmup's lr, not the configured one
    moved = max(float((p.detach() - before[n]).abs().max()) for n, p in tr.actor.named_parameters())
    assert 0 < moved <= 2.5e-4 * 1.01


def test_kl_penalty_hand_computation():
    p = torch.tensor([[0.5, 0.2, 0.9]])
    q = torch.tensor([[0.25, 0.4, 0.1]])  # the reference's probabilities of the same tokens
    logp = p.log().requires_grad_(True)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    kl = kl_penalty(logp, q.log(), mask)
    # k3 = q/p − log(q/p) − 1 on the two trainable tokens, averaged: (0.5 − log 0.5 − 1 + 2 − log 2 − 1) / 2
    assert float(kl) == pytest.approx((0.5 - math.log(0.5) - 1 + 2 - math.log(2) - 1) / 2, rel=1e-6)
    kl.backward()
    # d k3 / d log p = 1 − q/p: positive where p > q (pushes log p down), negative where p < q
    torch.testing.assert_close(logp.grad, torch.tensor([[(1 - 0.5) / 2, (1 - 2.0) / 2, 0.0]]))


def _token_gap(model, ref, ids, mask):
    """Mean |log π(token) − log π_ref(token)| over the trainable tokens, from full forwards (not the trainer's
    per-row path)."""
    with torch.no_grad():
        nxt = ids[:, 1:].unsqueeze(-1)
        lp = torch.log_softmax(model(ids)[:, :-1].float(), -1).gather(-1, nxt).squeeze(-1)
        lq = torch.log_softmax(ref(ids)[:, :-1].float(), -1).gather(-1, nxt).squeeze(-1)
        m = mask[:, 1:].float()
        return float(((lp - lq).abs() * m).sum() / m.sum())


def test_sao_kl_anchor_pulls_the_actor_back_to_where_it_started():
    import copy

    cfg = configs.load("micro").model
    torch.manual_seed(0)
    actor = Transformer(cfg)
    start = copy.deepcopy(actor)
    trajs = [_traj([(torch.randint(0, 200, (16,)).tolist(), [0] * 6 + [1] * 10)], reward=0.0, versions=1)
             for _ in range(4)]
    rows = layout(trajs)
    # rewards 0 and a zero-initialised critic that is never updated: every advantage is 0, so the KL term is the
    # only gradient
    tr = SAOTrainer(actor, SAOConfig(kl_coef=1.0, critic_updates=0, lr=3e-3, loss="tis"))
    with torch.no_grad():  # the actor drifts after the trainer took its reference
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    drifted = copy.deepcopy(actor)
    before = _token_gap(actor, start, rows.ids, rows.mask)
    for _ in range(3):
        st = tr.step(trajs, current_version=1)
    after = _token_gap(actor, start, rows.ids, rows.mask)
    assert st["updated"] and st["kl_ref"] > 0
    assert after < 0.6 * before, (before, after)
    for (n, p), q in zip(tr.ref.named_parameters(), start.parameters()):  # the reference never moves
        assert torch.equal(p, q), n
    # without the penalty the same batch has no gradient at all: no update, the drifted weights stay
    tr0 = SAOTrainer(drifted, SAOConfig(kl_coef=0.0, critic_updates=0, lr=3e-3, loss="tis"))
    w = copy.deepcopy(drifted.state_dict())
    assert not tr0.step(trajs, current_version=1)["updated"] and tr0.ref is None
    assert all(torch.equal(w[k], v) for k, v in drifted.state_dict().items())


def test_frozen_parameters_stay_and_the_rest_move():
    cfg = configs.load("micro").model
    torch.manual_seed(0)
    actor = Transformer(cfg)
    tr = SAOTrainer(actor, SAOConfig(frozen=["embed_tokens.*", "layers.*.self_attn.*"], critic_updates=1, lr=1e-3,
                                          loss="tis"))
    assert "embed_tokens.weight" in tr.frozen and "lm_head.weight" not in tr.frozen
    assert tr.critic.body.embed_tokens.weight.requires_grad  # the critic's copy is its own business
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    trajs = [_traj([(torch.randint(0, 200, (12,)).tolist(), [0] * 4 + [1] * 8)], reward=float(i % 2), versions=1)
             for i in range(4)]
    assert tr.step(trajs, current_version=1)["updated"]
    moved = {n for n, p in actor.named_parameters() if not torch.equal(p, before[n])}
    attn = {n for n in before if ".self_attn." in n}
    assert "embed_tokens.weight" not in moved and not moved & attn
    assert "lm_head.weight" in moved and any(".mlp." in n for n in moved)
    with pytest.raises(ValueError, match=r"sao.frozen: 'embed\.\*' matches no parameter"):
        SAOTrainer(Transformer(cfg), SAOConfig(frozen=["embed.*"]))


def _replay_kl(model, ref, trajs) -> tuple[float, int]:
    """Σ over the trajectories' policy tokens of KL(π_ref ‖ π) over the whole vocabulary, by hand, and the count."""
    total, n = 0.0, 0
    with torch.no_grad():
        for t in trajs:
            for s in t.segments:
                ids = torch.tensor([s.tokens])
                p = torch.softmax(ref(ids)[0].double(), -1)
                q = torch.log_softmax(model(ids)[0].double(), -1)
                for pos in range(1, len(s.tokens)):  # logits at pos − 1 predict token pos
                    if s.loss_mask[pos]:
                        total += float((p[pos - 1] * (p[pos - 1].log() - q[pos - 1])).sum())
                        n += 1
    return total, n


def test_replay_anchor_hand_computation_rows_in_turn_and_pull():
    import copy

    cfg = configs.load("micro").model
    torch.manual_seed(0)
    actor = Transformer(cfg)
    start = copy.deepcopy(actor)
    replay = [_traj([(torch.randint(0, 200, (n,)).tolist(), [0] * 5 + [1] * (n - 5))], reward=1.0, versions=1)
              for n in (12, 16, 9)]
    # the training batch: rewards 0 and a zero critic never updated, so every advantage is 0 and the anchor is the
    # only gradient
    trajs = [_traj([(torch.randint(0, 200, (14,)).tolist(), [0] * 6 + [1] * 8)], reward=0.0, versions=1)
             for _ in range(4)]
    beta = 1.0
    tr = SAOTrainer(actor, SAOConfig(replay_coef=beta, replay_rows=2, critic_updates=0, lr=3e-3, loss="tis"))
    assert tr.set_replay(replay) == sum(_replay_kl(start, start, [t])[1] for t in replay) == 7 + 11 + 4
    order = tr.replay_order
    assert sorted(order) == [0, 1, 2]  # a fixed shuffle of every row
    with torch.no_grad():  # the actor drifts after the trainer took its reference
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    before_all = _replay_kl(actor, start, replay)[0]
    # the gradient's scale: β × the token mean of the KL over step 0's rows, by autograd on an independent copy
    twin = copy.deepcopy(actor)
    picked = [replay[order[0]], replay[order[1]]]
    loss, n = 0.0, 0
    for t in picked:
        ids = torch.tensor([t.segments[0].tokens])
        p = torch.softmax(start(ids)[0, :-1].detach(), -1)
        q = torch.log_softmax(twin(ids)[0, :-1], -1)
        m = torch.tensor(t.segments[0].loss_mask[1:], dtype=torch.bool)
        loss = loss + (p[m] * (p[m].log() - q[m])).sum()
        n += int(m.sum())
    (beta * loss / n).backward()
    actor.zero_grad(set_to_none=True)
    tr._replay_backward()
    for (name, a), b in zip(actor.named_parameters(), twin.parameters()):
        if b.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7), name
    actor.zero_grad(set_to_none=True)
    # step k anchors rows order[2k], order[2k + 1] (mod 3): step 0 rows order[0], order[1]; step 1 order[2], order[0]
    for rows in ((0, 1), (2, 0)):
        kl, n = _replay_kl(actor, start, [replay[order[i]] for i in rows])
        st = tr.step(trajs, current_version=1)
        assert st["updated"] and st["replay_kl"] == pytest.approx(kl / n, rel=1e-4)
    for _ in range(3):
        tr.step(trajs, current_version=1)
    after_all = _replay_kl(actor, start, replay)[0]
    assert after_all < 0.6 * before_all, (before_all, after_all)
    # β = 0: no anchor, no rows, and the same batch makes no update
    tr0 = SAOTrainer(copy.deepcopy(start), SAOConfig(replay_coef=0.0, critic_updates=0, loss="tis"))
    assert tr0.set_replay(replay) == 0 and tr0.replay is None
    assert not tr0.step(trajs, current_version=1)["updated"]
    # the anchor never makes an update alone: GRPO groups that all tied stay no update, drift or not
    drifted = copy.deepcopy(actor)
    trg = SAOTrainer(drifted, SAOConfig(replay_coef=1.0, loss="grpo"))
    trg.set_replay(replay)
    with torch.no_grad():
        for p in drifted.parameters():
            p.add_(0.05 * torch.randn_like(p))
    w = copy.deepcopy(drifted.state_dict())
    st = trg.step([_traj([(t.segments[0].tokens, t.segments[0].loss_mask)], reward=1.0, versions=1, env=f"e{i // 2}")
                   for i, t in enumerate(trajs)], current_version=1)
    assert not st["updated"] and "replay_kl" not in st
    assert all(torch.equal(w[k], v) for k, v in drifted.state_dict().items())


def test_a_loop_asked_for_replay_without_rows_refuses():
    from envs import make_sandbox
    from envs.generator import generate
    from model import ByteTokenizer
    from rollout.agent import AgentConfig
    from trainers.loop import LoopConfig, RLLoop

    actor = Transformer(configs.load("micro").model)
    with pytest.raises(ValueError, match="sao.replay_coef is 1.0 but this loop has no replay rows"):
        RLLoop(actor, generate(["kv-lookup"], 2, seed=0), ByteTokenizer(), make_sandbox(), AgentConfig(),
               SAOConfig(replay_coef=1.0), LoopConfig(), replay=[])


def test_replay_anchor_holds_the_replayed_inputs_while_the_batch_moves():
    """With real advantages the actor moves on its batch; the anchor keeps its distribution on the replay rows near
    the start, and the batch still moves."""
    import copy

    cfg = configs.load("micro").model
    torch.manual_seed(1)
    base = Transformer(cfg)
    replay = [_traj([(torch.randint(0, 200, (16,)).tolist(), [0] * 6 + [1] * 10)], reward=1.0, versions=1)
              for _ in range(4)]
    trajs = [_traj([(torch.randint(0, 200, (14,)).tolist(), [0] * 6 + [1] * 8)], reward=float(i % 2), versions=1)
             for i in range(4)]
    drift, moved = {}, {}
    for beta in (0.0, 20.0):
        actor = copy.deepcopy(base)
        tr = SAOTrainer(actor, SAOConfig(replay_coef=beta, replay_rows=4, critic_updates=0, lr=3e-3, loss="tis"))
        tr.set_replay(replay)
        for _ in range(6):
            assert tr.step(trajs, current_version=1)["updated"]
        drift[beta] = _replay_kl(actor, base, replay)[0]
        moved[beta] = _replay_kl(actor, base, trajs)[0]
    assert drift[20.0] < 0.5 * drift[0.0], drift
    assert moved[20.0] > 0.2 * moved[0.0], moved


def test_grpo_normalises_each_group_over_the_whole_batch_on_every_rank():
    """Rank 1 of 2 holds trajectories 1 and 3 of a batch of two groups (x, x, y, y), one member of each: each of its
    advantages is its reward against its whole group's (here: ±1 by hand, a 0/1 pair per group), not against the
    fragment the rank holds (a one-member fragment would normalise to 0)."""
    def traj(j, env, reward):
        return Trajectory(f"t{j}", env, "f", "math", "h", "v", 0,
                          [Segment(list(range(1, 13)), [False] * 4 + [True] * 8, [-1.0] * 12, [0] * 12)], reward)

    batch = [traj(0, "x", 1.0), traj(1, "x", 0.0), traj(2, "y", 0.0), traj(3, "y", 1.0)]
    torch.manual_seed(0)
    sao = SAOTrainer(Transformer(configs.load("micro").model), SAOConfig(loss="grpo"))
    sao.backend.rank, sao.backend.world_size = 1, 2
    mine = sao._share(batch)
    assert [t.trajectory_id for t in mine] == ["t1", "t3"]
    rows = layout(mine)
    adv, _ = sao.advantages(mine, rows, batch)
    got = [float(adv[i][rows.mask[i]].unique()) for i in range(2)]
    assert got[0] < -0.9 and got[1] > 0.9 and got[0] == pytest.approx(-got[1])


def test_layout_pads_to_a_given_shape_with_rows_owned_by_no_trajectory():
    """Lockstep ranks (SAOTrainer._rows) lay their share out at the batch's shape: the segments' rows as without a
    shape, then rows of padding (pad ids, masked out, owner -1); a shape too small is an error."""
    def traj(j, n):
        return Trajectory(f"t{j}", "e", "f", "math", "h", "v", 0,
                          [Segment(list(range(1, n + 1)), [False] * 2 + [True] * (n - 2), [-1.0] * n, [0] * n)], 1.0)

    mine = [traj(0, 6), traj(1, 9)]
    plain, padded = layout(mine), layout(mine, shape=(4, 12))
    assert padded.ids.shape == (4, 12) and padded.owner == [0, 1, -1, -1] and padded.lengths == [6, 9, 12, 12]
    assert torch.equal(padded.ids[:2, :9], plain.ids) and torch.equal(padded.mask[:2, :9], plain.mask)
    assert not padded.mask[:, 9:].any() and not padded.mask[2:].any() and (padded.ids[2:] == 0).all()
    assert padded.counts == plain.counts == [[4], [7]]
    empty = layout([], shape=(2, 5))
    assert empty.owner == [-1, -1] and not empty.mask.any()
    with pytest.raises(ValueError, match="2 rows of up to 9 tokens do not fit 1 × 12"):
        layout(mine, shape=(1, 12))


def test_a_step_reads_advantages_from_the_critic_before_its_updates():
    """The step's advantages come from its first critic update's forward (no separate scoring pass): they must be
    the values of the critic as it was before any of the step's updates, the same bits a no-grad forward gives, and
    the returns the critic fits never read a value."""
    import copy

    cfg = configs.load("micro").model
    torch.manual_seed(0)
    tr = SAOTrainer(Transformer(cfg), SAOConfig(critic_updates=2, micro_rows=2, alpha=3.0, gamma=0.9))
    trajs = [_traj([(torch.randint(0, 200, (9 + 3 * i,)).tolist(), [0] * 4 + [1] * (5 + 3 * i))],
                   reward=float(i % 2), versions=3) for i in range(5)]
    tr.value_pretrain(trajs, steps=2)  # a critic whose values are not all zero (its head starts at zero)
    twin = copy.deepcopy(tr)
    rows = layout(trajs)
    want_adv, want_ret = twin.advantages(trajs, rows)  # a separate no-grad pass over the critic before the step
    got = {}
    real_adv, real_update = tr.advantages, tr._critic_update

    def advantages(*a, **k):
        got.setdefault("adv", []).append(real_adv(*a, **k))
        return got["adv"][-1]

    def update(rows_, ret, n, seen=None):
        got.setdefault("ret", []).append(ret.clone())
        return real_update(rows_, ret, n, seen)

    tr.advantages, tr._critic_update = advantages, update
    tr.step(trajs, current_version=3)
    assert torch.equal(got["adv"][-1][0], want_adv)  # the policy's advantages: the pre-update critic's, bit for bit
    assert len(got["ret"]) == 2 and all(torch.equal(r, want_ret) for r in got["ret"])
    assert not torch.equal(want_adv, twin.advantages(trajs, rows, values=torch.zeros(rows.ids.shape))[0])


def test_critic_micro_batches_by_length_give_every_row_its_padded_values():
    """The critic runs rows sorted by length, each micro-batch cut to its longest row: every row's values at its
    tokens are those of one padded forward of the whole batch (a causal model never reads the padding after a
    token), put back in the rows' order; the update's loss is the padded batch's."""
    cfg = configs.load("micro").model
    torch.manual_seed(1)
    tr = SAOTrainer(Transformer(cfg), SAOConfig(critic_updates=1, micro_rows=2))
    lens = [23, 7, 31, 12, 9, 18, 5]
    trajs = [_traj([(torch.randint(0, 200, (n,)).tolist(), [0] * 3 + [1] * (n - 3))], reward=float(i % 2),
                   versions=1) for i, n in enumerate(lens)]
    tr.value_pretrain(trajs, steps=2)
    rows = layout(trajs)
    batches = tr._micro_batches(rows)
    assert sorted(i for idx, _ in batches for i in idx.tolist()) == list(range(len(lens)))
    assert [w for _, w in batches] == [7, 12, 23, 31]  # (5, 7) (9, 12) (18, 23) (31)
    with torch.no_grad():
        padded = tr.critic(rows.ids)
        got = torch.zeros(rows.ids.shape)
        for idx, width in batches:
            got[idx, :width] = tr.critic(rows.ids[idx, :width])
    m = rows.mask
    torch.testing.assert_close(got[m], padded[m], rtol=1e-5, atol=1e-6)
    ret = tr._returns(trajs, rows)
    want = float(0.5 * (((padded - ret) ** 2) * m).sum() / m.sum())
    assert tr._critic_update(rows, ret, float(m.sum())) == pytest.approx(want, rel=1e-5)
