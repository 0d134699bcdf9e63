"""Language-model / SFT trainer core: masked next-token loss + MTP loss + DSA indexer loss.

One `LMTrainer.step(ids, mask)` is an AdamW step over a batch of token ids with a target mask
(true where a token is trained on). Around the main loss it adds
* the MTP loss (weight `mtp_loss_weight`) so the MTP layer stays a good drafter,
* the indexer KL loss in sparse mode (indexer input detached, so it trains only the indexer and the
  main loss never trains the indexer) — or, with `dense_indexer_warmup`, the dense warm-up where the
  model attends densely and only the indexer learns,
* the aux-loss-free router-bias update after each optimiser step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from model import Transformer, indexer_kl_loss, indexer_parameters, lm_forward_loss, mtp_loss

from .config import TrainConfig


@dataclass
class StepStats:
    step: int
    loss: float
    mtp_loss: float
    indexer_loss: float
    lr: float
    grad_norm: float
    tokens: int
    seconds: float


class LMTrainer:
    """`backend`: the data-parallel runtime (trainers/backends.py). With W ranks every rank is handed the same
    global batch; rank r trains on rows r, r + W, … and scales each loss so that the gradient mean over ranks is
    the gradient one process takes on the whole batch (the LM and MTP terms by token counts; the indexer KL is a
    mean over rows of equal width, which needs no scaling)."""

    def __init__(self, model: Transformer, cfg: TrainConfig, indexer_loss: bool = True, backend=None):
        from .backends import TorchBackend

        self.backend = backend or TorchBackend()
        self.model, self.cfg = model, cfg
        self.indexer_loss = indexer_loss and model.config.use_dsa
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
        other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
        self.opt = self.backend.optimizer(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=cfg.lr, betas=cfg.betas,
        )
        self.step_no = 0

    def lr_at(self, step: int, progress: float) -> float:
        """Linear warm-up over `warmup_steps`, then cosine to `min_lr_ratio`·lr as progress goes 0 → 1."""
        c = self.cfg
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        frac = min(1.0, max(0.0, progress))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    def step(self, ids: torch.Tensor, mask: torch.Tensor | None = None, progress: float = 0.0,
             dense: bool = False) -> StepStats:
        """One AdamW step. `dense`: the main attention sees every causal token (DSA's dense stage) while the
        indexer learns to match it (its KL loss); otherwise attention is sparse over the indexer's top-k."""
        t0 = time.perf_counter()
        m, c = self.model, self.cfg
        m.train()
        dev = model_device(m)  # the batch comes from the host; the model may sit on a GPU
        ids, mask = ids.to(dev), None if mask is None else mask.to(dev)
        lr = self.lr_at(self.step_no, progress)
        for g in self.opt.param_groups:
            g["lr"] = lr
        w, lm_scale, mtp_w = self.backend.world_size, 1.0, None
        n_tok = int(mask[:, 1:].sum()) if mask is not None else ids.numel() - ids.shape[0]
        if w > 1:
            if ids.shape[0] % w:
                raise ValueError(f"data parallelism: the batch of {ids.shape[0]} rows does not split over {w} ranks")
            g_mask = mask
            ids = ids[self.backend.rank :: w]
            mask = None if mask is None else mask[self.backend.rank :: w]
            if mask is not None:  # local mean × (local count · W / global count) = this rank's share of the sum
                lm_scale = float(mask[:, 1:].sum()) * w / max(1.0, float(g_mask[:, 1:].sum()))
                steps = c.mtp_train_steps or m.config.mtp_draft_steps
                mtp_w = [float(mask[:, 2 + s :].sum()) * w / max(1.0, float(g_mask[:, 2 + s :].sum()))
                         for s in range(steps)]
        out, loss = lm_forward_loss(m, ids, mask, dense=dense, collect_indexer=self.indexer_loss,
                                    detach_indexer_input=True)
        loss = loss * lm_scale
        total = loss
        mtp = torch.zeros(())
        if c.mtp_loss_weight > 0 and len(m.mtp_layers) and ids.shape[1] >= 3:
            mtp = mtp_loss(m, out.hidden, ids, mask, steps=c.mtp_train_steps, weights=mtp_w)
            total = total + c.mtp_loss_weight * mtp
        ix = torch.zeros(())
        if self.indexer_loss and out.indexer_stats:
            ix = indexer_kl_loss(out.indexer_stats)
            total = total + ix
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        self.backend.all_reduce_grads(m)
        gn = self.backend.clip_grad_norm(m, c.grad_clip)
        self.opt.step()
        if c.router_bias_rate > 0:
            m.update_router_bias(c.router_bias_rate)
        self.step_no += 1
        return StepStats(self.step_no, loss.item(), mtp.item(), ix.item(), lr, float(gn), n_tok,
                         time.perf_counter() - t0)


def dense_indexer_warmup(model: Transformer, batches: Iterator[torch.Tensor], steps: int, lr: float = 1e-3):
    """DSA stage 1: the model attends densely; only the indexers learn KL(p ‖ softmax(I)). Returns KLs."""
    params = indexer_parameters(model)
    if not params:
        raise ValueError("model has no lightning indexer (use_dsa is off)")
    from .backends import TorchBackend

    opt = TorchBackend().optimizer(params, lr=lr)  # AdamW; fp32 main weights for bf16 ones (trainers/optim.py)
    others = [p for p in model.parameters() if all(p is not q for q in params)]
    flags = [p.requires_grad for p in others]
    for p in others:
        p.requires_grad_(False)
    kls = []
    try:
        for _ in range(steps):
            ids = next(batches)
            out = model.run(ids, dense=True, collect_indexer=True, logits=False)
            kl = indexer_kl_loss(out.indexer_stats)
            opt.zero_grad(set_to_none=True)
            kl.backward()
            opt.step()
            kls.append(kl.item())
    finally:
        for p, f in zip(others, flags):
            p.requires_grad_(f)
    return kls


class TimeCapExceeded(RuntimeError):
    """A training run hit its wall-clock safety cap: budgets are in steps, so this means something is wrong
    (a stalled machine, a mis-sized preset), and the run stops loudly instead of returning a shorter run."""


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model's parameters are (the device a trainer's batches go to)."""
    return next(model.parameters()).device


def train_lm(
    model: Transformer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor | None]],
    cfg: TrainConfig,
    on_step: Callable[[StepStats], None] | None = None,
    steps: int | None = None,
    trainer: LMTrainer | None = None,
    elapsed: float = 0.0,
) -> list[StepStats]:
    """Train for `steps` optimizer steps (default `cfg.max_steps`). The schedule depends on the step count
    only, so the same seed gives the same weights on a busy machine and on a quiet one.

    `cfg.max_seconds` is a safety cap, not a budget: reaching it raises `TimeCapExceeded`. To resume, pass the
    restored `trainer` (its `step_no` and optimizer) and the seconds already spent (`elapsed`)."""
    trainer = trainer or LMTrainer(model, cfg)
    total = steps or cfg.max_steps
    hist: list[StepStats] = []
    start = time.perf_counter() - elapsed
    while trainer.step_no < total:
        if time.perf_counter() - start > cfg.max_seconds:
            raise TimeCapExceeded(f"training hit its safety cap train.max_seconds={cfg.max_seconds:g} at step "
                                  f"{trainer.step_no} of {total}; raise the cap or lower the step budget")
        ids, mask = next(batches)
        st = trainer.step(ids, mask, progress=trainer.step_no / total)
        hist.append(st)
        if on_step:
            on_step(st)
    return hist
