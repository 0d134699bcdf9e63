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
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from model import Transformer, rows_logprobs, token_logprobs  # noqa: F401 - token_logprobs re-exported
from model.losses import next_token_kl
from rollout.types import Trajectory

from .advantages import adaptive_lambda, gae, grpo_advantages, returns, split_by_segments
from .config import SAOConfig
from .lm import model_device
from .rl_losses import LossConfig, kl_penalty, policy_loss

log = logging.getLogger(__name__)


class Critic(nn.Module):
    """Value model initialised from the actor: its body (no LM head use, no MTP) + a zero-init value head."""

    def __init__(self, actor: Transformer, freeze_attention: bool = True):
        super().__init__()
        self.body = copy.deepcopy(actor)
        self.body.mtp_layers = nn.ModuleList()
        w = self.body.norm.weight  # the head sits where the body is, in its dtype
        self.head = nn.Linear(actor.config.hidden_size, 1, device=w.device, dtype=w.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        for p in self.body.lm_head.parameters():
            p.requires_grad_(False)
        if freeze_attention:
            for attn in self.body.attention_modules():
                for p in attn.parameters():
                    p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """values [B, T]: v[:, p] = V(state before token p), read at position p − 1 (v[:, 0] = 0)."""
        h = self.body.norm(self.body.run(ids, logits=False).hidden)
        v = self.head(h).squeeze(-1)
        return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], 1)


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """Stop the gradient of every parameter whose name matches one of the shell-style `patterns`; returns the
    names frozen. A pattern that matches no parameter is an error (a typo would otherwise freeze nothing)."""
    from fnmatch import fnmatchcase

    params = list(getattr(model, "module", model).named_parameters())
    for pat in patterns:
        if not any(fnmatchcase(n, pat) for n, _ in params):
            raise ValueError(f"sao.frozen: {pat!r} matches no parameter of the model (names look like "
                             f"{params[0][0]!r}, {params[-1][0]!r})")
    out = [n for n, _ in params if any(fnmatchcase(n, pat) for pat in patterns)]
    for n, p in params:
        if n in out:
            p.requires_grad_(False)
    return out


@dataclass
class Rows:
    ids: torch.Tensor  # [R, T]
    mask: torch.Tensor  # [R, T] bool, trainable tokens
    logp_rollout: torch.Tensor  # [R, T]
    owner: list[int]  # trajectory index of each row
    counts: list[list[int]] = field(default_factory=list)  # per trajectory: trainable tokens per segment
    versions: torch.Tensor | None = None  # [R, T] policy version that generated each token (-1 elsewhere)
    lengths: list[int] = field(default_factory=list)  # true (unpadded) length of each row

    def to(self, device: torch.device | str) -> Rows:
        """The rows with their tensors on `device` (where the model that reads them is)."""
        return Rows(self.ids.to(device), self.mask.to(device), self.logp_rollout.to(device), self.owner,
                    self.counts, None if self.versions is None else self.versions.to(device), self.lengths)


def layout(trajs: list[Trajectory], pad_id: int = 0, device: torch.device | str | None = None,
           shape: tuple[int, int] | None = None) -> Rows:
    """The trajectories' segments as right-padded rows (built on the host, then on `device` when given). `shape`:
    (rows, width) to pad to, with rows of padding (masked out, owned by no trajectory: -1) after the segments'."""
    segs = [(j, s) for j, t in enumerate(trajs) for s in t.segments if s.tokens]
    need = (len(segs), max((len(s.tokens) for _, s in segs), default=0))
    r, width = shape or need
    if need[0] > r or need[1] > width:
        raise ValueError(f"layout: {need[0]} rows of up to {need[1]} tokens do not fit {r} × {width}")
    ids = torch.full((r, width), pad_id, dtype=torch.long)
    mask = torch.zeros(r, width, dtype=torch.bool)
    lpr = torch.zeros(r, width)
    ver = torch.full((r, width), -1, dtype=torch.long)
    for i, (_, s) in enumerate(segs):
        n = len(s.tokens)
        ids[i, :n] = torch.tensor(s.tokens)
        mask[i, :n] = torch.tensor(s.loss_mask)
        lpr[i, :n] = torch.tensor(s.logprobs)
        ver[i, :n] = torch.tensor(s.versions)
    mask[:, 0] = False
    counts = [[int(sum(s.loss_mask)) for s in t.segments if s.tokens] for t in trajs]
    pad = r - len(segs)
    rows = Rows(ids, mask, lpr, [j for j, _ in segs] + [-1] * pad, counts, ver,
                [len(s.tokens) for _, s in segs] + [width] * pad)
    return rows if device is None else rows.to(device)


