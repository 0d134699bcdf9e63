"""Advantages for token-level RL on agent trajectories.

A trajectory's *trainable* tokens (the policy's own: actions and summaries, across all of its segments,
in order) are the RL time steps; observation and prompt tokens are not steps at all. The only reward is
the terminal one, after the last trainable token.

* Skip-observation GAE: the TD step from the last token of action i goes straight to the first token
  of action i+1, i.e. GAE runs over the trainable subsequence:
      δ_i = r_i + γ·V_{i+1} − V_i  (V_{N+1} = 0, r_N = R, r_i = 0 otherwise),  A_i = Σ_k (γλ)^k δ_{i+k}.
* Cross-segment (compaction): the chain continues across segment boundaries, so the advantages of
  segment s carry the factor (γλ)^(trainable tokens after s) on the terminal signal.
* Critic targets use λ_critic = 1: G_i = Σ_k γ^k r_{i+k} (= R for every token when γ = 1).
* Length-adaptive λ_policy = 1 − 1/(α·l), l = number of trainable tokens (clamped to [0, 1]).
* GRPO baseline: group-normalised outcome advantages, (R − mean_group) / (std_group + ε), per token.
"""

from __future__ import annotations

import torch


def gae(values: torch.Tensor, reward: float, gamma: float = 1.0, lam: float = 1.0) -> torch.Tensor:
    """GAE over one trajectory's trainable tokens. values [N] (V before each token) → advantages [N]."""
    n = values.shape[0]
    adv = torch.zeros(n, dtype=torch.float32)
    if n == 0:
        return adv
    v = values.float()
    nxt = torch.cat([v[1:], v.new_zeros(1)])
    r = torch.zeros(n)
    r[-1] = reward
    delta = r + gamma * nxt - v
    running = 0.0
    for i in range(n - 1, -1, -1):
        running = float(delta[i]) + gamma * lam * running
        adv[i] = running
    return adv


def returns(n: int, reward: float, gamma: float = 1.0) -> torch.Tensor:
    """Monte-Carlo targets (λ_critic = 1): γ^(N−1−i)·R for trainable token i."""
    if n == 0:
        return torch.zeros(0)
    return reward * gamma ** torch.arange(n - 1, -1, -1, dtype=torch.float32)


def adaptive_lambda(n_trainable: int, alpha: float) -> float:
    """λ_policy = 1 − 1/(α·l): longer trajectories look further ahead."""
    if n_trainable <= 0 or alpha <= 0:
        return 1.0
    return float(min(1.0, max(0.0, 1.0 - 1.0 / (alpha * n_trainable))))


def split_by_segments(flat: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Cut a trajectory-level vector over trainable tokens back into its segments."""
    out, start = [], 0
    for c in counts:
        out.append(flat[start : start + c])
        start += c
    if start != flat.shape[0]:
        raise ValueError(f"segment counts sum to {start}, vector has {flat.shape[0]}")
    return out


def grpo_advantages(rewards: list[float], groups: list[str], eps: float = 1e-6) -> list[float]:
    """Outcome advantage per trajectory, normalised within its group (same prompt)."""
    by: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in by.values():
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float32)
        std = r.std(unbiased=False) if len(idx) > 1 else torch.tensor(0.0)
        norm = (r - r.mean()) / (std + eps)
        for j, i in enumerate(idx):
            out[i] = float(norm[j])
    return out
