"""Policy losses behind one interface: SAO and the ablation baselines, plus the critic's value loss.

Every loss takes per-token tensors of one batch — `logp` (current policy, with grad), `logp_rollout`
(recorded by the engine), `adv`, `mask` (trainable tokens) — and returns (loss, stats). All of them are
normalised over *all trainable tokens of the batch* (token-level averaging), not per sequence.

* SAO: r = exp(logp − logp_rollout); f(r) = r inside (1 − ε_low, 1 + ε_high), 0 outside (no gradient
  of either sign); loss = −Σ f(r)·Â·logp / N with f a stop-gradient weight — the gradient of −r·Â in
  the band.
* naive async PPO: PPO's clipped objective against the rollout policy, no band mask, no staleness bound.
* TIS: truncated importance sampling, weight min(r, C) (stop-gradient), C = 2 by default.
* GRPO: PPO's clipped objective with group-normalised advantages (computed by the caller).
* OPD: the same as SAO with the reverse-KL advantage Â = sg[logp_teacher − logp] (+ α·outcome) and
  an importance band (e.g. 0.1–10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossConfig:
    kind: str = "sao"  # sao | ppo | tis | grpo | opd
    eps_low: float = 0.2
    eps_high: float = 4.0
    clip: float = 0.2  # PPO/GRPO clip range
    tis_cap: float = 2.0


def _norm(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def band_mask(ratio: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """True where 1 − ε_low < r < 1 + ε_high (open interval: a token exactly at an edge is masked)."""
    return (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)


def policy_loss(logp: torch.Tensor, logp_rollout: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                cfg: LossConfig) -> tuple[torch.Tensor, dict]:
    mask = mask.float()
    log_ratio = (logp - logp_rollout).clamp(-20, 20)
    ratio = log_ratio.exp()
    if cfg.kind in ("sao", "opd"):
        keep = band_mask(ratio.detach(), cfg.eps_low, cfg.eps_high).float()
        weight = ratio.detach() * keep
        loss = -_norm(weight * adv * logp, mask)
        clipped = _norm(1.0 - keep, mask)
    elif cfg.kind in ("ppo", "grpo"):
        unclipped = ratio * adv
        clipped_obj = ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv
        loss = -_norm(torch.minimum(unclipped, clipped_obj), mask)
        clipped = _norm((unclipped.detach() > clipped_obj.detach()).float(), mask)
    elif cfg.kind == "tis":
        w = ratio.detach().clamp(max=cfg.tis_cap)
        loss = -_norm(w * adv * logp, mask)
        clipped = _norm((ratio.detach() > cfg.tis_cap).float(), mask)
    else:
        raise ValueError(f"loss kind {cfg.kind!r}: expected sao, opd, ppo, grpo or tis")
    with torch.no_grad():
        stats = {
            "clip_frac": float(clipped),
            "ratio_mean": float(_norm(ratio, mask)),
            "kl": float(_norm(ratio - 1 - log_ratio, mask)),  # k3 estimator of KL(rollout ‖ current)
            "adv_mean": float(_norm(adv, mask)),
            "tokens": float(mask.sum()),
        }
    return loss, stats


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean of k3 = π_ref/π − log(π_ref/π) − 1 over `mask`: an unbiased, non-negative estimate of
    KL(π ‖ π_ref) on tokens sampled from π; its gradient (1 − π_ref/π)·∇log π pulls each token's log-prob
    toward the reference's."""
    d = (logp_ref.detach() - logp).clamp(-20, 20)
    return _norm(d.exp() - d - 1.0, mask.float())


def value_loss(values: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return 0.5 * _norm((values - targets) ** 2, mask.float())


def opd_advantage(logp_teacher: torch.Tensor, logp_student: torch.Tensor, outcome: torch.Tensor | float = 0.0,
                  alpha: float = 0.0) -> torch.Tensor:
    """Per-token reverse-KL signal sg[log π_teacher − log π_student] (+ α·outcome advantage)."""
    return (logp_teacher - logp_student).detach() + alpha * outcome
