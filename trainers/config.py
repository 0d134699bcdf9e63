"""Knobs of the language-model / SFT trainer."""

from __future__ import annotations

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
