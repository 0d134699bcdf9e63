"""RMSNorm (one fused Triton kernel each way) and cross-entropy chunked over rows.

RMSNorm: y = w · (x / √(mean(x²) + eps)), statistics in fp32, the normalised value rounded to x's dtype
before the weight multiplies (the convention of temper's `RMSNorm` and of transformers' Llama/GLM
norms). The eager version launches ~6 kernels and keeps three temporaries per call; the fused one reads
x once and writes y once, and its backward recomputes the statistics from x.

`chunked_cross_entropy(hidden, weight, targets)` is the lm-head + cross-entropy without the [N, V]
logits tensor: rows go through in chunks whose logits are recomputed in the backward
(activation checkpointing per chunk). On a 150K vocabulary this is the largest single activation of a
training step. `chunked_logprobs` does the same for the targets' log-probabilities and the entropy (what RL trains
on). The model's losses use both where the logits would be large (model/losses.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import backend


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if backend(x, weight) == "reference" or x.shape[-1] > 65536:
        return rms_norm_reference(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


def _chunked(fn, chunk: int, *rows: torch.Tensor) -> list:
    """`fn` over `chunk`-row slices of `rows` (tensors of equal length), each checkpointed when it builds a graph:
    its intermediates (the chunk's logits) are recomputed in the backward instead of kept."""
    out = []
    for i in range(0, rows[0].shape[0], chunk):
        args = [r[i : i + chunk] for r in rows]
        out.append(checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args))
    return out


def _logits(h: torch.Tensor, weight, norm) -> torch.Tensor:
    h = h if norm is None else norm(h)
    return (weight(h) if callable(weight) else F.linear(h, weight)).float()


def chunked_cross_entropy(hidden, weight, targets, ignore_index: int = -100, chunk: int = 4096, *, norm=None,
                          weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of `norm(hidden) · weightᵀ` (`hidden [N, H]`, `norm` the identity when None) against
    `targets [N]`, weighted per row by `weights` (default: 1 where the target is not `ignore_index`), never holding
    more than `chunk` rows of logits. `weight`: the head's [V, H] weight, or the head itself (a module or function
    of the normed rows giving their logits, e.g. a tensor-parallel head that gathers the vocabulary)."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    w = (targets != ignore_index).float() if weights is None else weights.reshape(-1).float()

    def part(h, t, w):
        logits = _logits(h, weight, norm)
        return (F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none") * w).sum()

    return torch.stack(_chunked(part, chunk, hidden, targets, w)).sum() / w.sum().clamp_min(1.0)


def chunked_logprobs(hidden, weight, targets, chunk: int = 4096, *, norm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of `targets [N]`, entropy) [N] each under softmax(`norm(hidden) · weightᵀ`) in fp32, never
    holding more than `chunk` rows of logits (`weight` as in `chunked_cross_entropy`)."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)

    def part(h, t):
        logp = _logits(h, weight, norm).log_softmax(-1)
        return torch.stack([logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)])

    lp, ent = torch.cat(_chunked(part, chunk, hidden, targets), 1).unbind(0)
    return lp, ent


def chunked_kl(hidden, weight, ref_hidden, ref_weight, chunk: int = 4096, *, norm=None, ref_norm=None) -> torch.Tensor:
    """Σ over rows of KL(p_ref ‖ p) over the vocabulary, p = softmax(`norm(hidden) · weightᵀ`) and p_ref the same of
    the `ref_*` arguments (a frozen reference: no gradient flows to it), never holding more than `chunk` rows of
    either's logits (`weight`, `ref_weight` as in `chunked_cross_entropy`)."""
    hidden, ref_hidden = hidden.reshape(-1, hidden.shape[-1]), ref_hidden.reshape(-1, ref_hidden.shape[-1])

    def part(h, hr):
        lp = _logits(h, weight, norm).log_softmax(-1)
        with torch.no_grad():
            lr = _logits(hr, ref_weight, ref_norm).log_softmax(-1)
        return (lr.exp() * (lr - lp)).sum()

    parts = _chunked(part, chunk, hidden, ref_hidden.detach())
    return torch.stack(parts).sum() if parts else hidden.new_zeros((), dtype=torch.float32)


# ---- Triton ------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _rms_fwd(x_ptr, w_ptr, y_ptr, r_ptr, D, eps, sx, sy, BD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row × stride can pass 2^31 elements
        c = tl.arange(0, BD)
        m = c < D
        x = tl.load(x_ptr + row * sx + c, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        w = tl.load(w_ptr + c, mask=m, other=0.0)
        xn = (x * rstd).to(x_ptr.dtype.element_ty)
        tl.store(y_ptr + row * sy + c, (w * xn).to(y_ptr.dtype.element_ty), mask=m)
        tl.store(r_ptr + row, rstd)

    @triton.jit
    def _rms_bwd(x_ptr, w_ptr, dy_ptr, r_ptr, dx_ptr, dwp_ptr, D, sx, sdy, sdx, BD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row × stride can pass 2^31 elements
        c = tl.arange(0, BD)
        m = c < D
        x = tl.load(x_ptr + row * sx + c, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * sdy + c, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
        rstd = tl.load(r_ptr + row)
        xhat = x * rstd
        g = dy * w  # d/d(xhat)
        dx = rstd * (g - xhat * tl.sum(g * xhat, 0) / D)
        tl.store(dx_ptr + row * sdx + c, dx.to(dx_ptr.dtype.element_ty), mask=m)
        xn = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(dwp_ptr + row * D + c, dy * xn, mask=m)  # per-row partials, summed by torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n, d = x2.shape
        out_dtype = torch.promote_types(weight.dtype, x.dtype)
        y = torch.empty(n, d, dtype=out_dtype, device=x.device)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        bd = triton.next_power_of_2(d)
        _rms_fwd[(n,)](x2, weight, y, rstd, d, eps, x2.stride(0), y.stride(0), BD=bd)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(*shape[:-1], d)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        n, d = x2.shape
        dy2 = dy.reshape(n, d).contiguous()
        dx = torch.empty_like(x2)
        dwp = torch.empty(n, d, dtype=torch.float32, device=x2.device)
        _rms_bwd[(n,)](x2, weight, dy2, rstd, dx, dwp, d, x2.stride(0), dy2.stride(0), dx.stride(0),
                       BD=triton.next_power_of_2(d))
        return dx.view(ctx.shape), dwp.sum(0).to(weight.dtype), None
