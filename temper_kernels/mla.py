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

Triton (all heads of a token in one program, as FlashMLA's sparse prefill: each selected row is gathered once per
token, not once per block of heads):

* forward: one program per (query token, block of BH = H heads, up to 64) streams the selected rows in tiles of BK
  (gathered ahead of use by the compiler's pipelined asynchronous copies) with an online softmax; at GLM-5's
  64 heads × 512 the [64, 512] fp32 accumulator takes 8 warps (two warpgroups, each a [64, 256] half of DV), the
  query tile living in shared memory. With few programs (decode at batch 1: one per token) the selection is split
  over programs (split-K): each writes its part's normalised output and log-sum-exp, and `_combine_kernel` merges
  them (the log-sum-exp-weighted mean), the same numbers as one pass up to rounding.
* backward, three kernels per chunk of tokens, each program again holding all heads of a token:
  `_bwd_ds_kernel` recomputes P from the saved log-sum-exp and dS = P ⊙ (dO·kcᵀ − delta), written to the chunk's
  [tokens, H, K] buffers in the input dtype (what a fused kernel rounds them to before its dots); `_bwd_dq_kernel`
  gathers the rows again for dq = dS·kv·scale (dq accumulated in the first kernel spilled ~1 KB a thread at GLM-5's
  shapes: the query and dO tiles' wgmma descriptors, hoisted out of the loop, next to a [64, 576] accumulator);
  `_bwd_dkv_kernel` forms each selected row's dkv from all heads at once (dSᵀ·q·scale + Pᵀ·dO, the heads summed
  inside the dot, no cache row read) and adds it with one fp32 atomic per element: K·(DV + DR) atomics per token,
  where a head block of 16 issued H/16 times as many (`dkv_atomics` counts them). Their sum over tokens runs in no
  fixed order (gradients reproducible to rounding, not bit-exact, on the GPU).
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
    if kv.is_contiguous():  # one index_select over the flattened pool: ~3x the advanced-indexing gather on a CPU
        n, s1, d = kv.shape
        flat = (rows[:, None, None] * s1 + idx.clamp_min(0)).reshape(-1)
        g = kv.reshape(n * s1, d).index_select(0, flat).view(*idx.shape, d)  # [B,T,K,D]
    else:
        g = kv[rows[:, None, None], idx.clamp_min(0)]
    # every picked row usable (read eagerly on a CPU only: on a GPU a host sync, in a compiled graph a break): the masks
    # below then change nothing
    every = q.device.type == "cpu" and not torch.compiler.is_dynamo_compiling() and bool(valid.all())
    if not every:
        g = torch.where(valid[..., None], g, 0.0)  # unusable rows read as 0, as in the kernel: a NaN in one stays out
    s = torch.einsum("bthd,btkd->bthk", q, g).float() * scale
    if not every:
        s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    # a query with no usable key (all -inf → NaN) gets 0, as in the kernel; a NaN score (a NaN query head, a NaN row
    # of the cache) stays NaN, as in the kernel: never turned into zeros
    p = torch.softmax(s, -1)
    if not every:
        p = p.masked_fill(~valid.any(-1)[:, :, None, None], 0.0)
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
    def _token(bt, T, H, BH: tl.constexpr):
        """Token `bt`'s (row, position) and this program's head ids and head mask (its head block: program_id 1)."""
        # 64-bit token offsets: b·sq_b and t·sq_t pass 2^31 elements at GLM-5's shapes (64 heads × 576: 58,255 tokens)
        b, t = (bt // T).to(tl.int64), (bt % T).to(tl.int64)
        hh = tl.program_id(1) * BH + tl.arange(0, BH)
        return b, t, hh, hh < H

    @triton.jit
    def _query(q_ptr, bt, T, H, sq_b, sq_t, sq_h, DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr):
        """Token `bt`'s (row, token, head ids, head mask) and absorbed query for this program's heads, split [DV | DR]."""
        b, t, hh, hm = _token(bt, T, H, BH)
        qb = q_ptr + b * sq_b + t * sq_t + hh[:, None] * sq_h
        qn = tl.load(qb + tl.arange(0, DV)[None, :], mask=hm[:, None], other=0.0)
        qr = tl.load(qb + DV + tl.arange(0, DR)[None, :], mask=hm[:, None], other=0.0)
        return b, t, hh, hm, qn, qr

    @triton.jit
    def _slots(idx_ptr, b, t, k0, K, qp, si_b, si_t, BK: tl.constexpr):
        """Slots [k0, k0 + BK) of the token's selection: (slot ids, usable (0 ≤ row ≤ qpos), row ids (0 where not))."""
        kk = k0 + tl.arange(0, BK)
        ix = tl.load(idx_ptr + b * si_b + t * si_t + kk, mask=kk < K, other=-1)
        ok = (kk < K) & (ix >= 0) & (ix <= qp)
        return kk, ok, tl.where(ok, ix, 0)

    @triton.jit
    def _rows(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, DV: tl.constexpr, DR: tl.constexpr,
              BK: tl.constexpr):
        """`_slots` and the usable rows gathered: (slot ids, usable, row ids, latent [BK, DV], rope [BK, DR])."""
        kk, ok, ixs = _slots(idx_ptr, b, t, k0, K, qp, si_b, si_t, BK)
        r = base + ixs[:, None] * skv_s
        kc = tl.load(r + tl.arange(0, DV)[None, :], mask=ok[:, None], other=0.0)
        kr = tl.load(r + DV + tl.arange(0, DR)[None, :], mask=ok[:, None], other=0.0)
        return kk, ok, ixs, kc, kr

    @triton.jit
    def _key_tile(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, qn, qr,
                  DV: tl.constexpr, DR: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
        """One tile of BK selected rows: (slots, usable, row ids, latent [BK, DV], rope [BK, DR], raw scores [BH, BK])."""
        kk, ok, ixs, kc, kr = _rows(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, DV, DR, BK)
        s = tl.dot(qn, tl.trans(kc), input_precision=PREC) + tl.dot(qr, tl.trans(kr), input_precision=PREC)
        return kk, ok, ixs, kc, kr, s

    @triton.jit
    def _fwd_kernel(
        q_ptr, kv_ptr, idx_ptr, qpos_ptr, rows_ptr, o_ptr, lse_ptr,
        T, H, K, KS, scale,
        sq_b, sq_t, sq_h, skv_n, skv_s, si_b, si_t, sp_b, so_b, so_t, so_s, so_h, sl_b, sl_t, sl_s,
        DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """Program (token, head block, part): the selection's slots [part·KS, part·KS + KS). One part: the output and
        log-sum-exp (+inf for a query without a usable key). SPLIT: this part's normalised output (fp32) and its
        log-sum-exp (−inf where it has no usable key), for `_combine_kernel`."""
        b, t, hh, hm, qn, qr = _query(q_ptr, tl.program_id(0), T, H, sq_b, sq_t, sq_h, DV, DR, BH)
        part = tl.program_id(2)
        dv = tl.arange(0, DV)
        qp = tl.load(qpos_ptr + b * sp_b + t)
        base = kv_ptr + tl.load(rows_ptr + b) * skv_n
        m = tl.full((BH,), float("-inf"), tl.float32)
        den = tl.zeros((BH,), tl.float32)
        acc = tl.zeros((BH, DV), tl.float32)
        for k0 in range(part * KS, tl.minimum(K, part * KS + KS), BK):
            _, ok, _, kc, _, s = _key_tile(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, qn, qr, DV, DR, BK, PREC)
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
        tl.store(o_ptr + b * so_b + t * so_t + part * so_s + hh[:, None] * so_h + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=hm[:, None])
        lse = tl.where(empty, float("-inf") if SPLIT else float("inf"), m + tl.log(tl.where(empty, 1.0, den)))
        tl.store(lse_ptr + b * sl_b + t * sl_t + part * sl_s + hh, lse, mask=hm)

    @triton.jit
    def _combine_kernel(op_ptr, lp_ptr, o_ptr, lse_ptr, T, H, NS,
                        sp_b, sp_t, sp_s, sp_h, sq_b, sq_t, sq_s, so_b, so_t, so_h, sl_b, sl_t,
                        BH: tl.constexpr, BD: tl.constexpr, NSP: tl.constexpr):
        """Program (token, head block, DV slice): the split parts' outputs merged, each weighted by exp(its log-sum-exp −
        the total's): o = Σ exp(lse_p − lse)·o_p, lse = log Σ exp(lse_p). No usable key in any part: 0 and +inf, as
        one pass gives; a NaN part makes the head NaN."""
        b, t, hh, hm = _token(tl.program_id(0), T, H, BH)
        dd = tl.program_id(2) * BD + tl.arange(0, BD)
        sp = tl.arange(0, NSP)
        lp = tl.load(lp_ptr + b * sq_b + t * sq_t + sp[:, None] * sq_s + hh[None, :],
                     mask=(sp[:, None] < NS) & hm[None, :], other=float("-inf"))  # [NSP, BH]
        mx = tl.max(lp, 0)
        empty = mx == float("-inf")
        mx = tl.where(empty, 0.0, mx)
        den = tl.sum(tl.exp(lp - mx[None, :]), 0)
        acc = tl.zeros((BH, BD), tl.float32)
        for j in range(0, NS):
            wj = tl.exp(tl.load(lp_ptr + b * sq_b + t * sq_t + j * sq_s + hh, mask=hm, other=float("-inf")) - mx)
            oj = tl.load(op_ptr + b * sp_b + t * sp_t + j * sp_s + hh[:, None] * sp_h + dd[None, :], mask=hm[:, None],
                         other=0.0)
            acc += wj[:, None] * oj
        o = acc / tl.where(empty, 1.0, den)[:, None]
        tl.store(o_ptr + b * so_b + t * so_t + hh[:, None] * so_h + dd[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=hm[:, None])
        if tl.program_id(2) == 0:
            lse = tl.where(empty, float("inf"), mx + tl.log(tl.where(empty, 1.0, den)))
            tl.store(lse_ptr + b * sl_b + t * sl_t + hh, lse, mask=hm)

    @triton.jit
    def _bwd_ds_kernel(
        q_ptr, kv_ptr, idx_ptr, qpos_ptr, rows_ptr, do_ptr, lse_ptr, delta_ptr, ds_ptr, p_ptr,
        c0, T, H, K, scale,
        sq_b, sq_t, sq_h, skv_n, skv_s, si_b, si_t, sp_b, sdo_b, sdo_t, sdo_h, sl_b, sl_t, sw_t, sw_h,
        DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    ):
        """Program (token c0 + i of the chunk, head block): P = exp(s·scale − lse) and dS = P ⊙ (dO·kcᵀ − delta) tile
        by tile, written to row i of the chunk's [tokens, H, K] buffers (0 at unusable slots). No accumulator: dq
        here would hold [H, DV + DR] fp32 next to the query and dO tiles' wgmma descriptors, and spill."""
        i = tl.program_id(0)
        b, t, hh, hm, qn, qr = _query(q_ptr, c0 + i, T, H, sq_b, sq_t, sq_h, DV, DR, BH)
        do = tl.load(do_ptr + b * sdo_b + t * sdo_t + hh[:, None] * sdo_h + tl.arange(0, DV)[None, :],
                     mask=hm[:, None], other=0.0)
        lse = tl.load(lse_ptr + b * sl_b + t * sl_t + hh, mask=hm, other=float("inf"))
        delta = tl.load(delta_ptr + b * sl_b + t * sl_t + hh, mask=hm, other=0.0)
        qp = tl.load(qpos_ptr + b * sp_b + t)
        base = kv_ptr + tl.load(rows_ptr + b) * skv_n
        wbase = i.to(tl.int64) * sw_t + hh[:, None] * sw_h
        for k0 in range(0, K, BK):
            kk, ok, _, kc, _, s = _key_tile(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, qn, qr, DV, DR, BK,
                                            PREC)
            p = tl.where(ok[None, :], tl.exp(s * scale - lse[:, None]), 0.0)  # [BH, BK]
            dp = tl.dot(do, tl.trans(kc), input_precision=PREC)
            wm = hm[:, None] & (kk < K)[None, :]
            tl.store(ds_ptr + wbase + kk[None, :], (p * (dp - delta[:, None])).to(ds_ptr.dtype.element_ty), mask=wm)
            tl.store(p_ptr + wbase + kk[None, :], p.to(p_ptr.dtype.element_ty), mask=wm)

    @triton.jit
    def _bwd_dq_kernel(
        kv_ptr, idx_ptr, qpos_ptr, rows_ptr, ds_ptr, dq_ptr,
        c0, T, H, K, scale,
        sq_b, sq_t, sq_h, skv_n, skv_s, si_b, si_t, sp_b, sw_t, sw_h,
        DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    ):
        """Program (token c0 + i of the chunk, head block): dq = dS·[kc | kr]·scale over the selected rows (gathered
        again, the token's rows once for all of its heads)."""
        i = tl.program_id(0)
        b, t, hh, hm = _token(c0 + i, T, H, BH)
        dv, dr = tl.arange(0, DV), tl.arange(0, DR)
        qp = tl.load(qpos_ptr + b * sp_b + t)
        base = kv_ptr + tl.load(rows_ptr + b) * skv_n
        wbase = i.to(tl.int64) * sw_t + hh[:, None] * sw_h
        dqn = tl.zeros((BH, DV), tl.float32)
        dqr = tl.zeros((BH, DR), tl.float32)
        for k0 in range(0, K, BK):
            kk, _, _, kc, kr = _rows(idx_ptr, base, b, t, k0, K, qp, si_b, si_t, skv_s, DV, DR, BK)
            ds = tl.load(ds_ptr + wbase + kk[None, :], mask=hm[:, None] & (kk < K)[None, :], other=0.0)
            dqn += tl.dot(ds, kc, input_precision=PREC)
            dqr += tl.dot(ds, kr, input_precision=PREC)
        dqb = dq_ptr + b * sq_b + t * sq_t + hh[:, None] * sq_h
        tl.store(dqb + dv[None, :], (dqn * scale).to(dq_ptr.dtype.element_ty), mask=hm[:, None])
        tl.store(dqb + DV + dr[None, :], (dqr * scale).to(dq_ptr.dtype.element_ty), mask=hm[:, None])

    @triton.jit
    def _bwd_dkv_kernel(
        q_ptr, do_ptr, idx_ptr, qpos_ptr, rows_ptr, ds_ptr, p_ptr, dkv_ptr,
        c0, T, H, K, scale,
        sq_b, sq_t, sq_h, si_b, si_t, sp_b, sdo_b, sdo_t, sdo_h, sw_t, sw_h, sdkv_n, sdkv_s,
        DV: tl.constexpr, DR: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    ):
        """Program (token c0 + i of the chunk, head block): each selected row's dkv from all of the block's heads,
        dSᵀ·[q_nope | q_rope]·scale + Pᵀ·dO (the heads summed inside the dots), added with fp32 atomics. Reads no
        cache row: only the slots' ids, the chunk's dS and P, and the token's query and output gradient."""
        i = tl.program_id(0)
        b, t, hh, hm, qn, qr = _query(q_ptr, c0 + i, T, H, sq_b, sq_t, sq_h, DV, DR, BH)
        dv, dr = tl.arange(0, DV), tl.arange(0, DR)
        do = tl.load(do_ptr + b * sdo_b + t * sdo_t + hh[:, None] * sdo_h + dv[None, :], mask=hm[:, None],
                     other=0.0)
        qp = tl.load(qpos_ptr + b * sp_b + t)
        dbase = dkv_ptr + tl.load(rows_ptr + b) * sdkv_n
        wbase = i.to(tl.int64) * sw_t + hh[None, :] * sw_h
        for k0 in range(0, K, BK):
            kk, ok, ixs = _slots(idx_ptr, b, t, k0, K, qp, si_b, si_t, BK)
            wm = (kk < K)[:, None] & hm[None, :]
            dst = tl.load(ds_ptr + wbase + kk[:, None], mask=wm, other=0.0)  # dSᵀ [BK, BH]
            pt = tl.load(p_ptr + wbase + kk[:, None], mask=wm, other=0.0)
            dkc = tl.dot(dst, qn, input_precision=PREC) * scale + tl.dot(pt, do, input_precision=PREC)
            dkr = tl.dot(dst, qr, input_precision=PREC) * scale
            dr_ = dbase + ixs[:, None] * sdkv_s
            tl.atomic_add(dr_ + dv[None, :], dkc, mask=ok[:, None])
            tl.atomic_add(dr_ + DV + dr[None, :], dkr, mask=ok[:, None])


BLOCKS: tuple[int, int, int] | None = None  # (heads, keys, warps) per program for every launch; None: `_blocks`'
# own choice. Set by bench/gpu.py's tile sweep (a knob for measuring, not a setting).
SMS = 132  # H100/H200 SMs: a forward with fewer programs than this splits each selection over programs
SPLIT_TILES = 2  # the least key tiles a split part walks
SPLIT: int | None = None  # parts a selection is split into; None: `_parts`' choice (a knob: tests force either path)
DKV_KEYS = 16  # slots a dkv program's tile holds by default (no spill at GLM-5's [16, 576] tile with 64 heads)
BWD_CHUNK = 1 << 25  # elements of each of the backward's [tokens, H, K] dS and P buffers (a chunk of tokens at a time:
# 256 tokens at GLM-5's 64 heads × top-2048, 64 MiB each in bf16)


def _blocks(h: int, dv: int) -> tuple[int, int, int]:
    """(heads, keys, warps) per program: every head of a token in one program (up to 64), 32 keys a tile; 8 warps
    (two warpgroups) once the [heads, DV] fp32 accumulator passes 64 registers a thread at 4 warps."""
    if BLOCKS is not None:
        return BLOCKS
    bh = max(16, min(64, triton.next_power_of_2(h)))
    return bh, 32, 8 if bh * dv > 128 * 64 else 4


def _parts(programs: int, k: int, bk: int) -> tuple[int, int]:
    """(parts, slots a part) of the forward's split-K: none while the (token, head block) programs fill the GPU;
    else enough parts for about two programs an SM, each at least SPLIT_TILES tiles of BK slots."""
    tiles = triton.cdiv(k, bk)
    if SPLIT is not None:
        n = max(1, min(SPLIT, tiles))
    elif programs >= SMS:
        n = 1
    else:
        n = max(1, min(triton.cdiv(2 * SMS, programs), tiles // SPLIT_TILES))
    per = triton.cdiv(tiles, n) * bk
    return triton.cdiv(k, per), per


def dkv_atomics(idx: torch.Tensor, qpos: torch.Tensor, h: int, dv: int, dr: int, bh: int | None = None) -> int:
    """fp32 atomic adds (elements) the backward issues into dkv for selections idx [B, T, K] at qpos [B, T]: one row
    of DV + DR per usable (token, slot) pair and head block (`bh` heads a program; default `_blocks`' choice)."""
    bh = bh or _blocks(h, dv)[0]
    return int(_valid(idx, qpos).sum()) * triton.cdiv(h, bh) * (dv + dr)


def _prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, qpos, rows, scale, dv):
        b, t, h, d = q.shape
        q, kv, idx, qpos = q.contiguous(), kv.contiguous(), idx.contiguous(), qpos.contiguous()
        rows = rows.to(torch.long).contiguous()
        k = idx.shape[-1]
        o = torch.empty(b, t, h, dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, t, h, dtype=torch.float32, device=q.device)
        bh, bk, warps = _blocks(h, dv)
        hb = triton.cdiv(h, bh)
        ns, per = _parts(b * t * hb, k, bk)
        if ns == 1:
            op, lp, o_s, l_s = o, lse, 0, 0
        else:  # the parts' outputs and log-sum-exps, merged below
            op = torch.empty(b, t, ns, h, dv, dtype=torch.float32, device=q.device)
            lp = torch.empty(b, t, ns, h, dtype=torch.float32, device=q.device)
            o_s, l_s = op.stride(2), lp.stride(2)
        _fwd_kernel[(b * t, hb, ns)](
            q, kv, idx, qpos, rows, op, lp, t, h, k, per, scale,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1),
            qpos.stride(0), op.stride(0), op.stride(1), o_s, op.stride(-2), lp.stride(0), lp.stride(1), l_s,
            DV=dv, DR=d - dv, BH=bh, BK=bk, PREC=_prec(q), SPLIT=ns > 1, num_warps=warps,
        )
        if ns > 1:
            bd = min(dv, 128)
            _combine_kernel[(b * t, hb, dv // bd)](
                op, lp, o, lse, t, h, ns, op.stride(0), op.stride(1), op.stride(2), op.stride(3), lp.stride(0),
                lp.stride(1), lp.stride(2), o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                BH=bh, BD=bd, NSP=triton.next_power_of_2(ns), num_warps=4,
            )
        ctx.save_for_backward(q, kv, idx, qpos, rows, o, lse)
        ctx.scale, ctx.dv = scale, dv
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, idx, qpos, rows, o, lse = ctx.saved_tensors
        b, t, h, d = q.shape
        dv, k = ctx.dv, idx.shape[-1]
        do = do.contiguous()
        delta = (o.float() * do.float()).sum(-1).contiguous()  # [B,T,H]
        dq = torch.empty_like(q)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        bh, bk, warps = _blocks(h, dv)
        bk_dkv = bk if BLOCKS is not None else DKV_KEYS
        hb = triton.cdiv(h, bh)
        n = b * t
        step = max(1, min(n, BWD_CHUNK // max(1, h * k)))
        ds = torch.empty(step, h, k, dtype=q.dtype, device=q.device)  # what the dots take: the input dtype
        p = torch.empty_like(ds)
        common = (q.stride(0), q.stride(1), q.stride(2))
        for c0 in range(0, n, step):
            m = min(step, n - c0)
            _bwd_ds_kernel[(m, hb)](
                q, kv, idx, qpos, rows, do, lse, delta, ds, p, c0, t, h, k, ctx.scale,
                *common, kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1), qpos.stride(0),
                do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), ds.stride(0), ds.stride(1),
                DV=dv, DR=d - dv, BH=bh, BK=bk, PREC=_prec(q), num_warps=warps,
            )
            _bwd_dq_kernel[(m, hb)](
                kv, idx, qpos, rows, ds, dq, c0, t, h, k, ctx.scale,
                *common, kv.stride(0), kv.stride(1), idx.stride(0), idx.stride(1), qpos.stride(0), ds.stride(0),
                ds.stride(1), DV=dv, DR=d - dv, BH=bh, BK=bk, PREC=_prec(q), num_warps=warps,
            )
            _bwd_dkv_kernel[(m, hb)](
                q, do, idx, qpos, rows, ds, p, dkv, c0, t, h, k, ctx.scale,
                *common, idx.stride(0), idx.stride(1), qpos.stride(0), do.stride(0), do.stride(1), do.stride(2),
                ds.stride(0), ds.stride(1), dkv.stride(0), dkv.stride(1),
                DV=dv, DR=d - dv, BH=bh, BK=bk_dkv, PREC=_prec(q), num_warps=warps,
            )
        return dq, dkv.to(kv.dtype), None, None, None, None, None