class Mismatch:
    """Training/inference mismatch |log π_train − log π_rollout| over consumed tokens, accumulated per step.

    `all`: every consumed token (includes the policy change of stale tokens); `fresh`: only tokens generated by
    the version being trained, where the two log-probs come from the same weights and any gap is numerics."""

    THRESHOLD = 1e-3

    def __init__(self):
        self.acc = {k: [0.0, 0.0, 0, 0] for k in ("all", "fresh")}  # sum, max, n over threshold, n

    def add(self, lp_train: torch.Tensor, lp_rollout: torch.Tensor, mask: torch.Tensor,
            versions: torch.Tensor | None, version: int) -> None:
        d = (lp_train.detach() - lp_rollout).abs()
        for key, m in (("all", mask), ("fresh", mask & (versions == version) if versions is not None else None)):
            if m is None or not bool(m.any()):
                continue
            x = d[m]
            a = self.acc[key]
            a[0] += float(x.sum())
            a[1] = max(a[1], float(x.max()))
            a[2] += int((x > self.THRESHOLD).sum())
            a[3] += int(x.numel())

    @classmethod
    def merged(cls, parts: list[dict]) -> Mismatch:
        """The mismatch over every rank's tokens, from each rank's `acc` (sums and counts add, maxima max)."""
        m = cls()
        for acc in parts:
            for key, (tot, mx, over, n) in acc.items():
                a = m.acc[key]
                a[0] += tot
                a[1] = max(a[1], mx)
                a[2] += over
                a[3] += n
        return m

    def stats(self) -> dict:
        out = {}
        for key, (tot, mx, over, n) in self.acc.items():
            if n:
                out.update({f"mismatch_{key}_mean": tot / n, f"mismatch_{key}_max": mx,
                            f"mismatch_{key}_frac_over_1e-3": over / n, f"mismatch_{key}_tokens": n})
        return out


