"""Sparse MLA attention over DSA-selected latent rows (FlashMLA-style, absorbed form).

Every head of query token t attends the same `K` selected cache rows `kv[idx[t, j]]`, each row being
MLA's latent `[c_kv (DV) | k_pe (DR)]`:

    s[h, j] = scale · q[t, h] · kv[idx[t, j]]            (q absorbed: [q_nope·W_UK | q_pe], DV + DR wide)
    o[t, h] = Σ_j softmax_j(s[h, :]) · kv[idx[t, j], :DV]

A selected index is used iff 0 ≤ idx ≤ qpos[t] (causal; −1 pads). A query without a usable key gets 0; a NaN
in a query head or in a usable row makes that head's output NaN (twin and kernel alike, never zeros).
The FLOPs are 2·H·K·(2·DV + DR) per query, independent of the context length: this is where DSA saves
compute in training and prefill, and where decode reads K rows of the cache in place.

`slots` lets the rows of a batch live anywhere in a slot pool: row b reads `kv[slots[b]]`, so a decode
batch whose slots are not contiguous gathers nothing up front.

Triton: one program per (query token, block of heads) streams the selected rows in tiles of BK with an
online softmax (forward) and recomputes the probabilities from the saved log-sum-exp (backward). The
backward accumulates dkv with fp32 atomics, so its summation order is not fixed (gradients are
reproducible to rounding, not bit-exact, on the GPU).
"""

from __future__ import annotations

import torch

from . import backend


