"""Lightning-indexer scores fused with a deterministic top-k.

For query t and past key s the indexer score is

    I(t, s) = Σ_j w[t, j] · ReLU(q[t, j] · k[s])        (fp32 accumulation)

and a query keeps the `topk` keys with the largest scores among its allowed keys (s ≤ qpos[t]), ties
going to the earlier position, returned ascending by position: exactly `stable_topk`'s set.

Triton path, no host sync:

1. `_scores_kernel` computes the scores as DeepGEMM's MQA logits do: a tile of BT query rows × HI heads (padded to a
   power of two) is the M = BT·HI side of one dot against a key tile (M = 128 at GLM-5's 32 heads on tensor cores:
   e4m3 with FP8, else bf16 / fp16 as given; fp32 as FMA dots), then ReLU, the head weights and the sum over heads
   in registers, and fp32 scores out (4 bytes a key). Only causal tiles: a program walks its column blocks up to the
   last one some row of its tile may see (s ≤ qpos); the tiles past that are neither computed nor written, and
   within a computed tile the keys past a row's qpos are −inf. ReLU propagates NaN, as torch's does.
2. The top-k (`topk_rows`) is a radix select over 4-byte order-preserving keys: each fp32 score maps to an int32
   whose signed order is the scores' order (NaN as −inf, −0.0 as +0.0: `stable_topk`'s ranking). One program
   holds a block of a row's keys in registers and finds the TOPK-th largest key bit by bit (32 counting passes, a
   1-bit MSB radix select), then keeps every key above it and the tied keys in position order up to TOPK (the tie
   rule), written compacted and ascending by position. Only the causal prefix (s ≤ qpos) is read: blocks past it
   do nothing, and a row with at most TOPK allowed keys is simply 0..TOPK−1 (what `stable_topk` picks there).
   A row longer than one block (long decode rows, long prefill rows) is split over programs, each keeping its
   block's top TOPK (key, position) candidates; merge passes then select over the candidates of G blocks at a
   time, until one block's candidates remain. The global top-k is inside the union of the blocks' top-ks under
   the same total order (score desc, position asc), so the split changes nothing.

NaN scores rank as −inf on every path (they tie with masked keys and lose to every number; among −inf ties the
earlier position wins).

FP8 mode (`fp8=True`, GLM-5 / DeepSeek-V3.2 run the indexer this way): queries (per token and head) and
keys (per token) are scaled to e4m3's range and rounded to float8_e4m3fn; the scales are folded back
into the weights and the scores. On a GPU the tile products run on fp8 tensor cores; the reference
computes with the dequantised values.
"""

from __future__ import annotations

import torch

from . import backend

CHUNK_ELEMS = 1 << 25  # budget for one [B, rows, S] block of scores / keys
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k largest entries along the last dim, ascending by position.

    Deterministic: among entries equal to the k-th largest value the earliest positions win, so the
    selected *set* never depends on kernel scheduling (torch.topk gives no such guarantee on ties). NaN ranks
    as −inf, and −0.0 equals +0.0, as in the Triton top-k.
    """
    # NaN ranks as -inf (torch.topk would rank it first): it ties with -inf and masked keys, the earlier position first.
    # (Not nan_to_num(nan=-inf): that also turns -inf into the lowest finite float, ranking NaN below masked keys.)
    scores = torch.where(scores.isnan(), float("-inf"), scores)
    thr = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > thr
    tie = scores == thr
    need = k - above.sum(-1, keepdim=True)
    sel = above | (tie & (tie.cumsum(-1) <= need))  # exactly k per row
    # the selected positions, ascending: the k smallest of (position where selected, else past the end); no
    # nonzero(), whose output shape the host must read (a sync)
    n = scores.shape[-1]
    pos = torch.arange(n, device=scores.device)
    return torch.where(sel, pos, n).topk(k, dim=-1, largest=False, sorted=True).values


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] → (e4m3 values [..., d], fp32 scale [...]) with x ≈ values · scale."""
    amax = x.abs().amax(-1).clamp_min(1e-12).float()
    scale = amax / FP8_MAX
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def scores_reference(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, relu: bool = True) -> torch.Tensor:
    """q [B,T,HI,d], w [B,T,HI], k [B,S,d] → I [B,T,S] (fp32). `relu`: Σ_j w_j·ReLU(q_j·k) (GLM-5 in
    transformers, DeepSeek-V3.2); False: Σ_j w_j·(q_j·k) (Megatron's `dsa_indexer_scoring_relu=False`)."""
    b, t, h, d = q.shape
    logits = torch.matmul(q.float().reshape(b, t * h, d), k.float().transpose(1, 2))
    if relu:
        logits = logits.relu()
    return torch.matmul(w.float().unsqueeze(-2), logits.view(b, t, h, -1)).squeeze(-2)


