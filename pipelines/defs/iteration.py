"""The iteration's assets and checks (their bodies live in `assets/`), at module level so the defs loader finds them."""

from assets.iteration import (
    POLICY,
    env_specs,
    evaluation,
    hack_probes,
    opd_student,
    rewards,
    rollout_batches,
    sao_experts,
    triad_pass_rate,
    verified_envs,
    warm_start,
)
from assets.scaling import scaling

__all__ = ["POLICY", "env_specs", "evaluation", "hack_probes", "opd_student", "rewards", "rollout_batches", "sao_experts",
           "scaling", "triad_pass_rate", "verified_envs", "warm_start"]
