"""Knobs of the trainers: LM/SFT, SAO (and its baselines), OPD, and the RL loop."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seq_len: int = Field(default=128, gt=1)
    batch_size: int = Field(default=16, gt=0)
    lr: float = Field(default=3e-3, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(default=1.0, gt=0)
    mtp_loss_weight: float = Field(default=0.3, ge=0)
    router_bias_rate: float = Field(default=1e-3, ge=0)
    max_steps: int = Field(default=100_000, gt=0)
    max_seconds: float = Field(default=60.0, gt=0)


class SAOConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    loss: Literal["sao", "ppo", "tis", "grpo"] = "sao"
    eps_low: float = Field(default=0.2, ge=0, le=1)
    eps_high: float = Field(default=4.0, ge=0)
    clip: float = Field(default=0.2, gt=0)
    tis_cap: float = Field(default=2.0, gt=0)
    gamma: float = Field(default=1.0, gt=0, le=1)
    alpha: float = Field(default=1.0, gt=0)  # λ_policy = 1 − 1/(α·l)
    staleness: int | None = Field(default=2, ge=0)  # τ; None: no bound (naive async)
    critic_updates: int = Field(default=2, ge=0)
    freeze_critic_attention: bool = True
    lr: float = Field(default=1e-4, gt=0)
    warmup_steps: int = Field(default=0, ge=0)  # linear actor-lr warmup: Adam's first steps are full-size
    critic_lr: float = Field(default=5e-4, gt=0)
    grad_clip: float = Field(default=1.0, gt=0)
    micro_rows: int = Field(default=8, gt=0)
    value_pretrain_steps: int = Field(default=50, ge=0)


class OPDConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-4, gt=0)
    band_low: float = Field(default=0.1, gt=0, lt=1)
    band_high: float = Field(default=10.0, gt=1)
    outcome_alpha: float = Field(default=0.0, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    micro_rows: int = Field(default=8, gt=0)
    steps: int = Field(default=10, ge=0)  # OPD steps in one iteration


class LoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["async", "sync"] = "async"
    steps: int = Field(default=20, ge=0)  # SAO steps per expert in one iteration
    batch_size: int = Field(default=8, gt=0)
    push_every: int = Field(default=1, gt=0)
    in_flight: int = Field(default=8, gt=0)
    group_size: int = Field(default=1, gt=0)  # sync GRPO: rollouts per prompt
    n_slots: int = Field(default=8, gt=0)
    save_every: int = Field(default=5, gt=0)  # training-state checkpoint interval of the pipeline's RL stages
    seed: int = 0