def _fp8_inputs(q, w, k):
    q8, qs = quantize_fp8(q)  # [B,T,HI,d], [B,T,HI]
    k8, ks = quantize_fp8(k)  # [B,S,d], [B,S]
    return q8, w.float() * qs, k8, ks


def indexer_topk_reference(q, w, k, qpos, topk: int, fp8: bool = False, relu: bool = True) -> torch.Tensor:
    """The torch twin: scores in query chunks, causal mask, `stable_topk`."""
    b, t = q.shape[:2]
    s = k.shape[1]
    topk = min(topk, s)
    ks = None
    if fp8:
        q, w, k, ks = _fp8_inputs(q, w, k)
        q, k = q.float(), k.float()
    kpos = torch.arange(s, device=k.device)
    step = max(1, CHUNK_ELEMS // max(1, q.shape[2] * s * b))
    if t == 1:  # one query (a decode step): one chunk, and no guard on the chunk size when compiled
        step = 1
    out = []
    for t0 in range(0, t, step):
        sc = scores_reference(q[:, t0 : t0 + step], w[:, t0 : t0 + step], k, relu)
        if ks is not None:
            sc = sc * ks[:, None, :]
        sc.masked_fill_(kpos > qpos[:, t0 : t0 + step, None], float("-inf"))
        out.append(stable_topk(sc, topk))
    return torch.cat(out, 1)


def indexer_topk(q, w, k, qpos, topk: int, fp8: bool = False, relu: bool = True) -> torch.Tensor:
    """Selected key positions [B, T, min(topk, S)] (int64, ascending) for queries q [B,T,HI,d] with head
    weights w [B,T,HI], keys k [B,S,d], query positions qpos [B,T]; `relu` as in `scores_reference`."""
    if backend(q, w, k, qpos) == "reference" or not supported(q.shape[-1]):
        return indexer_topk_reference(q, w, k, qpos, topk, fp8, relu)
    return _indexer_topk_triton(q, w, k, qpos, topk, fp8, relu)


# ---- Triton ------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - the reference path needs no triton
    triton = None

if triton is not None:

    @triton.jit
    def _scores_kernel(
        q_ptr, w_ptr, k_ptr, ks_ptr, qpos_ptr, sc_ptr,
        T, S, t0,
        sq_b, sq_t, sq_h, sw_b, sw_t, sk_b, sk_s, sks_b, sp_b, so_b, so_t, NC,
        HI: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
        BS: tl.constexpr, HAS_KS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
        RELU: tl.constexpr,
    ):
        """Program (b, row block, column group): the scores of BT query rows against NC·BS keys, BS at a time. The BT
        rows' HI heads (padded to HP) are the M = BT·HP rows of one dot [BT·HP, D] × [D, BS] (the query tile loaded
        once); ReLU and the head weights apply to the [BT·HP, BS] logits in registers and the heads are summed to
        [BT, BS]. Only causal tiles: the loop stops at the last column block some row may see (s ≤ qpos), so a block
        wholly past every row's qpos computes and writes nothing (no reader of the scores looks past a row's qpos);
        inside a computed tile the keys past a row's qpos are −inf."""
        b = tl.program_id(0)
        rb = tl.program_id(1) * BT
        g0 = tl.program_id(2) * (NC * BS)
        rows = rb + tl.arange(0, BT)  # query rows within this chunk
        rmask = rows < T
        qp = tl.load(qpos_ptr + b * sp_b + t0 + rows, mask=rmask, other=-1)
        nb = tl.minimum(tl.cdiv(tl.max(qp, 0) + 1 - g0, BS), NC).to(tl.int32)  # column blocks in view (≤ 0: none)
        m = tl.arange(0, BT * HP)  # row m of the dot: query row rb + m // HP, head m % HP
        mt, mh = rb + m // HP, m % HP
        mmask = (mt < T) & (mh < HI)
        qrow = q_ptr + b * sq_b + (t0 + mt)[:, None] * sq_t + mh[:, None] * sq_h
        wm = tl.load(w_ptr + b * sw_b + (t0 + mt) * sw_t + mh, mask=mmask, other=0.0)
        if BD == D:  # the whole query tile, once (tensor-core dots)
            qm = tl.load(qrow + tl.arange(0, D)[None, :], mask=mmask[:, None], other=0.0)
            if UPCAST:
                qm = qm.to(tl.float32)
        for j in range(0, nb):
            cols = g0 + j * BS + tl.arange(0, BS)
            cmask = cols < S
            krow = k_ptr + b * sk_b + cols[:, None] * sk_s
            if BD == D:
                kt = tl.load(krow + tl.arange(0, D)[None, :], mask=cmask[:, None], other=0.0)
                if UPCAST:
                    kt = kt.to(tl.float32)
                logits = tl.dot(qm, tl.trans(kt), out_dtype=tl.float32, input_precision=PREC)  # [BT·HP, BS]
            else:  # fp32 FMA dots: D in slices of BD (the operands live in registers)
                logits = tl.zeros((BT * HP, BS), tl.float32)
                for d0 in tl.static_range(0, D, BD):
                    dd = d0 + tl.arange(0, BD)
                    qs = tl.load(qrow + dd[None, :], mask=mmask[:, None], other=0.0)
                    ks = tl.load(krow + dd[None, :], mask=cmask[:, None], other=0.0)
                    if UPCAST:
                        qs, ks = qs.to(tl.float32), ks.to(tl.float32)
                    logits = tl.dot(qs, tl.trans(ks), logits, input_precision=PREC)
            if RELU:
                logits = tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL)  # torch's relu keeps NaN
            acc = tl.sum(tl.reshape(logits * wm[:, None], (BT, HP, BS)), 1)  # the heads summed: [BT, BS]
            if HAS_KS:
                acc = acc * tl.load(ks_ptr + b * sks_b + cols, mask=cmask, other=0.0)[None, :]
            acc = tl.where(cols[None, :] <= qp[:, None], acc, float("-inf"))
            tl.store(sc_ptr + b * so_b + rows[:, None] * so_t + cols[None, :], acc,
                     mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _ordered(x):
        """fp32 scores → int32 keys in the same (signed) order; NaN as −inf, −0.0 as +0.0 (`stable_topk`'s ranking)."""
        x = tl.where(x != x, float("-inf"), x)
        x = tl.where(x == 0.0, 0.0, x)
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _select(u, valid, TOPK):
        """Which entries of a block of keys u (int32, in position order) are in the top TOPK of the `valid` ones, ties
        to the earlier entry; all valid ones when there are at most TOPK. A 1-bit MSB radix select finds a threshold
        t with #(u ≥ t) ≥ TOPK: the sign, then bit by bit, keeping a bit where at least TOPK keys are ≥ the prefix
        with it. It stops early once exactly TOPK keys are ≥ t (then every key ≥ t is selected); else t ends as the
        TOPK-th largest key. Selected: the keys above t and the first `TOPK − #above` keys equal to t."""
        n_valid = tl.sum(valid.to(tl.int32), 0)
        cnt = tl.sum((valid & (u >= 0)).to(tl.int32), 0)
        t = tl.where(cnt >= TOPK, 0, -2147483648)
        ct = tl.where(cnt >= TOPK, cnt, n_valid)  # #(u ≥ t)
        bit = 30
        while (bit >= 0) & (ct > TOPK):
            c = t | (1 << bit)
            cnt = tl.sum((valid & (u >= c)).to(tl.int32), 0)
            t = tl.where(cnt >= TOPK, c, t)
            ct = tl.where(cnt >= TOPK, cnt, ct)
            bit -= 1
        above = valid & (u > t)
        tie = valid & (u == t)
        need = TOPK - tl.sum(above.to(tl.int32), 0)
        return above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= need))

    @triton.jit
    def _emit(sel, u, pos, key_ptr, pos_ptr, out_ptr, cbase, obase, KP: tl.constexpr, FINAL: tl.constexpr):
        """Write the selected entries compacted, in block order (= position order): as the row's answer (FINAL), or as
        this block's candidate list of KP slots (key, position), padded with position −1."""
        dest = tl.cumsum(sel.to(tl.int32), 0) - 1
        if FINAL:
            tl.store(out_ptr + obase + dest, pos.to(tl.int64), mask=sel)
        else:
            tl.store(key_ptr + cbase + dest, u, mask=sel)
            tl.store(pos_ptr + cbase + dest, pos, mask=sel)
            j = tl.arange(0, KP)
            tl.store(pos_ptr + cbase + j, -1, mask=j >= tl.sum(sel.to(tl.int32), 0))

    @triton.jit
    def _first_keys(out_ptr, obase, TOPK, KP: tl.constexpr):
        """A row with at most TOPK allowed keys: positions 0..TOPK−1 (its allowed keys, then the masked ones in order)."""
        j = tl.arange(0, KP)
        tl.store(out_ptr + obase + j, j.to(tl.int64), mask=j < TOPK)

    @triton.jit
    def _topk_block_kernel(s_ptr, qpos_ptr, key_ptr, pos_ptr, out_ptr, S, TOPK, s_row, q_row, c_row, o_row,
                           C: tl.constexpr, KP: tl.constexpr, FINAL: tl.constexpr):
        """Program (row, block): the top TOPK of the row's fp32 scores in [block·C, block·C + C) ∩ [0, n), n the causal
        length min(qpos + 1, S). FINAL (one block covers the row): the row's answer; else the block's candidates."""
        row = tl.program_id(0).to(tl.int64)  # row × stride can pass 2^31 elements
        blk = tl.program_id(1)
        n = tl.minimum(tl.load(qpos_ptr + row * q_row) + 1, S)
        if (n > TOPK) & (blk * C < n):  # a block past the causal limit reads and writes nothing
            offs = blk * C + tl.arange(0, C)
            valid = offs < n
            u = _ordered(tl.load(s_ptr + row * s_row + offs, mask=valid, other=0.0))
            sel = _select(u, valid, TOPK)
            _emit(sel, u, offs, key_ptr, pos_ptr, out_ptr, row * c_row + blk * KP, row * o_row, KP, FINAL)
        else:
            if FINAL:
                _first_keys(out_ptr, row * o_row, TOPK, KP)

    @triton.jit
    def _topk_merge_kernel(key_ptr, pos_ptr, qpos_ptr, okey_ptr, opos_ptr, out_ptr, S, TOPK, NL, SPAN,
                           c_row, q_row, oc_row, o_row, KP: tl.constexpr, G: tl.constexpr, FINAL: tl.constexpr):
        """Program (row, group): the top TOPK of the candidates of lists [group·G, group·G + G) (each list: the
        candidates of SPAN consecutive positions, KP slots); lists wholly past the causal limit were never written."""
        row = tl.program_id(0).to(tl.int64)
        grp = tl.program_id(1)
        n = tl.minimum(tl.load(qpos_ptr + row * q_row) + 1, S)
        if (n > TOPK) & (grp * G * SPAN < n):
            j = tl.arange(0, G * KP)
            lst = grp * G + j // KP
            src = row * c_row + grp * G * KP + j
            pos = tl.load(pos_ptr + src, mask=(lst < NL) & (lst * SPAN < n), other=-1)
            valid = pos >= 0
            u = tl.load(key_ptr + src, mask=valid, other=0)
            sel = _select(u, valid, TOPK)
            _emit(sel, u, pos, okey_ptr, opos_ptr, out_ptr, row * oc_row + grp * KP, row * o_row, KP, FINAL)
        else:
            if FINAL:
                _first_keys(out_ptr, row * o_row, TOPK, KP)