class SAOTrainer:
    """`backend`: the data-parallel runtime (trainers/backends.py). Every rank is handed the same trajectories;
    rank r trains on trajectories r, r + W, r + 2W, … of the kept ones, every loss is normalised by the whole
    batch's token count (times W, undone by the gradient mean over ranks), so W ranks take exactly the step
    one process takes on the whole batch."""

    def __init__(self, actor: Transformer, cfg: SAOConfig | None = None, critic: Critic | None = None,
                 backend=None):
        from .backends import TorchBackend

        self.backend = backend or TorchBackend()
        self.actor, self.cfg = actor, cfg or SAOConfig()
        # ranks that must run the same forwards and backwards (MegatronBackend.lockstep) run padded rows in lockstep,
        # one padded forward per micro-batch (no per-row exact forwards: their shapes differ by rank)
        self.lockstep = bool(getattr(self.backend, "lockstep", False))
        self.exact_rows = self.cfg.exact_rows and not self.lockstep
        if self.cfg.exact_rows and self.lockstep:
            log.info("sao.exact_rows: off on this backend (its ranks forward padded rows in lockstep)")
        if self.lockstep and self.cfg.replay_coef > 0:
            raise ValueError("sao.replay_coef: the replay anchor is not available where the data-parallel ranks run "
                             "in lockstep (trainer.kind=megatron with more than one data-parallel or expert rank)")
        self.lcfg = LossConfig(kind=self.cfg.loss, eps_low=self.cfg.eps_low, eps_high=self.cfg.eps_high,
                               clip=self.cfg.clip, tis_cap=self.cfg.tis_cap)
        self.critic = None
        if self.cfg.loss != "grpo":  # the critic copies the actor before any of the actor's parameters is frozen
            self.critic = critic or Critic(actor, self.cfg.freeze_critic_attention)
            self.copt = self.backend.optimizer([p for p in self.critic.parameters() if p.requires_grad],
                                          lr=self.cfg.critic_lr, weight_decay=0.0)
        self.frozen = freeze(actor, self.cfg.frozen)
        self.opt = self.backend.optimizer([p for p in actor.parameters() if p.requires_grad], lr=self.cfg.lr,
                                     betas=(0.9, 0.95), weight_decay=0.0)
        self.ref = None  # the frozen starting policy of the KL penalty and the replay anchor (a resumed trainer is
        if self.cfg.kl_coef > 0 or self.cfg.replay_coef > 0:  # built before its weights are restored, so this is
            self.ref = copy.deepcopy(getattr(actor, "module", actor)).eval()  # always the warm start)
            self.ref.mtp_layers = nn.ModuleList()
            for p in self.ref.parameters():
                p.requires_grad_(False)
        self.replay: Rows | None = None  # `set_replay`
        self.steps = 0
        self.dropped = {"stale": 0, "crashed": 0, "empty": 0}
        self.outcomes: list[tuple[Trajectory, str]] = []  # of the last `select`

    # ---- selection --------------------------------------------------------------------------------
    def select(self, trajs: list[Trajectory], current_version: int) -> list[Trajectory]:
        """The trajectories this step trains on; `self.outcomes` says what became of each one given."""
        keep = []
        self.outcomes = []
        for t in trajs:
            if t.status in ("crashed", "aborted"):
                why = "crashed"
            elif t.n_trainable == 0:
                why = "empty"
            elif (self.cfg.loss == "sao" and self.cfg.staleness is not None
                  and current_version - t.policy_versions()[0] > self.cfg.staleness):
                why = "stale"
            else:
                keep.append(t)
                self.outcomes.append((t, "trained"))
                continue
            self.dropped[why] += 1
            self.outcomes.append((t, f"dropped_{why}"))
        return keep

    # ---- advantages -------------------------------------------------------------------------------
    @torch.no_grad()
    def advantages(self, trajs: list[Trajectory], rows: Rows, batch: list[Trajectory] | None = None,
                   values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token advantages and returns of `trajs` (this rank's share of `batch`, the whole step's batch every
        rank holds) on `rows`. GRPO normalises each group over the whole batch: a rank's share holds fragments.
        `values` [R, T]: the critic's values of `rows`, where the caller has them (else one critic forward here);
        the returns never read them (λ_critic = 1: discounted outcomes)."""
        # computed on the host (a per-trajectory scan) and handed back on the rows' device
        dev, mask = rows.ids.device, rows.mask.cpu()
        adv = torch.zeros(mask.shape, dtype=torch.float32)
        ret = torch.zeros(mask.shape, dtype=torch.float32)
        if self.cfg.loss == "grpo":
            batch = trajs if batch is None else batch
            whole = grpo_advantages([t.reward for t in batch], [t.env_id for t in batch])
            a = whole if batch is trajs else self._share(whole)
            for i, j in enumerate(rows.owner):
                if j >= 0:  # not a padding row
                    adv[i][mask[i]] = a[j]
            return adv.to(dev), ret.to(dev)
        if values is None:
            values = torch.zeros(mask.shape)
            for idx, width in self._micro_batches(rows):
                values[idx.cpu(), :width] = self.critic(rows.ids[idx, :width]).float().cpu()
        for j, t in enumerate(trajs):
            mine = [i for i, o in enumerate(rows.owner) if o == j]
            v = torch.cat([values[i][mask[i]] for i in mine])
            lam = adaptive_lambda(v.shape[0], self.cfg.alpha)
            a = gae(v, t.reward, self.cfg.gamma, lam)
            g = returns(v.shape[0], t.reward, self.cfg.gamma)
            for i, aa, gg in zip(mine, split_by_segments(a, rows.counts[j]), split_by_segments(g, rows.counts[j])):
                adv[i][mask[i]] = aa
                ret[i][mask[i]] = gg
        return adv.to(dev), ret.to(dev)

    def _returns(self, trajs: list[Trajectory], rows: Rows) -> torch.Tensor:
        """The critic's targets on `rows` (discounted outcomes: no value is read, so none is computed)."""
        return self.advantages(trajs, rows, values=torch.zeros(rows.ids.shape))[1]

    def lr_at(self, step: int) -> float:
        """Actor lr of update `step` (0-based): linear warmup over `warmup_steps`, then constant. Adam's
        first updates move every parameter by ~lr whatever its gradient's size, which on small noisy RL
        batches is mostly noise; the warmup keeps those steps small."""
        w = self.cfg.warmup_steps
        return self.cfg.lr * min(1.0, (step + 1) / w) if w else self.cfg.lr

    # ---- replay anchor ----------------------------------------------------------------------------
    def set_replay(self, trajs: list[Trajectory]) -> int:
        """Take `trajs` (warm-start rollouts this trainer does not train on) as the replay anchor's rows
        (`sao.replay_coef`). The reference is the frozen copy of the actor the trainer was built on (the warm
        start), scored again on each step's rows: one model's memory, not a vocabulary-wide distribution per
        stored token. Returns the number of anchored tokens (0: no anchor)."""
        self.replay = None
        trajs = [t for t in trajs if t.status not in ("crashed", "aborted") and t.n_trainable]
        if self.cfg.replay_coef == 0 or not trajs:
            return 0
        rows = layout(trajs, device=model_device(self.actor))
        # the order rows are taken in: a fixed shuffle, so each step's rows mix the domains and patterns instead of
        # following the store's (environment) order; the same on every rank and after a resume
        self.replay_order = torch.randperm(len(rows.owner), generator=torch.Generator().manual_seed(0)).tolist()
        self.replay = rows
        return int(rows.mask.sum())

    def _replay_backward(self) -> tuple[float, float]:
        """One replay micro-step: β·KL(π_ref ‖ π) summed over the vocabulary, token-averaged over the step's
        `replay_rows` rows (every rank's share, as the policy loss), backpropagated. Returns this rank's (KL summed
        over its tokens, its tokens)."""
        rows, k, order = self.replay, self.cfg.replay_rows, self.replay_order
        pick = [order[(self.steps * k + j) % len(order)] for j in range(min(k, len(order)))]  # in turn, resumable
        n = float(sum(rows.mask[i].sum() for i in pick)) / self.backend.world_size
        total = tokens = 0.0
        for i in self._share(pick):
            ids, m = rows.ids[i:i + 1, :rows.lengths[i]], rows.mask[i, 1:rows.lengths[i]]
            kl = next_token_kl(self.ref, self.actor, ids, m)  # through the heads in row chunks where V·T is large
            (self.cfg.replay_coef * kl / max(n, 1.0)).backward()
            total += float(kl.detach())
            tokens += int(m.sum())
        return total, float(tokens)

    # ---- updates ----------------------------------------------------------------------------------
    def _share(self, trajs: list) -> list:
        """This rank's trajectories of a batch every rank holds."""
        w = self.backend.world_size
        return trajs if w == 1 else trajs[self.backend.rank :: w]

    def _rows(self, chunk: list[Trajectory]) -> Rows | None:
        """This rank's rows of `chunk` (a batch every rank holds), on the actor's device; None if it has none. Where
        the ranks run in lockstep (`backend.lockstep`), every rank's rows are padded to the same count and width, so
        all run the same forwards and backwards on the same shapes (the added rows are masked out); a rank without
        trajectories runs padding."""
        mine = self._share(chunk)
        dev = model_device(self.actor)
        if not self.lockstep:
            return layout(mine, device=dev) if mine else None
        w = self.backend.world_size
        width = max(len(s.tokens) for t in chunk for s in t.segments if s.tokens)
        n_rows = max(sum(1 for t in chunk[r::w] for s in t.segments if s.tokens) for r in range(w))
        return layout(mine, device=dev, shape=(n_rows, width))

    def _critic_update(self, rows: Rows | None, ret: torch.Tensor | None, n_global: float,
                       seen: torch.Tensor | None = None) -> float:
        """One critic update on `rows` toward the returns `ret`. `seen` [R, T], on the host: filled with the values
        its forward computed (the critic before this update) at the rows' true lengths."""
        n = n_global / self.backend.world_size  # the gradient mean over ranks turns this into the batch mean
        self.copt.zero_grad(set_to_none=True)
        total = 0.0
        for idx, width in self._micro_batches(rows):
            v = self.critic(rows.ids[idx, :width])
            if seen is not None:
                seen[idx.cpu(), :width] = v.detach().float().cpu()
            m, r = rows.mask[idx, :width], ret[idx, :width]
            loss = 0.5 * (((v - r) ** 2) * m).sum() / n
            loss.backward()
            total += loss.item()
        self.backend.all_reduce_grads(self.critic)
        self.backend.clip_grad_norm(self.critic, self.cfg.grad_clip)
        self.copt.step()
        return total

    def _micro_batches(self, rows: Rows | None) -> list[tuple[torch.Tensor, int]]:
        """The critic's micro-batches of `rows`: (row indices, width). Rows go by length, `micro_rows` at a time, each
        cut to its longest row (a causal model's values at a row's tokens do not read the padding after them), so a
        batch of mixed lengths does not run every row at the longest one's. In lockstep every rank runs the same
        shapes: the rows in order at the full width."""
        if rows is None:
            return []
        k, n = self.cfg.micro_rows, len(rows.owner)
        dev = rows.ids.device
        if self.lockstep:
            return [(torch.arange(i, min(i + k, n), device=dev), rows.ids.shape[1]) for i in range(0, n, k)]
        order = sorted(range(n), key=lambda i: rows.lengths[i])
        return [(torch.tensor(order[i:i + k], device=dev), max(rows.lengths[j] for j in order[i:i + k]))
                for i in range(0, n, k)]

    def value_pretrain(self, trajs: list[Trajectory], steps: int | None = None,
                       batch_size: int | None = None) -> list[float]:
        """Fit the critic to returns before RL starts (the actor is untouched): `steps` updates (default
        `value_pretrain_steps`). With `batch_size`, the trajectories are cut into batches of that size (in order)
        and the updates cycle through them, so an update costs one batch whatever the number of trajectories."""
        self.pretrained_ids: set[str] = set()
        if self.critic is None:
            return []
        trajs = [t for t in trajs if t.status not in ("crashed", "aborted") and t.n_trainable]
        if not trajs:
            return []
        size = batch_size or len(trajs)
        batches = []
        for i in range(0, len(trajs), size):
            chunk = trajs[i:i + size]
            mine = self._share(chunk)
            rows = self._rows(chunk)
            batches.append((rows, self._returns(mine, rows) if rows is not None else None,
                            float(layout(chunk).mask.sum().clamp_min(1))))
        n = self.cfg.value_pretrain_steps if steps is None else steps
        self.pretrained_ids = {t.trajectory_id for t in trajs[:min(n, len(batches)) * size]}  # the ones it fitted
        return [self._critic_update(*batches[k % len(batches)]) for k in range(n)]

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
        n_global = float(layout(kept).mask.sum().clamp_min(1)) if self.backend.world_size > 1 else None
        mine = self._share(kept)
        rows = self._rows(kept)
        if n_global is None:
            n_global = float(rows.mask.sum().clamp_min(1))
        if self.critic is not None and self.cfg.critic_updates:
            # the first critic update's forward is the critic before any update: its values are the advantages'
            # (one forward fewer than scoring the batch on its own first)
            ret = self._returns(mine, rows) if rows is not None else None
            seen = torch.zeros(rows.ids.shape) if rows is not None else None
            vl = [self._critic_update(rows, ret, n_global, seen if k == 0 else None)
                  for k in range(self.cfg.critic_updates)]
            stats["value_loss"] = vl[-1]
            adv = self.advantages(mine, rows, kept, seen)[0] if rows is not None else None
        else:
            adv, ret = self.advantages(mine, rows, kept) if rows is not None else (None, None)
        n = torch.tensor(n_global / self.backend.world_size)
        lr = self.lr_at(self.steps)
        updated = False
        micro = range(0, len(rows.owner) if rows is not None else 0, self.cfg.micro_rows)
        # the replay anchor rides on an update; it never makes one alone: a GRPO batch whose groups all tied has no
        # policy gradient and stays no update (decided from every kept trajectory, so every rank agrees)
        anchor = self.replay is not None and (self.cfg.loss != "grpo" or any(
            grpo_advantages([t.reward for t in kept], [t.env_id for t in kept])))
        lp_ref = {}  # the frozen reference's log-probs: one forward per micro-batch, whatever the number of epochs
        if self.cfg.kl_coef > 0:
            with torch.no_grad():
                lp_ref = {i: rows_logprobs(self.ref, rows.ids[i:i + self.cfg.micro_rows],
                                           rows.lengths[i:i + self.cfg.micro_rows], self.exact_rows)[0]
                          for i in micro}
        for epoch in range(self.cfg.epochs):  # PPO-style passes over the batch; the ratio and band keep them safe
            self.opt.zero_grad(set_to_none=True)
            agg: dict[str, float] = {}
            ent_sum = 0.0
            mm = Mismatch()
            for i in micro:
                sl = slice(i, i + self.cfg.micro_rows)
                lp, ent = rows_logprobs(self.actor, rows.ids[sl], rows.lengths[sl], self.exact_rows)
                m = rows.mask[sl]
                mm.add(lp, rows.logp_rollout[sl], m, None if rows.versions is None else rows.versions[sl],
                       current_version)
                loss, st = policy_loss(lp, rows.logp_rollout[sl], adv[sl], m, self.lcfg)
                if self.cfg.kl_coef > 0:
                    kl = kl_penalty(lp, lp_ref[i], m)
                    loss = loss + self.cfg.kl_coef * kl
                    st["kl_ref"] = float(kl.detach())
                share = m.sum() / n  # per-micro-batch losses are token means: reweight to the batch mean
                (loss * share).backward()
                ent_sum += float((ent.detach() * m).sum())
                for k, v in st.items():
                    agg[k] = agg.get(k, 0.0) + v * float(share)
            if anchor:
                agg["_replay_kl"], agg["_replay_tokens"] = self._replay_backward()
            self.backend.all_reduce_grads(self.actor)
            gn = self.backend.clip_grad_norm(self.actor, self.cfg.grad_clip)
            # each rank holds its share of the batch's figures, weighted so that their mean over ranks is the
            # batch's (the replay KL is a ratio: its sum and its tokens are averaged, then divided)
            if epoch == 0:
                agg["entropy"] = ent_sum / float(n)
                if "value_loss" in stats:
                    agg["value_loss"] = stats["value_loss"]
            agg = self.backend.mean_over_ranks(agg)
            if "_replay_kl" in agg:
                agg["replay_kl"] = agg.pop("_replay_kl") / max(agg.pop("_replay_tokens"), 1e-12)
            if epoch == 0:  # the batch as the engines generated it: mismatch, entropy and band before any update
                stats.update(agg)
                stats.update(Mismatch.merged(self.backend.gather_over_ranks(mm.acc)).stats())  # every rank's tokens
                stats.update(lr=lr, tokens=n_global, grad_norm=float(gn))
            else:
                stats.update({f"{k}_last": v for k, v in agg.items()})
            if not float(gn) > 0.0:  # every advantage zero (e.g. GRPO on a group of equal rewards), or every token
                self.opt.zero_grad(set_to_none=True)  # masked: no update, not even Adam's momentum
                break
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
            updated = True
        stats["reward_mean"] = sum(rewards) / len(kept)
        if not updated:  # no new policy version
            stats["grad_norm"] = 0.0
            return stats
        self.steps += 1
        stats["updated"] = True
        stats["step"] = self.steps
        return stats
