"""Tests that fail when training is broken: every expected value is computed independently (by hand, or from
plain torch formulas), never with the trainers' own helpers.

Each test names the bug it guards against: a wrong PPO clip direction, a TIS weight without its cap, a critic
reading the value at its own token, critic updates that ignore K, an unfrozen critic attention, a trainer that
never steps, an OPD advantage of the wrong sign, a stale sample kept.
"""

from __future__ import annotations

import copy

import pytest
import torch

import configs
from model import Transformer
from rollout.types import Segment, Trajectory
from trainers.opd import OPDTrainer
from trainers.rl_losses import LossConfig, policy_loss
from trainers.sao import Critic, SAOConfig, SAOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

MICRO = configs.load("micro").model


def _micro(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(MICRO)


def _traj(tokens, mask, versions, reward=1.0, logprobs=None, env="e", status="completed") -> Trajectory:
    """One-segment trajectory; `versions` per token (or one int for every trainable token), -1 elsewhere."""
    if isinstance(versions, int):
        versions = [versions if m else -1 for m in mask]
    lps = logprobs if logprobs is not None else [-1.0 if m else 0.0 for m in mask]
    return Trajectory("t", env, "f", "math", "h", "v", 0,
                      [Segment(list(tokens), [bool(m) for m in mask], list(lps), list(versions))], reward, status)


def _own_logprobs(trajs: list[Trajectory], model: Transformer) -> list[Trajectory]:
    """Record the model's own log-probs of the trainable tokens as the rollout log-probs (ratio 1: in the band)."""
    with torch.no_grad():
        for t in trajs:
            s = t.segments[0]
            ids = torch.tensor([s.tokens])
            lp = model(ids)[0, :-1].float().log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            s.logprobs = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp, s.loss_mask[1:])]
    return trajs


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _changed(before: dict, model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]


# ---- 1. PPO / GRPO clipped objective -----------------------------------------------------------------------

