"""SAO — single-rollout asynchronous optimisation — and its ablation baselines, on stored trajectories.

One `SAOTrainer.step(trajectories, current_version)`:
1. drops crashed / aborted trajectories and, for SAO, those whose generated tokens span more than τ
   policy versions behind the current one (staleness bound; counted);
2. lays every segment out as a row (token ids, trainable mask, rollout log-probs);
3. critic values → skip-observation, cross-segment GAE with length-adaptive λ_policy for the policy and
   λ_critic = 1 returns for the critic (trainers/advantages.py);
4. K critic updates, then one actor update with the selected loss (trainers/rl_losses.py), all losses
   normalised over every trainable token of the batch.

The critic is a copy of the actor with a value head (zero-initialised), optionally with frozen attention,
pre-trained on returns before RL (`value_pretrain`). GRPO needs no critic (group-normalised outcomes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from model import Transformer
from rollout.types import Trajectory

from .advantages import adaptive_lambda, gae, grpo_advantages, returns, split_by_segments
from .config import SAOConfig
from .rl_losses import LossConfig, policy_loss


class Critic(nn.Module):
    """Value model initialised from the actor: its body (no LM head use, no MTP) + a zero-init value head."""

    def __init__(self, actor: Transformer, freeze_attention: bool = True):
        super().__init__()
        self.body = copy.deepcopy(actor)
        self.body.mtp_layers = nn.ModuleList()
        self.head = nn.Linear(actor.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        for p in self.body.lm_head.parameters():
            p.requires_grad_(False)
        if freeze_attention:
            for layer in self.body.layers:
                for p in layer.self_attn.parameters():
                    p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """values [B, T]: v[:, p] = V(state before token p), read at position p − 1 (v[:, 0] = 0)."""
        h = self.body.norm(self.body.run(ids, logits=False).hidden)
        v = self.head(h).squeeze(-1)
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], 1)


@dataclass
class Rows:
    ids: torch.Tensor  # [R, T]
    mask: torch.Tensor  # [R, T] bool, trainable tokens
    logp_rollout: torch.Tensor  # [R, T]
    owner: list[int]  # trajectory index of each row
    counts: list[list[int]] = field(default_factory=list)  # per trajectory: trainable tokens per segment


def token_logprobs(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(token_p | prefix) at p ≥ 1 (0 at p = 0), entropy of the predictive distribution) [B, T]."""
    logits = model(ids).float()
    logp_all = logits[:, :-1].log_softmax(-1)
    lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    z = lp.new_zeros(ids.shape[0], 1)
    return torch.cat([z, lp], 1), torch.cat([z, ent], 1)


def layout(trajs: list[Trajectory], pad_id: int = 0) -> Rows:
    segs = [(j, s) for j, t in enumerate(trajs) for s in t.segments if s.tokens]
    width = max(len(s.tokens) for _, s in segs)
    r = len(segs)
    ids = torch.full((r, width), pad_id, dtype=torch.long)
    mask = torch.zeros(r, width, dtype=torch.bool)
    lpr = torch.zeros(r, width)
    for i, (_, s) in enumerate(segs):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        mask[i, :n] = torch.tensor(s.loss_mask)
        lpr[i, :n] = torch.tensor(s.logprobs)
    mask[:, 0] = False
    counts = [[int(sum(s.loss_mask)) for s in t.segments if s.tokens] for t in trajs]
    return Rows(ids, mask, lpr, [j for j, _ in segs], counts)