BLOCKS: tuple[int, int, int, int] | None = None  # (query rows, keys, warps) of the scores kernel and the top-k
# kernels' warps; None: `_score_tiles`' choice and `_topk_warps`. Set by bench/gpu.py's tile sweep (a knob for
# measuring).
SCORE_GROUP = 4  # column blocks a scores program walks (the query tile loaded once for them): a knob (tests shrink it)
TOPK_BLOCK = 8192  # keys a top-k program holds (rounded to ≥ 2·topk for the merges): a knob (tests split short rows)
SMS = 132  # H100/H200 SMs: a top-k with fewer programs than 2·SMS splits its rows into smaller blocks


def _topk_warps(block: int) -> int:
    return BLOCKS[3] if BLOCKS is not None else max(4, min(16, block // 512))


def topk_rows(scores: torch.Tensor, qpos: torch.Tensor, topk: int) -> torch.Tensor:
    """The Triton top-k: for each row of fp32 `scores` [R, S], the `topk` (≤ S) positions with the largest scores
    among s ≤ qpos[r] (qpos [R]), ties to the earlier position, ascending: `stable_topk` of the row with the
    positions past qpos set to −inf. No host sync. See the module docstring (step 2)."""
    r, s = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        scores = scores.float().contiguous()
    out = torch.empty(r, topk, dtype=torch.int64, device=scores.device)
    if r == 0 or topk == 0:
        return out
    kp = triton.next_power_of_2(topk)
    block = max(2 * kp, triton.next_power_of_2(TOPK_BLOCK))
    c = max(kp, min(block, triton.next_power_of_2(s)))
    while c > max(2 * kp, 1024) and r * triton.cdiv(s, c) < 2 * SMS:  # few rows (decode): more, smaller blocks
        c //= 2
    nl = triton.cdiv(s, c)
    final = nl == 1
    keys = torch.empty(r, 1 if final else nl * kp, dtype=torch.int32, device=scores.device)
    pos = torch.empty_like(keys)
    _topk_block_kernel[(r, nl)](scores, qpos, keys, pos, out, s, topk, scores.stride(0), qpos.stride(0),
                                keys.stride(0), out.stride(0), C=c, KP=kp, FINAL=final, num_warps=_topk_warps(c))
    fan, span = block // kp, c  # each merge program selects over `fan` lists of candidates (≥ 2)
    while not final:
        g = min(fan, triton.next_power_of_2(nl))
        ng = triton.cdiv(nl, g)
        final = ng == 1
        okeys = keys if final else torch.empty(r, ng * kp, dtype=torch.int32, device=scores.device)
        opos = pos if final else torch.empty_like(okeys)
        _topk_merge_kernel[(r, ng)](keys, pos, qpos, okeys, opos, out, s, topk, nl, span, keys.stride(0),
                                    qpos.stride(0), okeys.stride(0), out.stride(0), KP=kp, G=g, FINAL=final,
                                    num_warps=_topk_warps(g * kp))
        keys, pos, nl, span = okeys, opos, ng, span * g
    return out


def _score_tiles(hp: int, d: int, n: int, tensor_cores: bool) -> tuple[int, int, int, int]:
    """(query rows BT, keys BS, warps, D slice BD) of the scores kernel for padded heads `hp`, index dim `d` and `n`
    query rows. On tensor cores (fp8, bf16) M = BT·HP = 128 (wgmma-sized: 4 rows × GLM-5's 32 heads) against 128 keys
    in 8 warps, the whole D in one dot; fp32 runs as FMA dots with their operands in registers: M = 64 against 64
    keys, D in slices of 32. BT never exceeds the rows there are (decode), and M ≥ 16 (a dot's least)."""
    if BLOCKS is not None:
        bt, bs, warps = BLOCKS[:3]
    else:
        tile = 128 if tensor_cores else 64  # M and the keys a tile
        bt, bs, warps = min(max(1, tile // hp), triton.next_power_of_2(n)), tile, 8
    return max(bt, triton.cdiv(16, hp)), bs, warps, d if tensor_cores else min(d, 32)


def supported(d: int) -> bool:
    """The scores kernel's dot runs over the whole index dim: a power of two, at least 16."""
    return d >= 16 and d & (d - 1) == 0


def _alloc_scores(b: int, n: int, s: int, device) -> torch.Tensor:
    """The fp32 scores of one query chunk. Uninitialised: the tiles past every row's qpos are never written, and
    nothing reads them (tests fill it with a sentinel to show both)."""
    return torch.empty(b, n, s, dtype=torch.float32, device=device)


def _indexer_topk_triton(q, w, k, qpos, topk: int, fp8: bool, relu: bool = True,
                         scores_only: bool = False) -> torch.Tensor:
    """`scores_only`: run the scores kernel alone (its time, for the bench) and return the last chunk's scores (the
    tiles past every row's qpos uninitialised)."""
    b, t, hi, d = q.shape
    s = k.shape[1]
    topk = min(topk, s)
    if not supported(d):
        raise ValueError(f"the indexer kernel needs a power-of-two index dim ≥ 16, not {d}")
    ks = None
    if fp8:
        q, w, k, ks = _fp8_inputs(q, w, k)
    elif not (q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16) and q.device.type != "cpu"):
        q, k = q.float(), k.float()  # bf16 / fp16 stay as they are on a GPU: exact products, fp32 sums
    w = w.float().contiguous()
    q, k, qpos = q.contiguous(), k.contiguous(), qpos.contiguous()
    upcast = q.dtype == torch.float8_e4m3fn and not fp8_dot_supported(q.device)  # (the interpreter: fp32 dots)
    hp = triton.next_power_of_2(hi)
    step = max(1, CHUNK_ELEMS // max(1, s * b))
    out = torch.empty(b, t, topk, dtype=torch.int64, device=q.device)
    ks_arg = ks if ks is not None else w
    for t0 in range(0, t, step):
        n = min(step, t - t0)
        bt, bs, warps, bd = _score_tiles(hp, d, n, q.dtype != torch.float32 and not upcast)
        nc = max(1, min(SCORE_GROUP, triton.cdiv(s, bs)))
        scores = _alloc_scores(b, n, s, q.device)
        _scores_kernel[(b, triton.cdiv(n, bt), triton.cdiv(s, bs * nc))](
            q, w, k, ks_arg, qpos, scores, n, s, t0,
            q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), k.stride(0), k.stride(1),
            ks_arg.stride(0), qpos.stride(0), scores.stride(0), scores.stride(1), nc,
            HI=hi, HP=hp, D=d, BD=bd, BT=bt, BS=bs, HAS_KS=ks is not None, UPCAST=upcast,
            PREC="ieee", RELU=relu, num_warps=warps,
        )
        if scores_only:
            continue
        sel = topk_rows(scores.view(b * n, s), qpos[:, t0 : t0 + n].reshape(b * n), topk)
        out[:, t0 : t0 + n] = sel.view(b, n, topk)
    return scores if scores_only else out


def fp8_dot_supported(device: torch.device) -> bool:
    """e4m3 tensor-core dots need compute capability ≥ 8.9 (Ada, Hopper). (`meta.on_meta` answers as a Hopper.)"""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
