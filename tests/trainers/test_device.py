"""The trainers on a CUDA model: batches and rollout rows go where the model is, and one step there equals the same
step on the CPU (fp32, the same weights and data). On the H200 these failed before: the SAO trainer built its rows and
its critic's value head on the host ("index is on cpu"). CPU-only machines skip them; `bench/gpu_run.sh tests`
runs them on the GPU."""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

import configs
from model import Transformer
from model.checkpoint import to_hf_state
from rollout.types import Segment, Trajectory
from trainers.config import OPDConfig, SAOConfig, TrainConfig
from trainers.lm import LMTrainer
from trainers.opd import OPDTrainer
from trainers.sao import SAOTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _exact_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(configs.load("tiny").model)


def _traj(rng: random.Random, reward: float) -> Trajectory:
    toks = [rng.randrange(256) for _ in range(90)]  # past index_topk (64): the sparse path runs
    mask = [0] * 30 + [1] * 60
    return Trajectory("t", f"e{reward}", "f", "math", "h", "v", 0,
                      [Segment(toks, mask, [-math.log(272) if m else 0.0 for m in mask], [0 if m else -1 for m in mask])],
                      reward, "completed")


def _update_rel(cpu: Transformer, gpu: Transformer, before: dict) -> float:
    """The largest difference between the two steps' updates, as a fraction of the CPU update (L2, per tensor)."""
    a, b = dict(to_hf_state(cpu)), {k: v.cpu() for k, v in to_hf_state(gpu)}
    worst = 0.0
    for k, v in a.items():
        du = v.float() - before[k].float()
        if du.any():
            worst = max(worst, float((b[k].float() - v.float()).norm() / du.norm()))
    return worst


def _pair(seed: int = 0):
    cpu = _model(seed)
    gpu = copy.deepcopy(cpu).cuda()
    return cpu, gpu, {k: v.detach().clone() for k, v in to_hf_state(cpu)}


def test_lm_step_on_cuda_equals_the_cpu_step():
    cpu, gpu, before = _pair()
    tc = TrainConfig(lr=1e-3, warmup_steps=0, mtp_loss_weight=0.3)
    ids = torch.randint(0, 256, (4, 90), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    a, b = LMTrainer(cpu, tc).step(ids, mask), LMTrainer(gpu, tc).step(ids, mask)  # host batches, both
    assert abs(a.loss - b.loss) <= 1e-4 * a.loss
    assert _update_rel(cpu, gpu, before) <= 1e-2


def test_sao_step_on_cuda_equals_the_cpu_step():
    cpu, gpu, before = _pair()
    rng = random.Random(3)
    trajs = [_traj(rng, r) for r in (1.0, 0.0, 1.0, 0.0)]
    sc = SAOConfig(lr=1e-3, critic_updates=2, micro_rows=2, replay_coef=0.1, kl_coef=0.01)
    ta, tb = SAOTrainer(cpu, sc), SAOTrainer(gpu, sc)
    assert tb.critic.head.weight.is_cuda
    tb.set_replay(copy.deepcopy(trajs[:2]))
    ta.set_replay(copy.deepcopy(trajs[:2]))
    sa, sb = ta.step(copy.deepcopy(trajs), 0), tb.step(copy.deepcopy(trajs), 0)
    assert sa["updated"] and sb["updated"]
    for k in ("value_loss", "grad_norm", "replay_kl"):
        assert abs(sa[k] - sb[k]) <= 1e-3 * abs(sa[k]) + 1e-7, (k, sa[k], sb[k])
    assert _update_rel(cpu, gpu, before) <= 1e-2


class _Pool:
    def __init__(self, teacher):
        self.teacher = teacher

    def score_batches(self, batches, fn):
        return [fn(self.teacher, rows) for _, rows in batches]


class _HostPool:
    """Like ServerTeacherPool: ignores the scoring function and returns host tensors (a server's answers)."""

    def __init__(self, teacher):
        self.teacher = teacher

    def score_batches(self, batches, fn):
        from model import rows_logprobs

        return [rows_logprobs(self.teacher, rows.ids.cpu(), rows.lengths, True)[0].cpu() for _, rows in batches]


@pytest.mark.parametrize("pool", ["model", "server"])
def test_opd_step_on_cuda_equals_the_cpu_step_with_a_host_teacher(pool):
    """A teacher on the host: its scores come back to the student's device, from the scoring function (`model`) or
    as host tensors, as a server pool returns them (`server`)."""
    cpu, gpu, before = _pair()
    teacher = _model(seed=5)  # stays on the host: its scores come back to the student's device
    rng = random.Random(3)
    trajs = [_traj(rng, r) for r in (1.0, 0.0, 1.0, 0.0)]
    oc = OPDConfig(lr=1e-3)
    a = OPDTrainer(cpu, _Pool(teacher), oc).step(copy.deepcopy(trajs))
    b = OPDTrainer(gpu, (_Pool if pool == "model" else _HostPool)(teacher), oc).step(copy.deepcopy(trajs))
    assert abs(a["reverse_kl"] - b["reverse_kl"]) <= 1e-4 * abs(a["reverse_kl"])
    assert _update_rel(cpu, gpu, before) <= 1e-2


def test_the_default_trainer_backend_trains_on_the_gpu():
    """`trainer.device: auto` with CUDA: the pipeline's backend puts the model on the GPU, and a step runs there."""
    from trainers.config import TrainerConfig
    from trainers.runtime import make_train_backend

    be = make_train_backend(TrainerConfig())
    m = be.wrap(_model())
    assert all(p.is_cuda for p in m.parameters())
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(4))
    st = LMTrainer(m, TrainConfig(lr=1e-3, warmup_steps=0), backend=be).step(ids)
    assert st.loss > 0
