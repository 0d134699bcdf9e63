"""Tests for the mutations of the trainers that survived the last round (issue 43): each expected value is a hand
computation or a plain-torch formula written here, never the trainers' own helpers.

* GAE with γ ≠ 1 (γ dropped from the TD step or from the trace), in `gae` and through SAO's trainer;
* OPD's token-level averaging, its band's upper edge and its outcome baseline (unequal rows, α ≠ 0);
* the clamp(max=1) of the fp32 main-gradient clip;
* the push schedule with push_every > 1 (and the admission bound that reads it);
* the LM trainer's MTP loss weight, its indexer-KL gradient, its lr warm-up and the dense indexer warm-up;
* `compare()` pairing the pooled group in the other run's order.
(The converters' layouts of the dense `linear_fc2` and the indexer's `weights_proj` are in test_megatron.py's
`test_convert_shard_layout_by_hand`.)
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import configs
from model import Transformer
from rollout.types import Segment, Trajectory
from trainers.advantages import gae, returns
from trainers.backends import TorchBackend
from trainers.config import OPDConfig, TrainConfig
from trainers.opd import OPDTrainer
from trainers.sao import SAOConfig, SAOTrainer, layout

pytestmark = pytest.mark.usefixtures("one_thread")

MICRO = configs.load("micro").model


def _micro(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(MICRO)


def _traj(segments, reward=1.0, logprobs=None, env="e") -> Trajectory:
    """Segments of (tokens, mask); versions 0 on trainable tokens; rollout log-probs -1 there unless given."""
    segs = []
    for k, (toks, mask) in enumerate(segments):
        lps = logprobs[k] if logprobs is not None else [-1.0 if m else 0.0 for m in mask]
        segs.append(Segment(list(toks), [bool(m) for m in mask], list(lps), [0 if m else -1 for m in mask]))
    return Trajectory("t", env, "f", "math", "h", "v", 0, segs, reward, "completed")


def _hand_gae(v: list[float], reward: float, gamma: float, lam: float) -> list[float]:
    """δ_i = r_i + γ·V_{i+1} − V_i (V_N = 0, r = R at the end), A_i = δ_i + γλ·A_{i+1}: written out here."""
    n, adv, running = len(v), [0.0] * len(v), 0.0
    for i in reversed(range(n)):
        delta = (reward if i == n - 1 else 0.0) + gamma * (v[i + 1] if i + 1 < n else 0.0) - v[i]
        running = delta + gamma * lam * running
        adv[i] = running
    return adv


# ---- GAE, γ ≠ 1 ---------------------------------------------------------------------------------------------------
def test_gae_with_a_discount_by_hand():
    v = torch.tensor([0.5, 0.2, 0.1])
    # γ = 0.9, λ = 0.5: δ = [0.9·0.2 − 0.5, 0.9·0.1 − 0.2, 1 − 0.1] = [−0.32, −0.11, 0.9]; γλ = 0.45
    # A₂ = 0.9, A₁ = −0.11 + 0.45·0.9 = 0.295, A₀ = −0.32 + 0.45·0.295 = −0.18725
    torch.testing.assert_close(gae(v, 1.0, gamma=0.9, lam=0.5), torch.tensor([-0.18725, 0.295, 0.9]))
    # λ = 1: A_i = γ^(N−1−i)·R − V_i (the discounted return minus the value)
    torch.testing.assert_close(gae(v, 2.0, gamma=0.8, lam=1.0), torch.tensor([0.8**2 * 2 - 0.5, 0.8 * 2 - 0.2, 2 - 0.1]))
    torch.testing.assert_close(returns(3, 2.0, gamma=0.8), torch.tensor([1.28, 1.6, 2.0]))


class _ValueTable(torch.nn.Module):
    """A critic whose value at a position is a fixed function of the token there."""

    def __init__(self, table):
        super().__init__()
        self.table, self.p = table, torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return self.table[ids] + 0 * self.p


def test_sao_advantages_and_returns_carry_the_discount_across_observations_and_segments():
    table = torch.zeros(MICRO.vocab_size)
    table[10], table[11], table[12], table[13] = 0.4, 0.3, 0.2, 0.1
    alpha, gamma = 2.0, 0.8
    tr = SAOTrainer(_micro(), SAOConfig(alpha=alpha, gamma=gamma), critic=_ValueTable(table))
    # prompt 1 2 | action 10 11 | observation 5 5 ; after compaction: prompt 1 | action 12 13
    t = _traj([([1, 2, 10, 11, 5, 5], [0, 0, 1, 1, 0, 0]), ([1, 12, 13], [0, 1, 1])], reward=1.5)
    rows = layout([t])
    adv, ret = tr.advantages([t], rows)
    lam = 1 - 1 / (alpha * 4)  # length-adaptive λ over the 4 trainable tokens: 0.875
    want = _hand_gae([0.4, 0.3, 0.2, 0.1], 1.5, gamma, lam)
    torch.testing.assert_close(adv[0][rows.mask[0]], torch.tensor(want[:2]))
    torch.testing.assert_close(adv[1][rows.mask[1]], torch.tensor(want[2:]))
    torch.testing.assert_close(ret[rows.mask], torch.tensor([1.5 * gamma**k for k in (3, 2, 1, 0)]))


# ---- OPD ----------------------------------------------------------------------------------------------------------
class _StubPool:
    def __init__(self, teacher):
        self.teacher = teacher

    def score_batches(self, batches, fn):
        return [fn(self.teacher, rows) for _, rows in batches]


class _GradRecorder(TorchBackend):
    """The torch backend, keeping each step's gradients (after the clip) and not stepping."""

    def __init__(self):
        super().__init__()
        self.grads: list[dict[str, torch.Tensor]] = []
        self.model: torch.nn.Module | None = None

    def step(self, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """log π(token p | prefix) of one row at p ≥ 1 (plain torch on the model's logits)."""
    x = torch.tensor([ids])
    return model(x)[0, :-1].float().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]


