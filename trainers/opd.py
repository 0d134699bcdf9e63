"""Multi-teacher on-policy distillation (OPD).

The student samples in environments of every domain; each trajectory goes to its domain's teacher,
which scores the student's own tokens. Per trainable token the signal is the reverse-KL advantage
Â_t = sg[log π_teacher(y_t) − log π_θ(y_t)] (+ α·the outcome advantage R − mean R), and tokens whose
importance ratio π_θ / π_rollout leaves the band (default 0.1–10) are masked. Teachers live in a
`TeacherPool` (at most M resident, the rest on disk); batches are grouped by teacher and the next
teacher is prefetched while the current one scores.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from model import Transformer, rows_logprobs
from rollout.types import Trajectory

from .config import OPDConfig
from .lm import model_device
from .rl_losses import LossConfig, opd_advantage, policy_loss
from .sao import Mismatch, layout


@torch.no_grad()
def merge_experts(base: Mapping[str, torch.Tensor], experts: Iterable[Mapping[str, torch.Tensor]],
                  scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Task arithmetic: θ = θ_base + scale · Σ_e (θ_e − θ_base) on every floating-point tensor, summed in fp32
    and cast back to the base's dtype; other tensors (integer buffers) stay the base's. `experts` is consumed
    one state dict at a time (each can be loaded lazily); each must have exactly the base's keys and shapes."""
    acc = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in base.items() if v.is_floating_point()}
    n = 0
    for i, sd in enumerate(experts):
        if set(sd) != set(base):
            diff = sorted(set(sd) ^ set(base))
            raise ValueError(f"expert {i}: its keys differ from the warm start's ({', '.join(diff[:5])})")
        for k in acc:
            if sd[k].shape != base[k].shape:
                raise ValueError(f"expert {i}: {k} has shape {tuple(sd[k].shape)}, the warm start {tuple(base[k].shape)}")
            acc[k] += sd[k].float() - base[k].float()
        n += 1
    if not n:
        raise ValueError("no experts to merge")
    return {k: (base[k].float() + scale * acc[k]).to(v.dtype) if k in acc else v.clone() for k, v in base.items()}


class OPDTrainer:
    def __init__(self, student: Transformer, teachers, cfg: OPDConfig | None = None, backend=None,
                 route: Mapping[str, str] | None = None):
        """`teachers`: a `trainers.teachers.TeacherPool` (or anything with `score_batches(batches, fn)`), keyed by
        teacher; `route` maps a domain to its teacher's key where the two differ (default: the domain itself).
        `backend`: the training runtime (trainers/backends.py); every rank trains on the whole batch, so a
        data-parallel layout repeats the work and a model-parallel one (Megatron) splits it."""
        from .backends import TorchBackend

        self.backend = backend or TorchBackend()
        self.student, self.teachers, self.cfg = student, teachers, cfg or OPDConfig()
        self.route = dict(route or {})
        self.lcfg = LossConfig(kind="opd", eps_low=1 - self.cfg.band_low, eps_high=self.cfg.band_high - 1)
        self.opt = self.backend.optimizer(student.parameters(), lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.steps = 0

    @torch.no_grad()
    def teacher_logprobs(self, trajs: list[Trajectory]) -> list[torch.Tensor]:
        """Score every trajectory's rows with its domain's teacher (grouped by teacher, prefetching)."""
        batches = [(self.route.get(t.domain, t.domain), layout([t])) for t in trajs]

        dev = model_device(self.student)

        def score(teacher: Transformer, rows) -> torch.Tensor:  # on the teacher's device
            rows = rows.to(model_device(teacher))
            return rows_logprobs(teacher.eval(), rows.ids, rows.lengths, self.cfg.exact_rows)[0]

        from .backends import from_main

        # the main rank holds the teachers (under torchrun the stage gives the other ranks none) and shares its scores
        # with every rank; returned on the student's device, whoever scored them (a server pool returns host tensors)
        scored = from_main(self.backend, lambda: [t.cpu() for t in self.teachers.score_batches(batches, score)])
        return [t.to(dev) for t in scored]

    def step(self, trajs: list[Trajectory], current_version: int | None = None) -> dict:
        """One update on the student's own trajectories (crashed and empty ones dropped). With the version the
        engines served (`current_version`), the training/inference log-prob mismatch is measured too."""
        trajs = [t for t in trajs if t.status not in ("crashed", "aborted") and t.n_trainable]
        if not trajs:
            return {"trajectories": 0}
        t_lp = self.teacher_logprobs(trajs)
        mean_r = sum(t.reward for t in trajs) / len(trajs)
        self.student.train()
        rows_of = [layout([t], device=model_device(self.student)) for t in trajs]
        n = sum(int(r.mask.sum()) for r in rows_of)
        first: dict[str, float] = {}
        for epoch in range(self.cfg.epochs):  # passes over the batch; the teacher scored it once
            self.opt.zero_grad(set_to_none=True)
            agg: dict[str, float] = {}
            rkl = 0.0
            mm = Mismatch()
            for t, tlp, rows in zip(trajs, t_lp, rows_of):
                lp, _ = rows_logprobs(self.student, rows.ids, rows.lengths, self.cfg.exact_rows)
                if current_version is not None and epoch == 0:
                    mm.add(lp, rows.logp_rollout, rows.mask, rows.versions, current_version)
                adv = opd_advantage(tlp, lp, outcome=t.reward - mean_r, alpha=self.cfg.outcome_alpha)
                loss, st = policy_loss(lp, rows.logp_rollout, adv, rows.mask, self.lcfg)
                share = float(rows.mask.sum()) / n
                (loss * share).backward()
                rkl += float(((lp.detach() - tlp) * rows.mask).sum())
                for k, v in st.items():
                    agg[k] = agg.get(k, 0.0) + v * share
            self.backend.all_reduce_grads(self.student)
            gn = self.backend.clip_grad_norm(self.student, self.cfg.grad_clip)
            if epoch == 0:  # reverse KL, band and mismatch of the batch as the student generated it
                first = {**agg, **mm.stats(), "reverse_kl": rkl / n, "grad_norm": float(gn)}
            else:
                first["reverse_kl_last"] = rkl / n
            self.backend.step(self.opt)
        self.steps += 1
        return {**first, "tokens": float(n), "trajectories": len(trajs), "reward_mean": mean_r, "step": self.steps}
