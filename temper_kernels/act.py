"""SwiGLU, `silu(g) ⊙ u`, as one fused kernel each way.

The eager version launches two kernels forward (silu, multiply) and about four backward, and keeps three tensors for
the backward: g and u (the gate and up projections' output) and silu(g). The MoE's routed rows make this large: at
the 524M config (16K tokens, top-4, expert width 704) silu(g) alone is 88 MiB per layer, in bf16.

The fused kernel reads g and u once, computes in fp32, rounds once and writes y; its backward recomputes silu from
g (keeping only g and u) and writes both gradients in one pass:

    s = σ(g),  dy/dg = u · s · (1 + g · (1 − s)),  dy/du = g · s

Rows may be strided (the two halves of the experts' `[g | u]` output are read in place); the last dimension must be
contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend


def swiglu_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`silu(g) * u` (g and u of one shape and dtype)."""
    if (backend(g, u) == "reference" or g.shape != u.shape or g.dtype != u.dtype or g.stride(-1) != 1
            or u.stride(-1) != 1 or g.numel() == 0):
        return swiglu_reference(g, u)
    return _SwiGLU.apply(g, u)


# ---- Triton ------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _swiglu_fwd(g_ptr, u_ptr, y_ptr, W, sg, su, sy, BI: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BI + tl.arange(0, BI)
        m = c < W
        g = tl.load(g_ptr + row * sg + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + c, mask=m, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(y_ptr + row * sy + c, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_bwd(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, W, sg, su, sdy, sd, BI: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BI + tl.arange(0, BI)
        m = c < W
        g = tl.load(g_ptr + row * sg + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + c, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * sdy + c, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(du_ptr + row * sd + c, (dy * g * s).to(du_ptr.dtype.element_ty), mask=m)
        tl.store(dg_ptr + row * sd + c, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, I] with one row stride (a view where t's layout allows, else a copy)."""
    return t.reshape(-1, t.shape[-1])


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        g2, u2 = _rows(g), _rows(u)
        n, i = g2.shape
        y = torch.empty(n, i, dtype=g.dtype, device=g.device)
        bi = min(1024, triton.next_power_of_2(i))
        _swiglu_fwd[(n, triton.cdiv(i, bi))](g2, u2, y, i, g2.stride(0), u2.stride(0), y.stride(0), BI=bi)
        ctx.save_for_backward(g, u)
        return y.view(g.shape)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        g2, u2 = _rows(g), _rows(u)
        dy2 = _rows(dy.contiguous())
        n, i = g2.shape
        dg = torch.empty(n, i, dtype=g.dtype, device=g.device)
        du = torch.empty_like(dg)
        bi = min(1024, triton.next_power_of_2(i))
        _swiglu_bwd[(n, triton.cdiv(i, bi))](g2, u2, dy2, dg, du, i, g2.stride(0), u2.stride(0), dy2.stride(0),
                                              dg.stride(0), BI=bi)
        return dg.view(g.shape), du.view(u.shape)