def test_opd_step_is_the_token_mean_of_the_banded_reverse_kl_plus_outcome_signal():
    """Three rows of 9, 14 and 6 trainable tokens, rewards 1 / 0 / 0.25, α = 0.5, band (0.3, 2): the step's gradient
    is that of −(1/N)·Σ over every trainable token of the batch of keep·r·Â·log π, with Â = sg[log π_t − log π]
    + α·(R − mean R) and keep = 1 for r inside the open band. Rollout log-probs put one token at r = 2.5 (above the
    upper edge, below 1 + 2) and one at r = 0.25 (below the lower edge): both are out; one at r = 1.6 and one at
    r = 0.5 (below 1 − 0.3) stay in."""
    student, teacher = _micro(0), _micro(5)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(2.0)
    g = torch.Generator().manual_seed(7)
    specs = [(3, 9, 1.0), (2, 14, 0.0), (4, 6, 0.25)]  # (prompt tokens, trainable tokens, reward)
    trajs, rows_ids = [], []
    for n_prompt, n_train, reward in specs:
        ids = torch.randint(0, 256, (n_prompt + n_train,), generator=g).tolist()
        mask = [0] * n_prompt + [1] * n_train
        with torch.no_grad():
            lp = [0.0] + _logprobs(student, ids).tolist()
        trajs.append((ids, mask, lp, reward))
        rows_ids.append(ids)
    ratios = {(0, 5): 2.5, (1, 7): 0.25, (2, 6): 1.6, (1, 9): 0.5}  # (row, token): π_θ / π_rollout
    for (i, p), r in ratios.items():
        trajs[i][2][p] -= math.log(r)
    batch = [_traj([(ids, mask)], reward, logprobs=[lp]) for ids, mask, lp, reward in trajs]
    alpha, cfg = 0.5, OPDConfig(band_low=0.3, band_high=2.0, outcome_alpha=0.5, grad_clip=1e9, lr=1e-3)
    backend = _GradRecorder()
    ref = copy.deepcopy(student)
    backend.model = student
    st = OPDTrainer(student, _StubPool(teacher), cfg, backend=backend).step(batch)
    assert st["tokens"] == 29.0
    # the same gradient by hand
    mean_r = sum(r for *_, r in specs) / 3
    total, n = 0.0, 29
    for ids, mask, lp_roll, reward in trajs:
        lp = _logprobs(ref, ids)
        with torch.no_grad():
            tlp = _logprobs(teacher, ids)
        m = torch.tensor(mask[1:], dtype=torch.bool)
        r = (lp.detach() - torch.tensor(lp_roll[1:])).exp()
        keep = ((r > 0.3) & (r < 2.0)).float()
        adv = (tlp - lp).detach() + alpha * (reward - mean_r)
        total = total - (keep * r * adv * lp)[m].sum() / n
    total.backward()
    kept = {k: r for k, r in ratios.items() if 0.3 < r < 2.0}
    assert list(kept) == [(2, 6), (1, 9)]  # (what the band does to the three marked tokens)
    got = backend.grads[0]
    for name, p in ref.named_parameters():
        if p.grad is not None and p.grad.abs().max() > 0:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert len(got) > 20