def _valid(idx: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    return (idx >= 0) & (idx <= qpos[..., None])


def sparse_mla_reference(q, kv, idx, qpos, scale: float, dv: int, slots: torch.Tensor | None = None):
    """The torch twin (autograd through plain ops): q [B,T,H,D], kv [B or N,S,D], idx [B,T,K], qpos [B,T]."""
    b = q.shape[0]
    rows = slots if slots is not None else torch.arange(b, device=q.device)
    valid = _valid(idx, qpos)
    g = kv[rows[:, None, None], idx.clamp_min(0)]  # [B,T,K,D]
    g = torch.where(valid[..., None], g, 0.0)  # unusable rows read as 0, as in the kernel: a NaN in one stays out
    s = torch.einsum("bthd,btkd->bthk", q, g).float() * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    # a query with no usable key (all -inf → NaN) gets 0, as in the kernel; a NaN score (a NaN query head, a NaN row
    # of the cache) stays NaN, as in the kernel: never turned into zeros
    p = torch.softmax(s, -1).masked_fill(~valid.any(-1)[:, :, None, None], 0.0)
    return torch.einsum("bthk,btkv->bthv", p.to(q.dtype), g[..., :dv])


def sparse_mla(q, kv, idx, qpos, scale: float, dv: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output [B,T,H,dv] (see the module docstring)."""
    d = q.shape[-1]
    if backend(q, kv, idx) == "reference" or not supported(dv, d - dv):
        return sparse_mla_reference(q, kv, idx, qpos, scale, dv, slots)
    rows = slots if slots is not None else torch.arange(q.shape[0], device=q.device)
    return _SparseMLA.apply(q, kv, idx, qpos, rows, scale, dv)


def supported(dv: int, dr: int) -> bool:
    """The Triton kernels tile DV and DR with tl.dot: both powers of two, at least 16."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (dv, dr))


# ---- Triton ------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _query(q_ptr, T, H, sq_b, sq_t, sq_h, DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr):
        """This program's (row, token, head ids, head mask) and its absorbed query, split [DV | DR]."""
        bt = tl.program_id(0)
        # 64-bit token offsets: b·sq_b and t·sq_t pass 2^31 elements at GLM-5's shapes (64 heads × 576: 58,255 tokens)
        b, t = (bt // T).to(tl.int64), (bt % T).to(tl.int64)
        hh = tl.program_id(1) * BH + tl.arange(0, BH)
        hm = hh < H
        qb = q_ptr + b * sq_b + t * sq_t + hh[:, None] * sq_h
        qn = tl.load(qb + tl.arange(0, DV)[None, :], mask=hm[:, None], other=0.0)
        qr = tl.load(qb + DV + tl.arange(0, DR)[None, :], mask=hm[:, None], other=0.0)
        return b, t, hh, hm, qn, qr

    @triton.jit
    def _key_tile(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, qn, qr,
                  DV: tl.constexpr, DR: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
        """One tile of BK selected rows: (usable, row ids, latent [BK, DV], rope [BK, DR], raw scores [BH, BK])."""
        kk = k0 + tl.arange(0, BK)
        ix = tl.load(idx_ptr + b * si_b + t * si_t + kk, mask=kk < K, other=-1)
        ok = (kk < K) & (ix >= 0) & (ix <= qp)
        ixs = tl.where(ok, ix, 0)
        r = base + ixs[:, None] * skv_s
        kc = tl.load(r + tl.arange(0, DV)[None, :], mask=ok[:, None], other=0.0)
        kr = tl.load(r + DV + tl.arange(0, DR)[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(qn, tl.trans(kc), input_precision=PREC) + tl.dot(qr, tl.trans(kr), input_precision=PREC)
        return ok, ixs, kc, kr, s

    @triton.jit
    def _fwd_kernel(
        q_ptr, kv_ptr, idx_ptr, qpos_ptr, rows_ptr, o_ptr, lse_ptr,
        T, H, K, scale,
        sq_b, sq_t, sq_h, skv_n, skv_s, si_b, si_t, sp_b, so_b, so_t, so_h, sl_b, sl_t,
        DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    ):
        b, t, hh, hm, qn, qr = _query(q_ptr, T, H, sq_b, sq_t, sq_h, DV, DR, BH)
        dv = tl.arange(0, DV)
        qp = tl.load(qpos_ptr + b * sp_b + t)
        base = kv_ptr + tl.load(rows_ptr + b) * skv_n
        m = tl.full((BH,), float("-inf"), tl.float32)
        den = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, DV), tl.float32)
        for k0 in range(0, K, BK):
            ok, ixs, kc, kr, s = _key_tile(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, qn, qr, DV, DR, BK, PREC)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            den = den * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc, input_precision=PREC)
            m = m_new
        empty = den == 0.0
        o = acc / tl.where(empty, 1.0, den)[:, None]
        tl.store(o_ptr + b * so_b + t * so_t + hh[:, None] * so_h + dv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=hm[:, None])
        lse = tl.where(empty, float("inf"), m + tl.log(tl.where(empty, 1.0, den)))
        tl.store(lse_ptr + b * sl_b + t * sl_t + hh, lse, mask=hm)

    @triton.jit
    def _bwd_kernel(
        q_ptr, kv_ptr, idx_ptr, qpos_ptr, rows_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
        T, H, K, scale,
        sq_b, sq_t, sq_h, skv_n, skv_s, si_b, si_t, sp_b, sdo_b, sdo_t, sdo_h, sl_b, sl_t,
        sdkv_n, sdkv_s,
        DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    ):
        b, t, hh, hm, qn, qr = _query(q_ptr, T, H, sq_b, sq_t, sq_h, DV, DR, BH)
        dv, dr = tl.arange(0, DV), tl.arange(0, DR)
        do = tl.load(do_ptr + b * sdo_b + t * sdo_t + hh[:, None] * sdo_h + dv[None, :], mask=hm[:, None],
                     other=0.0)
        lse = tl.load(lse_ptr + b * sl_b + t * sl_t + hh, mask=hm, other=float("inf"))
        delta = tl.load(delta_ptr + b * sl_b + t * sl_t + hh, mask=hm, other=0.0)
        qp = tl.load(qpos_ptr + b * sp_b + t)
        slot = tl.load(rows_ptr + b)
        base = kv_ptr + slot * skv_n
        dbase = dkv_ptr + slot * sdkv_n
        dqn = tl.zeros((BH, DV), tl.float32)
        dqr = tl.zeros((BH, DR), tl.float32)
        for k0 in range(0, K, BK):
            ok, ixs, kc, kr, s = _key_tile(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, qn, qr, DV, DR, BK, PREC)
            p = tl.where(ok[None, :], tl.exp(s * scale - lse[:, None]), 0.0)  # [BH, BK]
            dp = tl.dot(do, tl.trans(kc), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dsl = ds.to(kc.dtype)
            dqn += tl.dot(dsl, kc, input_precision=PREC)
            dqr += tl.dot(dsl, kr, input_precision=PREC)
            dkc = tl.dot(tl.trans(dsl), qn, input_precision=PREC) * scale + tl.dot(
                tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dkr = tl.dot(tl.trans(dsl), qr, input_precision=PREC) * scale
            dr_ = dbase + ixs[:, None] * sdkv_s
            tl.atomic_add(dr_ + dv[None, :], dkc, mask=ok[:, None])
            tl.atomic_add(dr_ + DV + dr[None, :], dkr, mask=ok[:, None])
        dqb = dq_ptr + b * sq_b + t * sq_t + hh[:, None] * sq_h
        tl.store(dqb + dv[None, :], (dqn * scale).to(dq_ptr.dtype.element_ty), mask=hm[:, None])
        tl.store(dqb + DV + dr[None, :], (dqr * scale).to(dq_ptr.dtype.element_ty), mask=hm[:, None])


BLOCKS: tuple[int, int, int] | None = None  # (heads, keys, warps) per program for every launch; None: `_blocks`'
# own choice. Set by bench/gpu.py's tile sweep (a knob for measuring, not a setting).


def _blocks(h: int, dv: int) -> tuple[int, int, int]:
    """(heads, keys, warps) per program: the [heads, DV] fp32 accumulator stays within ~32K registers' worth per
    program (with 4 warps)."""
    if BLOCKS is not None:
        return BLOCKS
    bh = max(16, min(64, triton.next_power_of_2(h), 8192 // dv))
    return bh, 32, 4


def _prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, qpos, rows, scale, dv):
        b, t, h, d = q.shape
        q, kv, idx, qpos = q.contiguous(), kv.contiguous(), idx.contiguous(), qpos.contiguous()
        rows = rows.to(torch.long).contiguous()
        o = torch.empty(b, t, h, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, t, h, dtype=torch.float32, device=q.device)
        bh, bk, warps = _blocks(h, dv)
        grid = (b * t, triton.cdiv(h, bh))
        _fwd_kernel[grid](
            q, kv, idx, qpos, rows, o, lse, t, h, idx.shape[-1], scale,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1),
            qpos.stride(0), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
            DV=dv, DR=d - dv, BH=bh, BK=bk, PREC=_prec(q), num_warps=warps,
        )
        ctx.save_for_backward(q, kv, idx, qpos, rows, o, lse)
        ctx.scale, ctx.dv = scale, dv
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, idx, qpos, rows, o, lse = ctx.saved_tensors
        b, t, h, d = q.shape
        do = do.contiguous()
        delta = (o.float() * do.float()).sum(-1).contiguous()  # [B,T,H]
        dq = torch.empty_like(q)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        bh, bk, warps = _blocks(h, ctx.dv)
        _bwd_kernel[(b * t, triton.cdiv(h, bh))](
            q, kv, idx, qpos, rows, do, lse, delta, dq, dkv, t, h, idx.shape[-1], ctx.scale,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1),
            qpos.stride(0), do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1),
            dkv.stride(0), dkv.stride(1),
            DV=ctx.dv, DR=d - ctx.dv, BH=bh, BK=bk, PREC=_prec(q), num_warps=warps,
        )
        return dq, dkv.to(kv.dtype), None, None, None, None, None
