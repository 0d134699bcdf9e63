"""Rotary position embedding as one fused kernel each way.

`rope(x, cos, sin, interleave)` rotates `x[..., d]` by per-position angles, laid out half-split on output
([rotated first elements | rotated second elements]); `interleave=True` pairs (x0, x1), (x2, x3), …, `False` pairs
(x_i, x_{i+d/2}) (see `model.layers.apply_rope`, which calls it). `cos` / `sin` hold one row of d/2 values per
position and broadcast over the dimensions between the positions and the last one (the heads):
x [B, T, H, d] with cos [B, T, 1, d/2], or x [B, T, d] with cos [B, T, d/2].

The eager version launches seven kernels per call (four multiplies, a subtract, an add and the concatenation) and
the model calls it three times a layer (the query's and the key's rotary part, the indexer's); on the H200's decode
step that is about 140 of its ~600 launches (bench/decode_ops.py). The fused kernel reads x once (any strides
between rows and heads, the last dimension contiguous: the slices `q[..., nope:]` and `kv[..., r:]` are read in
place), computes in fp32 and writes y once. Its backward is the same kernel rotating by −θ from the half-split
layout back to x's.
"""

from __future__ import annotations

import math

import torch

from . import backend


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rows(x: torch.Tensor, cos: torch.Tensor) -> tuple[int, int] | None:
    """(positions R, heads G) when x is [*P, *G, d] and cos [*P, 1…, d/2] with P a prefix of x's shape; else None."""
    lead = list(cos.shape[:-1])
    while lead and lead[-1] == 1:
        lead.pop()
    k = len(lead)
    if list(x.shape[:k]) != lead or x.dim() - 1 < k:
        return None
    return math.prod(lead), math.prod(x.shape[k:-1])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    d = x.shape[-1]
    shape = _rows(x, cos) if d % 2 == 0 and cos.shape == sin.shape and cos.shape[-1] == d // 2 else None
    if (backend(x, cos, sin) == "reference" or shape is None or cos.requires_grad or sin.requires_grad
            or x.stride(-1) != 1):
        return rope_reference(x, cos, sin, interleave)
    return _Rope.apply(x, cos, sin, interleave, *shape)


# ---- Triton ------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, c_ptr, s_ptr, y_ptr, G, sxr, sxg, syr, syg, HALF: tl.constexpr, BG: tl.constexpr,
                     BH: tl.constexpr, IN_PAIRS: tl.constexpr, OUT_PAIRS: tl.constexpr, SIGN: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)  # r × sxr passes 2^31 elements (GLM-5's q slice: past 131,072 tokens)
        g = tl.program_id(1) * BG + tl.arange(0, BG)
        i = tl.arange(0, BH)
        im = i < HALF
        m = (g < G)[:, None] & im[None, :]
        c = tl.load(c_ptr + r * HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
        s = tl.load(s_ptr + r * HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
        xb = x_ptr + r * sxr + g[:, None] * sxg
        if IN_PAIRS:
            a = tl.load(xb + (2 * i)[None, :], mask=m, other=0.0).to(tl.float32)
            b = tl.load(xb + (2 * i + 1)[None, :], mask=m, other=0.0).to(tl.float32)
        else:
            a = tl.load(xb + i[None, :], mask=m, other=0.0).to(tl.float32)
            b = tl.load(xb + (i + HALF)[None, :], mask=m, other=0.0).to(tl.float32)
        y1 = a * c - SIGN * (b * s)
        y2 = b * c + SIGN * (a * s)
        yb = y_ptr + r * syr + g[:, None] * syg
        if OUT_PAIRS:
            tl.store(yb + (2 * i)[None, :], y1.to(y_ptr.dtype.element_ty), mask=m)
            tl.store(yb + (2 * i + 1)[None, :], y2.to(y_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(yb + i[None, :], y1.to(y_ptr.dtype.element_ty), mask=m)
            tl.store(yb + (i + HALF)[None, :], y2.to(y_ptr.dtype.element_ty), mask=m)


def _launch(x3: torch.Tensor, c: torch.Tensor, s: torch.Tensor, in_pairs: bool, out_pairs: bool, sign: int
            ) -> torch.Tensor:
    """x3 [R, G, d] (last dim contiguous) rotated into a new contiguous [R, G, d]."""
    r, g, d = x3.shape
    y = torch.empty(r, g, d, dtype=x3.dtype, device=x3.device)
    bg = min(triton.next_power_of_2(max(g, 1)), 16)
    _rope_kernel[(r, triton.cdiv(g, bg))](
        x3, c, s, y, g, x3.stride(0), x3.stride(1), y.stride(0), y.stride(1),
        HALF=d // 2, BG=bg, BH=triton.next_power_of_2(d // 2), IN_PAIRS=in_pairs, OUT_PAIRS=out_pairs, SIGN=sign,
    )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleave: bool, r: int, g: int):
        c, s = cos.reshape(r, -1).contiguous(), sin.reshape(r, -1).contiguous()
        ctx.save_for_backward(c, s)
        ctx.interleave, ctx.shape = interleave, x.shape
        x3 = x.reshape(r, g, x.shape[-1])  # a view for the model's slices (positions merge, heads stay strided)
        return _launch(x3, c, s, interleave, False, 1).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        c, s = ctx.saved_tensors
        d = ctx.shape[-1]
        dy3 = dy.reshape(c.shape[0], -1, d)
        if dy3.stride(-1) != 1:
            dy3 = dy3.contiguous()
        dx = _launch(dy3, c, s, False, ctx.interleave, -1).view(ctx.shape)  # rotate back by −θ, into x's layout
        return dx, None, None, None, None, None