# ratio, advantage → PPO objective min(r·A, clip(r, 0.8, 1.2)·A) and its derivative w.r.t. log π (r·A where the
# unclipped term is the minimum, 0 where the clipped constant is), written out by hand for clip = 0.2
PPO_CASES = [  # (r, A, objective, d objective / d logp)
    (0.5, 2.0, 1.0, 1.0),  # A > 0, r below the range: unclipped (pessimistic) term, gradient flows
    (1.1, 2.0, 2.2, 2.2),  # inside the range
    (1.5, 2.0, 2.4, 0.0),  # A > 0, r above the range: clipped at 1.2·A, no gradient
    (0.5, -1.0, -0.8, 0.0),  # A < 0, r below the range: clipped at 0.8·A, no gradient
    (1.1, -1.0, -1.1, -1.1),  # inside the range
    (1.5, -1.0, -1.5, -1.5),  # A < 0, r above the range: unclipped (pessimistic) term, gradient flows
]


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_ppo_clip_value_and_gradient_by_hand(kind):
    roll = torch.log(torch.tensor([[0.3, 0.2, 0.1, 0.4, 0.25, 0.05, 0.5]]))
    ratios = [c[0] for c in PPO_CASES] + [3.0]
    logp = (roll + torch.log(torch.tensor([ratios]))).detach().requires_grad_(True)
    adv = torch.tensor([[c[1] for c in PPO_CASES] + [100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # the last token is not trainable
    n = 6
    loss, st = policy_loss(logp, roll, adv, mask, LossConfig(kind, clip=0.2))
    want_loss = -sum(c[2] for c in PPO_CASES) / n
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
    loss.backward()
    want_grad = [-c[3] / n for c in PPO_CASES] + [0.0]
    assert logp.grad[0].tolist() == pytest.approx(want_grad, rel=1e-5, abs=1e-6)
    assert st["clip_frac"] == pytest.approx(2 / n)  # the two tokens whose clipped constant was the minimum


# ---- 2. TIS cap ----------------------------------------------------------------------------------------------

def test_tis_weight_is_capped_gradient_by_hand():
    roll = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    ratios = torch.tensor([[3.0, 0.5, 1.0, 5.0]])
    logp = (roll + ratios.log()).detach().requires_grad_(True)
    adv = torch.tensor([[1.5, -2.0, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    cap, n = 2.0, 3
    loss, st = policy_loss(logp, roll, adv, mask, LossConfig("tis", tis_cap=cap))
    lp = logp.detach()[0].tolist()
    # weights min(r, C) = [2, 0.5, 1] (stop-gradient): loss = −Σ w·A·logp / N, d loss / d logp = −w·A / N
    want = -(cap * 1.5 * lp[0] + 0.5 * -2.0 * lp[1] + 1.0 * 1.0 * lp[2]) / n
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-cap * 1.5 / n, 0.5 * 2.0 / n, -1.0 / n, 0.0], rel=1e-5)
    assert st["clip_frac"] == pytest.approx(1 / n)


# ---- 3. the critic reads V(state before token p) -------------------------------------------------------------

def test_critic_value_is_the_state_before_each_token():
    actor = _micro(0)
    critic = Critic(actor)
    torch.manual_seed(1)
    with torch.no_grad():
        critic.head.weight.normal_(std=1.0)  # values that depend on the hidden state
        critic.head.bias.fill_(0.3)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 10), generator=g)
    with torch.no_grad():
        v = critic(ids)
        assert v.shape == (2, 10)
        assert torch.equal(v[:, 0], torch.zeros(2))  # nothing seen yet: no state, value 0
        for p in (1, 2, 5, 9):
            # the state after seeing exactly the tokens < p, computed on the prefix alone
            h = critic.body.norm(critic.body.run(ids[:, :p], logits=False).hidden)[:, -1]
            want = h @ critic.head.weight[0] + critic.head.bias[0]
            torch.testing.assert_close(v[:, p], want, atol=1e-5, rtol=1e-4)
        # causality: token p changes the values from p + 1 on, never v[:, ≤ p]
        for p in (3, 7):
            other = ids.clone()
            other[:, p] = (other[:, p] + 17) % 256
            w = critic(other)
            torch.testing.assert_close(w[:, : p + 1], v[:, : p + 1], atol=1e-6, rtol=0)
            assert (w[:, p + 1] - v[:, p + 1]).abs().max() > 1e-4


# ---- 4. K critic updates -------------------------------------------------------------------------------------

def _batch(n_rows=3, length=12, n_prompt=4, seed=0, versions=0, rewards=None):
    g = torch.Generator().manual_seed(seed)
    rewards = rewards or [float(i % 2) for i in range(n_rows)]
    return [_traj(torch.randint(0, 256, (length,), generator=g).tolist(), [0] * n_prompt + [1] * (length - n_prompt),
                  versions, reward=rewards[i]) for i in range(n_rows)]


@pytest.mark.parametrize("k", [1, 3])
def test_critic_takes_k_updates_matching_a_hand_replica(k):
    trajs = _batch(rewards=[1.0, 0.0, 0.5])
    actor = _micro(0)
    critic = Critic(actor)
    with torch.no_grad():  # a nonzero head, so the body gets gradient from the first update on
        critic.head.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(critic)
    tr = SAOTrainer(actor, SAOConfig(critic_updates=k, critic_lr=1e-3, grad_clip=1.0), critic=critic)
    calls = []
    step = tr.copt.step
    tr.copt.step = lambda *a, **kw: (calls.append(1), step(*a, **kw))[1]
    tr.step(trajs, current_version=0)
    assert len(calls) == k

    # the same K updates by hand: 0.5·mean over trainable tokens of (V − R)², R = the reward (γ = 1), AdamW
    ids = torch.tensor([t.segments[0].tokens for t in trajs])
    mask = torch.tensor([t.segments[0].loss_mask for t in trajs])
    mask[:, 0] = False
    target = torch.tensor([t.reward for t in trajs])[:, None].expand_as(ids)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    for _ in range(k):
        opt.zero_grad()
        loss = 0.5 * (((ref(ids) - target) ** 2) * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    for (name, p), q in zip(critic.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# ---- 5. frozen critic attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("freeze", [True, False])
def test_critic_attention_frozen_only_when_asked(freeze):
    trajs = _batch(rewards=[1.0, 0.0, 1.0])
    tr = SAOTrainer(_micro(0), SAOConfig(critic_updates=3, critic_lr=1e-3, freeze_critic_attention=freeze))
    body = tr.critic.body
    before = _params(tr.critic)
    tr.step(trajs, current_version=0)
    changed = set(_changed(before, tr.critic))
    attn = [f"body.layers.{i}.self_attn.{n}" for i, layer in enumerate(body.layers)
            for n, _ in layer.self_attn.named_parameters()]
    mlp = [f"body.layers.{i}.mlp.{n}" for i, layer in enumerate(body.layers) for n, _ in layer.mlp.named_parameters()]
    assert attn and mlp
    assert {"head.weight", "head.bias"} <= changed
    assert any(n in changed for n in mlp)  # the rest of the body learns
    attn_changed = [n for n in attn if n in changed]
    if freeze:
        assert attn_changed == []  # bit-identical
    else:
        assert len(attn_changed) > 0


# ---- 6. the trainer steps --------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", ["sao", "grpo"])
def test_step_with_signal_changes_the_actor(loss):
    trajs = _batch(n_rows=4, rewards=[1.0, 0.0, 1.0, 0.0])
    for i, t in enumerate(trajs):
        t.env_id = f"g{i // 2}"  # GRPO groups of two with unequal rewards
    tr = SAOTrainer(_micro(0), SAOConfig(loss=loss, critic_updates=1, lr=1e-3))
    _own_logprobs(trajs, tr.actor)
    before = _params(tr.actor)
    st = tr.step(trajs, current_version=0)
    assert st["updated"] is True and tr.steps == 1
    assert _changed(before, tr.actor)


def test_step_without_signal_or_with_only_stale_samples_changes_nothing():
    # GRPO, every group of equal rewards: every advantage is 0
    trajs = _batch(n_rows=4, rewards=[1.0, 1.0, 0.0, 0.0])
    for i, t in enumerate(trajs):
        t.env_id = f"g{i // 2}"
    tr = SAOTrainer(_micro(0), SAOConfig(loss="grpo", lr=1e-3))
    before = _params(tr.actor)
    st = tr.step(trajs, current_version=0)
    assert st["updated"] is False and tr.steps == 0 and _changed(before, tr.actor) == []
    # SAO, τ = 1, a batch generated entirely at version 0 and trained at version 5: all dropped, no update
    sao = SAOTrainer(_micro(0), SAOConfig(staleness=1, critic_updates=1, lr=1e-3))
    before, cbefore = _params(sao.actor), _params(sao.critic)
    st = sao.step(_batch(rewards=[1.0, 0.0, 1.0]), current_version=5)
    assert st["updated"] is False and st["dropped_stale"] == 3 and st["trajectories"] == 0
    assert _changed(before, sao.actor) == [] and _changed(cbefore, sao.critic) == []


# ---- 7. OPD lowers the reverse KL to the teacher ---------------------------------------------------------------

class StubPool:
    def __init__(self, teacher):
        self.teacher = teacher

    def score_batches(self, batches, fn):
        return [fn(self.teacher, rows) for _, rows in batches]


def _log_ratio(student, teacher, ids, mask) -> torch.Tensor:
    """log π_student(y_p) − log π_teacher(y_p) on the trainable tokens y_p, from the two models' logits."""
    with torch.no_grad():
        ls = student(ids)[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        lt = teacher(ids)[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        return (ls - lt)[mask[:, 1:]]


def test_opd_steps_lower_reverse_kl_to_the_teacher():
    """OPD on a fixed batch of the student's own samples. At the start, the mean of log π_s − log π_t over those
    tokens is the Monte-Carlo estimate of the reverse KL(π_s ‖ π_t); the update Â·∇log π_s with
    Â = log π_t − log π_s is gradient descent on ½·Σ(log π_s − log π_t)² over the batch, so both the estimate and
    the squared log-ratio must fall (a flipped sign makes both grow)."""
    from trainers.config import OPDConfig

    student = _micro(0)
    teacher = _micro(5)
    with torch.no_grad():  # a teacher with a sharper, different next-token distribution
        teacher.lm_head.weight.mul_(3.0)
    g = torch.Generator().manual_seed(4)
    n_rows, n_prompt, length = 6, 3, 14
    ids = torch.randint(0, 256, (n_rows, n_prompt), generator=g)
    with torch.no_grad():  # the continuation is sampled from the student itself
        for _ in range(length - n_prompt):
            probs = student(ids)[:, -1].float().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
    mask = torch.zeros(n_rows, length, dtype=torch.bool)
    mask[:, n_prompt:] = True
    trajs = _own_logprobs([_traj(ids[i].tolist(), mask[i].tolist(), 0, reward=0.0) for i in range(n_rows)], student)
    tr = OPDTrainer(student, StubPool(teacher), OPDConfig(lr=2e-3))
    d = _log_ratio(student, teacher, ids, mask)
    est, sq = [float(d.mean())], [float((d * d).mean())]
    assert est[0] > 0.05  # the student starts measurably far from the teacher
    for _ in range(4):
        st = tr.step(trajs)
        d = _log_ratio(student, teacher, ids, mask)
        est.append(float(d.mean()))
        sq.append(float((d * d).mean()))
    assert st["trajectories"] == n_rows and st["tokens"] == n_rows * (length - n_prompt)
    assert est[1] < est[0] and abs(est[-1]) < 0.5 * est[0], est
    assert all(b < a for a, b in zip(sq, sq[1:])) and sq[-1] < 0.25 * sq[0], sq


# ---- 8. staleness bound in policy versions ----------------------------------------------------------------------

def test_staleness_bound_uses_the_oldest_generated_token():
    tau, v = 2, 10
    tr = SAOTrainer(_micro(0), SAOConfig(staleness=tau, critic_updates=0))
    toks, mask = [1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 1]
    at_bound = _traj(toks, mask, [-1, v - tau, v, -1, v, v])  # oldest token exactly τ versions behind: kept
    too_old = _traj(toks, mask, [-1, v - tau - 1, v, -1, v, v])  # one version more: dropped
    all_old = _traj(toks, mask, [-1, v - tau - 1, v - tau - 1, -1, v - tau - 1, v - tau - 1])
    fresh = _traj(toks, mask, [-1, v, v, -1, v, v])
    # a prompt / observation token (version −1, not generated) never makes a sample stale
    obs_old = _traj(toks, mask, [v - 50, v - 1, v, v - 50, v, v])
    assert tr.select([at_bound], v) == [at_bound]
    assert tr.select([too_old], v) == []
    assert tr.select([all_old], v) == []
    assert tr.select([fresh, obs_old], v) == [fresh, obs_old]
    assert tr.dropped["stale"] == 2
    # τ = 0: only samples of the current version
    tr0 = SAOTrainer(_micro(0), SAOConfig(staleness=0, critic_updates=0))
    assert tr0.select([fresh], v) == [fresh] and tr0.select([_traj(toks, mask, v - 1)], v) == []
    # through a full step: the stale sample is counted and not trained on
    st = tr.step([at_bound, too_old], v)
    assert st["trajectories"] == 1 and st["dropped_stale"] == 3


# ---- 9. several updates per batch ------------------------------------------------------------------------------

def test_sao_epochs_are_updates_on_one_batch_under_one_policy_version():
    """`epochs=E` takes E actor updates on one batch (ratio against the rollout log-probs each time) and makes one
    policy version: the weights equal E single-epoch steps on the same batch (GRPO: advantages from the rewards
    alone, so nothing else changes between the calls)."""
    def batch():
        trajs = _batch(n_rows=4, rewards=[1.0, 0.0, 0.0, 1.0])
        for i, t in enumerate(trajs):
            t.env_id = f"g{i // 2}"
        return trajs

    one, three = _micro(0), _micro(0)
    a = SAOTrainer(one, SAOConfig(loss="grpo", lr=1e-4))
    b = SAOTrainer(three, SAOConfig(loss="grpo", lr=1e-4, epochs=3))
    trajs = _own_logprobs(batch(), one)
    for _ in range(3):
        a.step(trajs, current_version=0)
    st = b.step(trajs, current_version=0)
    assert st["updated"] is True and b.steps == 1 and a.steps == 3
    assert all(s["step"] == 3 for s in b.opt.state.values())
    for (name, p), q in zip(one.named_parameters(), three.parameters()):
        assert torch.equal(p, q), name
    assert st["clip_frac_last"] >= 0.0 and "ratio_mean_last" in st  # the last pass's band, beside the first's


def test_opd_epochs_score_once_and_equal_single_steps():
    from trainers.config import OPDConfig

    class Counting(StubPool):
        calls = 0

        def score_batches(self, batches, fn):
            Counting.calls += 1
            return super().score_batches(batches, fn)

    teacher = _micro(5)
    trajs = _batch(n_rows=3, rewards=[0.0, 0.0, 0.0])
    s1, s2 = _micro(0), _micro(0)
    _own_logprobs(trajs, s1)
    a = OPDTrainer(s1, StubPool(teacher), OPDConfig(lr=1e-3))
    b = OPDTrainer(s2, Counting(teacher), OPDConfig(lr=1e-3, epochs=2))
    a.step(trajs)
    a.step(trajs)
    st = b.step(trajs)
    assert Counting.calls == 1 and b.steps == 1 and st["reverse_kl_last"] != st["reverse_kl"]  # measured after the first update
    for (name, p), q in zip(s1.named_parameters(), s2.parameters()):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


# ---- 9. the OPD student's merged start (task arithmetic) --------------------------------------------------------

def test_merge_experts_adds_each_experts_delta_by_hand():
    """θ = θ_base + s·Σ(θ_e − θ_base), written out per element; integer buffers stay the base's; dtypes kept."""
    from trainers.opd import merge_experts

    base = {"w": torch.tensor([1.0, 2.0, 3.0]), "h": torch.tensor([0.5], dtype=torch.bfloat16),
            "n": torch.tensor([7])}
    e1 = {"w": torch.tensor([2.0, 2.0, 3.0]), "h": torch.tensor([1.5], dtype=torch.bfloat16), "n": torch.tensor([9])}
    e2 = {"w": torch.tensor([1.0, 5.0, 1.0]), "h": torch.tensor([0.5], dtype=torch.bfloat16), "n": torch.tensor([1])}
    got = merge_experts(base, iter([e1, e2]))
    assert got["w"].tolist() == [2.0, 5.0, 1.0]  # 1+1+0, 2+0+3, 3+0-2
    assert got["h"].dtype == torch.bfloat16 and got["h"].item() == 1.5
    assert got["n"].tolist() == [7]
    half = merge_experts(base, [e1, e2], scale=0.5)
    assert half["w"].tolist() == [1.5, 3.5, 2.0]
    assert base["w"].tolist() == [1.0, 2.0, 3.0]  # the inputs are left alone
    with pytest.raises(ValueError, match="keys differ.*extra"):
        merge_experts(base, [{**e1, "extra": torch.zeros(1)}])
    with pytest.raises(ValueError, match="w has shape"):
        merge_experts(base, [{**e1, "w": torch.zeros(4)}])
    with pytest.raises(ValueError, match="no experts"):
        merge_experts(base, [])


def test_opd_stage_starts_from_the_merged_experts(tmp_path):
    """With `opd.init=merged` and no OPD steps the student is exactly the warm start plus both experts' deltas;
    a skipped domain (its expert is the warm start itself) adds nothing; `warm_start` keeps the warm start."""
    import stages
    from envs.dataset import write_dataset
    from envs.generator import generate
    from model import load_checkpoint, save_checkpoint

    warm, experts = _micro(0), {}
    save_checkpoint(warm, tmp_path / "warm")
    for i, dom in enumerate(["math", "code"]):
        e = copy.deepcopy(warm)
        with torch.no_grad():
            for p in e.parameters():
                p.add_(torch.randn_like(p) * 0.01 * (i + 1))
        save_checkpoint(e, tmp_path / dom)
        experts[dom] = str(tmp_path / dom)
    experts["reasoning"] = str(tmp_path / "warm")  # skipped: the warm start is its teacher
    write_dataset(generate(["calc-chain?horizon=1"], 2, 5), tmp_path / "rl")
    envs = {"train": None, "rl": str(tmp_path / "rl")}
    want = {k: v.clone() for k, v in warm.state_dict().items()}
    for dom in ("math", "code"):
        for k, v in load_checkpoint(experts[dom]).state_dict().items():
            if v.is_floating_point():
                want[k] += v - warm.state_dict()[k]
    for init in ("merged", "warm_start"):
        cfg = configs.load("micro", ["opd.steps=0", f"opd.init={init}"])
        out = stages.opd_student(cfg, str(tmp_path / "warm"), experts, envs, tmp_path / f"s-{init}")
        got = load_checkpoint(out["checkpoint"]).state_dict()
        ref = want if init == "merged" else warm.state_dict()
        assert out["init"] == init
        assert out["merged_from"] == (sorted([experts["code"], experts["math"]]) if init == "merged" else [])
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-6, msg=k)


def test_opd_anchors_a_domain_with_no_expert_to_the_warm_start(tmp_path):
    """`opd.untaught=warm_start`: the student (merged from a code expert that also moved everything else) samples
    math too, and the warm start scores it there: the reverse KL of the first batch is positive and the student
    moves. With `untaught=none` it samples only code, whose teacher is the student itself: a reverse KL of exactly
    0 at every step and no change to any weight. Guards against the anchor's teacher being the expert, and against
    the anchored domain never being sampled."""
    import stages
    from envs.dataset import write_dataset
    from envs.generator import generate
    from model import load_checkpoint, save_checkpoint

    warm = _micro(0)
    save_checkpoint(warm, tmp_path / "warm")
    code = copy.deepcopy(warm)
    with torch.no_grad():
        for p in code.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_checkpoint(code, tmp_path / "code")
    write_dataset(generate(["calc-chain?horizon=1", "set-const?horizon=1"], 4, 5), tmp_path / "rl")
    envs = {"train": None, "rl": str(tmp_path / "rl")}
    before = _params(code)
    for untaught in ("warm_start", "none"):
        cfg = configs.load("micro", ["opd.steps=2", "opd.init=merged", f"opd.untaught={untaught}",
                                     "agent.max_action_tokens=8"])
        out = stages.opd_student(cfg, str(tmp_path / "warm"), {"code": str(tmp_path / "code")}, envs,
                                 tmp_path / f"s-{untaught}")
        assert out["teachers"] == {"code": str(tmp_path / "code")} and out["steps"] == 2
        assert out["anchored"] == (["math"] if untaught == "warm_start" else [])
        moved = _changed(before, load_checkpoint(out["checkpoint"]))
        if untaught == "none":
            assert out["reverse_kl"] == [0.0, 0.0] and moved == []
        else:
            assert out["reverse_kl"][0] > 1e-3 and len(moved) > 10
    # a state saved with the anchor does not resume without it (its task cursor counts another task list)
    with pytest.raises(ValueError, match=r"warm start teaching math, this run has it teach nothing \(opd.untaught"):
        stages.opd_student(cfg, str(tmp_path / "warm"), {"code": str(tmp_path / "code")}, envs,
                           tmp_path / "s-warm_start")
