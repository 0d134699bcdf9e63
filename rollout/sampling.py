"""Sampling parameters (SGLang's `sampling_params` subset) and the row-wise sampler.

Log-probs returned by the engine are log-softmax of the model's *raw* logits — temperature 1, before
top-k / top-p / min-p truncation — i.e. log π(token | context) of the policy itself, the quantity the
trainer recomputes for its importance ratio. They do not depend on the sampling knobs.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=0)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)
    sampling_seed: int | None = Field(default=None, ge=0, lt=2**64)  # torch generators take 64 bits
    skip_special_tokens: bool = True
    # SGLang's fields, as slime sends them: keep the matched stop string in the text (`no_stop_trim`); spaces
    # between special tokens in decoded text (byte-level decoding writes none either way)
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        if v is None:  # SGLang's `"stop": null`
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _no_stop_ids(cls, v: Any) -> Any:
        return [] if v is None else v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def filtered_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to one row of logits (fp32)."""
    x = logits.float() / max(p.temperature, 1e-6)
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = x.sort(descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> torch.Tensor:
    """Token ids [B] drawn from a batch of logits [B, V] on its own device, row i with `params[i]` and the generator
    `gens[i]` (on that device; None: the device's default). No host sync. A sampled row draws exactly what
    `torch.multinomial(filtered_logits(row).softmax(-1), 1, generator=gen)` draws — the same race `argmax(p / q)`,
    q ~ Exp(1), that multinomial runs for one sample, without its `.item()` checks — so seeded requests reproduce
    whatever they are batched with; greedy rows take the argmax and leave their generator untouched."""
    tok = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tok
    x, ps = logits[rows].float(), [params[i] for i in rows]
    dev, v = x.device, x.shape[-1]
    x = x / torch.tensor([max(p.temperature, 1e-6) for p in ps], device=dev)[:, None]
    if any(0 < p.top_k < v for p in ps):  # the k-th largest value of each row (the smallest for rows without top-k)
        k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in ps], device=dev)
        x = x.masked_fill(x < x.sort(-1, descending=True).values.gather(1, k[:, None] - 1), float("-inf"))
    if any(p.top_p < 1.0 for p in ps):
        sorted_x, order = x.sort(-1, descending=True)
        probs = sorted_x.softmax(-1)
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in ps], device=dev)
        drop = probs.cumsum(-1) - probs > top_p[:, None]
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if any(p.min_p > 0 for p in ps):
        probs = x.softmax(-1)
        min_p = torch.tensor([p.min_p for p in ps], device=dev)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    probs = x.softmax(-1)
    q = torch.empty_like(probs)
    for j, i in enumerate(rows):  # each request's own random stream
        q[j].exponential_(generator=gens[i])
    tok[rows] = (probs / q).argmax(-1)
    return tok


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    return int(sample(logits[None], [p], [gen])[0])