# ---- the fp32 main-gradient clip ------------------------------------------------------------------------------------
def test_the_main_gradient_clip_only_ever_shrinks():
    from trainers.optim import keep_main_grads

    net = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    keep_main_grads(net.parameters())
    w = net.weight
    w.main_grad = torch.tensor([[3.0, 4.0]])  # norm 5
    assert float(TorchBackend().clip_grad_norm(net, 10.0)) == pytest.approx(5.0)
    assert torch.equal(w.main_grad, torch.tensor([[3.0, 4.0]]))  # under the bound: unchanged, not scaled up to it
    assert float(TorchBackend().clip_grad_norm(net, 1.0)) == pytest.approx(5.0)
    torch.testing.assert_close(w.main_grad, torch.tensor([[0.6, 0.8]]), rtol=1e-5, atol=0)  # × 1 / (5 + 1e-6)


# ---- the push schedule ------------------------------------------------------------------------------------------------
def _stub_loop(push_every: int, updated: list[bool], mode: str = "sync"):
    """An RLLoop on the micro actor whose batches and trainer steps are stubs: only its schedule runs (the pushes go
    to its real in-process engine)."""
    from envs import make_sandbox
    from envs.generator import generate
    from model import ByteTokenizer
    from rollout.agent import AgentConfig
    from trainers.loop import LoopConfig, RLLoop

    agent = AgentConfig(system_prompt="x", max_context=128, max_action_tokens=4, max_total_tokens=8, max_obs_tokens=8,
                        compact_margin=0)
    loop = RLLoop(_micro(), generate(["kv-lookup"], 2, seed=3), ByteTokenizer(), make_sandbox(), agent,
                  SAOConfig(value_pretrain_steps=0, staleness=1), LoopConfig(mode=mode, batch_size=2, push_every=push_every))
    steps = iter(updated)
    batch = [_traj([([1, 2, 3], [0, 1, 1])]) for _ in range(2)]
    loop._collect = lambda ahead=None: list(batch)

    def step(b, version):
        loop.trainer.outcomes = []
        return {"updated": next(steps)}

    loop.trainer.step = step
    return loop


def test_push_every_three_pushes_after_every_third_step_that_follows_an_update():
    # updates at steps 0 and 6 only; push_every = 3: the boundary after step 2 pushes (one update since the last
    # push), the one after step 5 does not (none since), the one after step 8 does
    updated = [True, False, False, False, False, False, True, False, False]
    loop = _stub_loop(3, updated)
    hist = loop.run(len(updated))
    assert [i for i, h in enumerate(hist) if "push" in h] == [2, 8]
    assert [h["version"] for h in hist] == [0, 0, 1, 1, 1, 1, 1, 1, 2]
    assert [p["version"] for p in loop.pushes] == [1, 2] and loop.backend.engine.version == 2
    # two updates between boundaries make one version, not two
    loop = _stub_loop(2, [True, True, True, False])
    hist = loop.run(4)
    assert [h["version"] for h in hist] == [0, 1, 1, 2] and len(loop.pushes) == 2


def test_admission_bound_counts_push_every_steps_per_version():
    """(d + τ·push_every + 1)·B episodes may have started after d finished batches: with push_every = 2, τ = 1,
    B = 2 and d = 3 that is (3 + 2 + 1)·2 = 12."""
    loop = _stub_loop(2, [], mode="async")
    loop._batches_done = 3
    assert loop._admission_limit() == 12
    loop.backend.close()


