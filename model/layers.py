"""Building blocks: RMSNorm, rotary embedding (plain or YaRN), dense SwiGLU FFN, and the MoE layer.

MoE (DeepSeek-V3 / GLM-5 gate):
  s = sigmoid(x·Wᵀ) (fp32)                      scores, unbiased
  choice = s + e_score_correction_bias          selection only
  [group-limited] group score = sum of its top-2 choice scores; keep the best `topk_group` groups
  experts = top-k(choice); weights = s[experts] / Σ s[experts] × routed_scaling_factor
  y = Σ_i w_i · E_i(x) + shared(x)
Dispatch (kernels.moe_experts) sorts the (token, expert) pairs by expert and runs each expert once over
its contiguous slice: a grouped GEMM on the GPU, a loop over experts (never over tokens) on the CPU.
Aux-loss-free balancing: training forwards count tokens per expert; `update_bias(rate)` moves the
bias of overloaded experts down and of underloaded experts up by `rate`.
"""

from __future__ import annotations

import contextvars
import math

import torch
import torch.nn.functional as F
from torch import nn

import temper_kernels as kernels

from .config import ModelConfig

# ---- activation checkpointing -------------------------------------------------------------------------
_replaying = contextvars.ContextVar("temper_replaying", default=False)


def replaying() -> bool:
    """True while a checkpointed layer is recomputed in backward (`Transformer.activation_checkpointing`): code with
    side effects (the MoE's load counts, the indexer statistics a forward collects) skips them, so the replay
    recomputes the saved tensors and changes nothing else. A compiled region (the engine's compiled decode step, no
    autograd) is never a replay, and dynamo cannot trace a ContextVar read."""
    if torch.compiler.is_dynamo_compiling():
        return False
    return _replaying.get()


class KeepFP32(nn.Module):
    """A module whose floating parameters and buffers stay float32 through `.to(dtype)` / `.half()` /
    `.bfloat16()` (device moves still apply): the router and its bias, the rotary frequencies and the
    indexer's head weights are fp32 in the reference implementations. In bf16 the rotary frequencies
    alone put the angle 5.7 rad off at 32K positions."""

    def _apply(self, fn, recurse=True):
        keep = {n: t.detach().clone() for n, t in [*self._parameters.items(), *self._buffers.items()]
                if t is not None and t.dtype == torch.float32}
        super()._apply(fn, recurse)
        for n, orig in keep.items():  # undo a dtype change from the saved fp32 values, keep the device move
            p = self._parameters.get(n)
            t = p if p is not None else self._buffers[n]
            if t.dtype != torch.float32:
                if p is not None:
                    p.data = orig.to(t.device)
                else:
                    self._buffers[n] = orig.to(t.device)
        return self


class FP32Linear(KeepFP32, nn.Linear):
    """nn.Linear kept in float32; callers feed it fp32 inputs."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


# ---- rotary ------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the rotary dims and the cos/sin scale (YaRN's attention factor)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv = 1.0 / pos_freqs
    y = cfg.rope_scaling
    if y is None:
        return inv.float(), 1.0

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(y.beta_fast), corr_dim(y.beta_slow)
    if y.truncate:  # transformers' default: whole dimensions
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra = 1 - ramp  # 1 → keep the original (extrapolated) frequency
    inv = (1.0 / (y.factor * pos_freqs)) * (1 - extra) + inv * extra

    def m(scale: float, ms: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    if y.attention_factor is not None:  # given: used as is (transformers' semantics)
        att = y.attention_factor
    elif y.mscale and y.mscale_all_dim:
        att = m(y.factor, y.mscale) / m(y.factor, y.mscale_all_dim)
    else:
        att = m(y.factor, 1.0)
    return inv.float(), float(att)


class Rotary(KeepFP32):
    """cos/sin tables of shape [..., rope_dim/2] for arbitrary position ids."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv, self.att_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        f = positions.float()[..., None] * self.inv_freq
        return (f.cos() * self.att_scale).to(dtype), (f.sin() * self.att_scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate `x[..., d]` by per-position angles. `cos`/`sin` broadcast to `x[..., d/2]`.

    interleave=True pairs (x0,x1),(x2,x3)…; False pairs (x_i, x_{i+d/2}). Either way the output is laid
    out half-split ([rotated evens | rotated odds] for interleaved input), applied identically to queries
    and keys, so dot products equal those of the textbook layout. One fused kernel on CUDA (`temper_kernels.rope`),
    the torch twin elsewhere.
    """
    return kernels.rope(x, cos, sin, interleave)


# ---- FFNs --------------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


class _LinearFP32(torch.autograd.Function):
    """`F.linear(x.float(), w)` for a low-precision x and an fp32 w, keeping x itself for the backward, not its fp32
    copy (which autograd would keep: 64 MiB a layer at 16K tokens × 1,024 wide; x is kept anyway by the layers that
    read it). The same numbers both ways as the autograd of the plain expression."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x.float(), w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gx = (grad @ w).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).float() if ctx.needs_input_grad[1] \
            else None
        return gx, gw


class Router(KeepFP32):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] → (expert ids [N, k], weights [N, k] in x's dtype)."""
        cfg = self.cfg
        logits = F.linear(x, self.weight.float()) if x.dtype == torch.float32 else _LinearFP32.apply(x, self.weight.float())
        idx, w = kernels.route(
            logits, self.e_score_correction_bias, cfg.num_experts_per_tok,
            cfg.n_group, cfg.topk_group, cfg.scoring_func, cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )
        return idx, w.to(x.dtype)


class Experts(nn.Module):
    """Routed experts as stacked weights: gate_up [E, 2I, H], down [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def weight_tensors(self) -> list[torch.Tensor]:
        return [self.gate_up_proj, self.down_proj]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernels.moe_experts(x, idx, w, self.gate_up_proj, self.down_proj)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        self.register_buffer("expert_load", torch.zeros(cfg.n_routed_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        idx, w = self.gate(flat)
        if self.training and not replaying():  # counted once per forward, not again when a checkpoint replays it
            with torch.no_grad():
                self.expert_load += kernels.moe.expert_counts(idx, self.cfg.n_routed_experts)  # no host sync
        y = self.experts(flat, idx, w).view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    @torch.no_grad()
    def update_bias(self, rate: float = 1e-3) -> torch.Tensor:
        """Aux-loss-free balancing step; returns the load it acted on and resets the counter."""
        load = self.expert_load.clone()
        if load.sum() > 0:
            self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        self.expert_load.zero_()
        return load
