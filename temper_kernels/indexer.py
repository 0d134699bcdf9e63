"""Lightning-indexer scores fused with a deterministic top-k.

For query t and past key s the indexer score is

    I(t, s) = Σ_j w[t, j] · ReLU(q[t, j] · k[s])        (fp32 accumulation)

and a query keeps the `topk` keys with the largest scores among its allowed keys (s ≤ qpos[t]), ties
going to the earlier position, returned ascending by position: exactly `stable_topk`'s set.

Triton path, no host sync:

1. `_scores_kernel` computes a tile of scores with `tl.dot` per indexer head, applies the causal mask and
   packs each score with its position into one int64 *key*: the high 32 bits are the score's bits mapped
   to an order-preserving signed integer (the sums start at +0.0, so no −0.0 arises to split a tie), the
   low 32 bits are `2³¹−1−s`. Keys
   are unique, their order is (score desc, position asc), so any exact top-k over keys is the
   deterministic selection.
2. `_topk_kernel` streams each row's keys in tiles of `topk` (a power of two) and keeps a running top-k
   with a bitonic merge: `sort(max(running_desc, tile_asc))` — the elementwise max of a descending and
   an ascending sorted list is the top half of their union.

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
    selected *set* never depends on kernel scheduling (torch.topk gives no such guarantee on ties).
    """
    scores = scores.nan_to_num(nan=float("-inf"))  # a NaN score never wins (torch.topk would rank it first)
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
    if backend(q, w, k, qpos) == "reference":
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
        q_ptr, w_ptr, k_ptr, ks_ptr, qpos_ptr, key_ptr,
        T, S, t0,
        sq_b, sq_t, sq_h, sw_b, sw_t, sk_b, sk_s, sks_b, sp_b, so_b, so_t,
        HI: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, HAS_KS: tl.constexpr, UPCAST: tl.constexpr,
        PREC: tl.constexpr, RELU: tl.constexpr,
    ):
        b = tl.program_id(0)
        rows = tl.program_id(1) * BT + tl.arange(0, BT)  # query rows within this chunk
        cols = tl.program_id(2) * BS + tl.arange(0, BS)
        rmask, cmask = rows < T, cols < S
        dd = tl.arange(0, D)
        kt = tl.load(k_ptr + b * sk_b + cols[:, None] * sk_s + dd[None, :], mask=cmask[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        acc = tl.zeros((BT, BS), dtype=tl.float32)
        for h in range(HI):
            qh = tl.load(q_ptr + b * sq_b + (t0 + rows)[:, None] * sq_t + h * sq_h + dd[None, :],
                         mask=rmask[:, None], other=0.0)
            if UPCAST:
                qh = qh.to(tl.float32)
            logits = tl.dot(qh, tl.trans(kt), out_dtype=tl.float32, input_precision=PREC)
            wh = tl.load(w_ptr + b * sw_b + (t0 + rows) * sw_t + h, mask=rmask, other=0.0)
            if RELU:
                logits = tl.maximum(logits, 0.0)
            acc += wh[:, None] * logits
        if HAS_KS:
            acc = acc * tl.load(ks_ptr + b * sks_b + cols, mask=cmask, other=0.0)[None, :]
        qp = tl.load(qpos_ptr + b * sp_b + t0 + rows, mask=rmask, other=0)
        acc = tl.where(cols[None, :] <= qp[:, None], acc, float("-inf"))
        bits = acc.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = ordered * 4294967296 + (2147483647 - cols).to(tl.int64)
        tl.store(key_ptr + b * so_b + rows[:, None] * so_t + cols[None, :], key,
                 mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _topk_kernel(key_ptr, out_ptr, S, TOPK, s_row, so_row, K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row × stride can pass 2^31 elements
        offs = tl.arange(0, K)
        lowest = -9223372036854775807 - 1
        best = tl.load(key_ptr + row * s_row + offs, mask=offs < S, other=lowest)
        best = tl.sort(best, descending=True)
        for s0 in range(K, S, K):
            tile = tl.load(key_ptr + row * s_row + s0 + offs, mask=s0 + offs < S, other=lowest)
            tile = tl.sort(tile, descending=False)
            best = tl.sort(tl.maximum(best, tile), descending=True)
        pos = tl.where(offs < TOPK, 2147483647 - (best & 0xFFFFFFFF), 2147483647)
        pos = tl.sort(pos, descending=False)  # the padding (offs >= TOPK) sorts last
        tl.store(out_ptr + row * so_row + offs, pos, mask=offs < TOPK)


BLOCKS: tuple[int, int, int, int] | None = None  # (query rows, keys, warps) of the scores kernel and the top-k
# kernel's warps; None: (16, 64, 4, 4). Set by bench/gpu.py's tile sweep (a knob for measuring, not a setting).


def _indexer_topk_triton(q, w, k, qpos, topk: int, fp8: bool, relu: bool = True,
                         scores_only: bool = False) -> torch.Tensor:
    """`scores_only`: run the scores kernel alone (its time, for the bench) and return the packed keys' last chunk."""
    b, t, hi, d = q.shape
    s = k.shape[1]
    topk = min(topk, s)
    ks = None
    if fp8:
        q, w, k, ks = _fp8_inputs(q, w, k)
    else:
        q, k = q.float(), k.float()
    w = w.float().contiguous()
    q, k, qpos = q.contiguous(), k.contiguous(), qpos.contiguous()
    kp = triton.next_power_of_2(topk)
    upcast = q.dtype != torch.float32 and (q.device.type != "cuda" or not fp8_dot_supported(q.device))
    step = max(1, CHUNK_ELEMS // max(1, s * b))
    out = torch.empty(b, t, topk, dtype=torch.int64, device=q.device)
    bt, bs, warps, topk_warps = BLOCKS or (16, 64, 4, 4)
    for t0 in range(0, t, step):
        n = min(step, t - t0)
        keys = torch.empty(b, n, s, dtype=torch.int64, device=q.device)
        grid = (b, triton.cdiv(n, bt), triton.cdiv(s, bs))
        ks_arg = ks if ks is not None else w
        _scores_kernel[grid](
            q, w, k, ks_arg, qpos, keys, n, s, t0,
            q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), k.stride(0), k.stride(1),
            ks_arg.stride(0), qpos.stride(0), keys.stride(0), keys.stride(1),
            HI=hi, D=d, BT=bt, BS=bs, HAS_KS=ks is not None, UPCAST=upcast,
            PREC="ieee", RELU=relu, num_warps=warps,
        )
        if scores_only:
            continue
        rows = keys.view(b * n, s)
        o = out[:, t0 : t0 + n].reshape(b * n, topk)
        _topk_kernel[(b * n,)](rows, o, s, topk, rows.stride(0), o.stride(0), K=kp, num_warps=topk_warps)
        out[:, t0 : t0 + n] = o.view(b, n, topk)
    return keys if scores_only else out


def fp8_dot_supported(device: torch.device) -> bool:
    """e4m3 tensor-core dots need compute capability ≥ 8.9 (Ada, Hopper)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
