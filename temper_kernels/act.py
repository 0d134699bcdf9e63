"""SwiGLU, `silu(g) ⊙ u` (times a per-row weight: the MoE's routing weight), as one fused kernel each way.

The eager version launches two kernels forward (silu, multiply) and about four backward, and keeps three tensors for
the backward: g and u (the gate and up projections' output) and silu(g). The MoE's routed rows make this large: at
the 524M config (16K tokens, top-4, expert width 704) silu(g) alone is 88 MiB per layer, in bf16.

The fused kernel reads g and u once, computes in fp32, rounds once and writes y; its backward recomputes silu from
g (keeping only g and u) and writes both gradients in one pass:

    s = σ(g),  dy/dg = u · s · (1 + g · (1 − s)),  dy/du = g · s

With a row weight r (`swiglu(g, u, r)`, y = r · silu(g) ⊙ u) both gradients scale by r, and dr is the row's sum of
dy · silu(g) ⊙ u (per column block, summed by torch: deterministic). The MoE applies its routing weights there,
before the down projection, instead of on that projection's output: the same sum in exact arithmetic, and the
backward then keeps no [rows, hidden] output for the weights' gradient (128 MiB a layer at the 524M config).

Rows may be strided (the two halves of the experts' `[g | u]` output are read in place); the last dimension must be
contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend


def swiglu_reference(g: torch.Tensor, u: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    y = F.silu(g) * u
    return y if r is None else y * r[..., None].to(y.dtype)


def swiglu(g: torch.Tensor, u: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """`silu(g) * u`, times `r[..., None]` when given (g and u of one shape and dtype, r of their leading shape)."""
    if (backend(g, u) == "reference" or g.shape != u.shape or g.dtype != u.dtype or g.stride(-1) != 1
            or u.stride(-1) != 1 or g.numel() == 0 or (r is not None and r.shape != g.shape[:-1])):
        return swiglu_reference(g, u, r)
    return _SwiGLU.apply(g, u, r)


# ---- Triton ------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _swiglu_fwd(g_ptr, u_ptr, r_ptr, y_ptr, W, sg, su, sy, HAS_R: tl.constexpr, BI: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row × stride can pass 2^31 elements
        c = tl.program_id(1) * BI + tl.arange(0, BI)
        m = c < W
        g = tl.load(g_ptr + row * sg + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + c, mask=m, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        if HAS_R:
            y = y * tl.load(r_ptr + row).to(tl.float32)
        tl.store(y_ptr + row * sy + c, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_bwd(g_ptr, u_ptr, r_ptr, dy_ptr, dg_ptr, du_ptr, drp_ptr, W, NB, sg, su, sdy, sd,
                    HAS_R: tl.constexpr, BI: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row × stride can pass 2^31 elements
        blk = tl.program_id(1)
        c = blk * BI + tl.arange(0, BI)
        m = c < W
        g = tl.load(g_ptr + row * sg + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + c, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * sdy + c, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        if HAS_R:
            tl.store(drp_ptr + row * NB + blk, tl.sum(dy * g * s * u, 0))  # this block's part of dr
            dy = dy * tl.load(r_ptr + row).to(tl.float32)
        tl.store(du_ptr + row * sd + c, (dy * g * s).to(du_ptr.dtype.element_ty), mask=m)
        tl.store(dg_ptr + row * sd + c, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, I] with one row stride (a view where t's layout allows, else a copy)."""
    return t.reshape(-1, t.shape[-1])


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, r):
        g2, u2 = _rows(g), _rows(u)
        n, i = g2.shape
        r2 = r.reshape(-1).contiguous() if r is not None else g2  # (g2: a placeholder the kernel does not read)
        y = torch.empty(n, i, dtype=g.dtype, device=g.device)
        bi = min(1024, triton.next_power_of_2(i))
        _swiglu_fwd[(n, triton.cdiv(i, bi))](g2, u2, r2, y, i, g2.stride(0), u2.stride(0), y.stride(0),
                                              HAS_R=r is not None, BI=bi)
        ctx.save_for_backward(g, u, r)
        return y.view(g.shape)

    @staticmethod
    def backward(ctx, dy):
        g, u, r = ctx.saved_tensors
        g2, u2 = _rows(g), _rows(u)
        dy2 = _rows(dy.contiguous())
        n, i = g2.shape
        dg = torch.empty(n, i, dtype=g.dtype, device=g.device)
        du = torch.empty_like(dg)
        bi = min(1024, triton.next_power_of_2(i))
        nb = triton.cdiv(i, bi)
        r2 = r.reshape(-1).contiguous() if r is not None else g2
        drp = torch.empty(n, nb, dtype=torch.float32, device=g.device) if r is not None else dg
        _swiglu_bwd[(n, nb)](g2, u2, r2, dy2, dg, du, drp, i, nb, g2.stride(0), u2.stride(0), dy2.stride(0),
                             dg.stride(0), HAS_R=r is not None, BI=bi)
        dr = drp.sum(1).to(r.dtype).view(r.shape) if r is not None and ctx.needs_input_grad[2] else None
        return dg.view(g.shape), du.view(u.shape), dr