class SAOTrainer:
    def __init__(self, actor: Transformer, cfg: SAOConfig | None = None, critic: Critic | None = None):
        self.actor, self.cfg = actor, cfg or SAOConfig()
        self.lcfg = LossConfig(kind=self.cfg.loss, eps_low=self.cfg.eps_low, eps_high=self.cfg.eps_high,
                               clip=self.cfg.clip, tis_cap=self.cfg.tis_cap)
        self.opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=self.cfg.lr,
                                     betas=(0.9, 0.95), weight_decay=0.0)
        self.critic = None
        if self.cfg.loss != "grpo":
            self.critic = critic or Critic(actor, self.cfg.freeze_critic_attention)
            self.copt = torch.optim.AdamW([p for p in self.critic.parameters() if p.requires_grad],
                                          lr=self.cfg.critic_lr, weight_decay=0.0)
        self.steps = 0
        self.dropped = {"stale": 0, "crashed": 0, "empty": 0}

    # ---- selection --------------------------------------------------------------------------------
    def select(self, trajs: list[Trajectory], current_version: int) -> list[Trajectory]:
        keep = []
        for t in trajs:
            if t.status in ("crashed", "aborted"):
                self.dropped["crashed"] += 1
            elif t.n_trainable == 0:
                self.dropped["empty"] += 1
            elif (self.cfg.loss == "sao" and self.cfg.staleness is not None
                  and current_version - t.policy_versions()[0] > self.cfg.staleness):
                self.dropped["stale"] += 1
            else:
                keep.append(t)
        return keep

    # ---- advantages -------------------------------------------------------------------------------
    @torch.no_grad()
    def advantages(self, trajs: list[Trajectory], rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        adv = torch.zeros_like(rows.logp_rollout)
        ret = torch.zeros_like(rows.logp_rollout)
        if self.cfg.loss == "grpo":
            a = grpo_advantages([t.reward for t in trajs], [t.env_id for t in trajs])
            for i, j in enumerate(rows.owner):
                adv[i][rows.mask[i]] = a[j]
            return adv, ret
        values = torch.cat([self.critic(rows.ids[i : i + self.cfg.micro_rows])
                            for i in range(0, len(rows.owner), self.cfg.micro_rows)])
        for j, t in enumerate(trajs):
            mine = [i for i, o in enumerate(rows.owner) if o == j]
            v = torch.cat([values[i][rows.mask[i]] for i in mine])
            lam = adaptive_lambda(v.shape[0], self.cfg.alpha)
            a = gae(v, t.reward, self.cfg.gamma, lam)
            g = returns(v.shape[0], t.reward, self.cfg.gamma)
            for i, aa, gg in zip(mine, split_by_segments(a, rows.counts[j]), split_by_segments(g, rows.counts[j])):
                adv[i][rows.mask[i]] = aa
                ret[i][rows.mask[i]] = gg
        return adv, ret

    def lr_at(self, step: int) -> float:
        """Actor lr of update `step` (0-based): linear warmup over `warmup_steps`, then constant. Adam's
        first updates move every parameter by ~lr whatever its gradient's size, which on small noisy RL
        batches is mostly noise; the warmup keeps those steps small."""
        w = self.cfg.warmup_steps
        return self.cfg.lr * min(1.0, (step + 1) / w) if w else self.cfg.lr

    # ---- updates ----------------------------------------------------------------------------------
    def _critic_update(self, rows: Rows, ret: torch.Tensor) -> float:
        n = rows.mask.sum().clamp_min(1)
        self.copt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(rows.owner), self.cfg.micro_rows):
            sl = slice(i, i + self.cfg.micro_rows)
            v = self.critic(rows.ids[sl])
            m = rows.mask[sl]
            loss = 0.5 * (((v - ret[sl]) ** 2) * m).sum() / n
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.cfg.grad_clip)
        self.copt.step()
        return total

    def value_pretrain(self, trajs: list[Trajectory], steps: int | None = None) -> list[float]:
        """Fit the critic to returns before RL starts (the actor is untouched)."""
        if self.critic is None:
            return []
        trajs = [t for t in trajs if t.status not in ("crashed", "aborted") and t.n_trainable]
        if not trajs:
            return []
        rows = layout(trajs)
        _, ret = self.advantages(trajs, rows)
        return [self._critic_update(rows, ret) for _ in range(self.cfg.value_pretrain_steps if steps is None else steps)]

    def step(self, trajs: list[Trajectory], current_version: int) -> dict:
        kept = self.select(trajs, current_version)
        stats: dict = {"trajectories": len(kept), "step": self.steps,
                       **{f"dropped_{k}": v for k, v in self.dropped.items()}}
        stats["updated"] = False
        if not kept:
            return stats  # everything was stale or crashed: no update, the counters say why
        rewards = [t.reward for t in kept]
        stats["degenerate"] = max(rewards) == min(rewards)  # all equal: only the critic's errors drive the update
        self.actor.train()
        rows = layout(kept)
        adv, ret = self.advantages(kept, rows)
        if self.critic is not None and self.cfg.critic_updates:
            vl = [self._critic_update(rows, ret) for _ in range(self.cfg.critic_updates)]
            stats["value_loss"] = vl[-1]
        n = rows.mask.sum().clamp_min(1)
        self.opt.zero_grad(set_to_none=True)
        agg: dict[str, float] = {}
        ent_sum = 0.0
        for i in range(0, len(rows.owner), self.cfg.micro_rows):
            sl = slice(i, i + self.cfg.micro_rows)
            lp, ent = token_logprobs(self.actor, rows.ids[sl])
            m = rows.mask[sl]
            loss, st = policy_loss(lp, rows.logp_rollout[sl], adv[sl], m, self.lcfg)
            share = m.sum() / n  # per-micro-batch losses are token means: reweight to the batch mean
            (loss * share).backward()
            ent_sum += float((ent.detach() * m).sum())
            for k, v in st.items():
                agg[k] = agg.get(k, 0.0) + v * float(share)
        gn = torch.nn.utils.clip_grad_norm_(self.actor.parameters(), self.cfg.grad_clip)
        lr = self.lr_at(self.steps)
        stats.update(agg)
        if not float(gn) > 0.0:  # every advantage zero (e.g. GRPO on a group of equal rewards): no update at all,
            self.opt.zero_grad(set_to_none=True)  # not even Adam's momentum, and no new policy version
            stats.update(lr=lr, tokens=float(n), entropy=ent_sum / float(n), grad_norm=0.0,
                         reward_mean=sum(rewards) / len(kept))
            return stats
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.steps += 1
        stats["updated"] = True
        stats.update(lr=lr, tokens=float(n), entropy=ent_sum / float(n), grad_norm=float(gn), step=self.steps,
                     reward_mean=sum(t.reward for t in kept) / len(kept))
        return stats