# ---- the LM trainer ------------------------------------------------------------------------------------------------
def test_lm_step_gradient_is_lm_plus_weighted_mtp_plus_the_indexer_kl_on_the_indexer_alone():
    """One LMTrainer step's gradient against one computed here: CE(next token) + 0.3 · CE(MTP, the token after) +
    KL(indexer), the KL on the indexer with its input detached (so no trunk weight gets the KL's gradient; in sparse
    mode the indexer gets no other). 48 tokens > index_topk = 32: sparse attention."""
    from trainers.lm import LMTrainer

    model = _micro(3)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) < 0.7
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9, mtp_loss_weight=0.3, mtp_train_steps=1,
                      router_bias_rate=0.0)
    tr = LMTrainer(model, cfg)
    got = {}
    tr.opt.step = lambda: got.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    tr.step(ids, mask)

    from model.losses import indexer_kl_loss

    ref.train()
    out = ref.run(ids, collect_indexer=True, detach_indexer_input=True)
    m1, m2 = mask[:, 1:].float(), mask[:, 2:].float()
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(m1)
    lm = (ce * m1).sum() / m1.sum()
    mlog, _ = ref.mtp(out.hidden[:, :-1], ids[:, 1:], 0)
    mce = F.cross_entropy(mlog[:, :-1].flatten(0, 1), ids[:, 2:].flatten(), reduction="none").view_as(m2)
    mtp = (mce * m2).sum() / m2.sum()
    kl = indexer_kl_loss(out.indexer_stats)
    (lm + 0.3 * mtp + kl).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-7, msg=n)
    idx = [n for n in want if ".indexer." in n]
    assert idx and all(want[n].abs().max() > 0 for n in idx)  # the indexer learns, from the KL alone


def test_lm_warmup_and_cosine_schedule_by_hand():
    from trainers.lm import LMTrainer

    tr = LMTrainer(_micro(), TrainConfig(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1))
    assert [tr.lr_at(s, 0.0) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert tr.lr_at(4, 0.0) == pytest.approx(1e-3)
    assert tr.lr_at(9, 0.5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way down the cosine
    assert tr.lr_at(20, 1.0) == pytest.approx(1e-4)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    assert [tr.step(ids).lr for _ in range(2)] == pytest.approx([2.5e-4, 5e-4])  # what the steps really use
    assert tr.opt.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_dense_indexer_warmup_moves_only_the_indexer_by_adamws_first_step():
    """AdamW's first step is p ← p·(1 − lr·wd) − lr·g/(|g| + ε) (its moments are g and g², bias-corrected): after
    one warm-up step each indexer weight is that, with g the gradient of the dense KL computed here; every other
    weight is where it was, holds no gradient, and is trainable again."""
    from model.losses import indexer_kl_loss
    from trainers.lm import dense_indexer_warmup

    model = _micro(4)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lr = 1e-3
    dense_indexer_warmup(model, iter([ids]), steps=1, lr=lr)
    out = ref.run(ids, dense=True, collect_indexer=True, logits=False)
    indexer_kl_loss(out.indexer_stats).backward()
    wd = torch.optim.AdamW([torch.zeros(1)]).defaults["weight_decay"]
    moved = 0
    for n, p in model.named_parameters():
        assert p.requires_grad, n
        if ".indexer." not in n:  # frozen during the warm-up: not moved, and no gradient left behind for a later step
            assert torch.equal(p.detach(), before[n]) and p.grad is None, n
            continue
        g = dict(ref.named_parameters())[n].grad
        if g is None:  # the MTP layer's indexer: not in the main forward, no gradient, no step
            assert torch.equal(p.detach(), before[n]), n
            continue
        want = before[n] * (1 - lr * wd) - lr * g / (g.abs() + 1e-8)
        sure = g.abs() > 1e-6  # where |g| ≫ ε the step is ±lr exactly
        torch.testing.assert_close(p.detach()[sure], want[sure], rtol=0, atol=1e-7, msg=n)
        moved += int(sure.sum())
    assert moved > 100


# ---- compare() -----------------------------------------------------------------------------------------------------
def test_compare_pools_each_group_with_its_own_pairs_whatever_the_dict_order():
    """Three groups in three orders (sorted, the first run's, the second run's), with outcomes such that pooling them
    in any two different orders gives other counts than pooling each task with itself."""
    from trainers.stats import compare

    before = {"reasoning": [0, 0, 1, 1], "code": [1, 0, 0], "math": [1, 1, 0, 1, 1]}
    after = {"math": [0, 0, 1, 0, 1], "reasoning": [1, 1, 1, 0], "code": [0, 1, 1]}
    out = compare(before, after)
    flips = {g: (out[g]["test"]["gained"], out[g]["test"]["lost"], out[g]["test"]["both"]) for g in before}
    assert flips == {"math": (1, 3, 1), "reasoning": (2, 1, 1), "code": (2, 1, 0)}
    pooled = out["all"]["test"]
    # the pooled test is the groups' flips added up: 5 gained, 5 lost, 2 solved by both, none by neither
    assert (pooled["gained"], pooled["lost"], pooled["both"], pooled["neither"], pooled["n"]) == (5, 5, 2, 0, 12)
    assert pooled["p_value"] == pytest.approx(1.0)
    assert out["all"]["before"]["k"] == 7 and out["all"]["after"]["k"] == 7
