"""MoE on the device: fused biased group top-k routing, sort, offsets, grouped GEMM, weighted unpermute.

`moe_experts(x, idx, w, gate_up, down)` computes Σ_i w_i · E_{idx_i}(x) for every token, with
E_e(x) = down_e · (silu(g) ⊙ u), [g | u] = gate_up_e · x, stacked weights gate_up [E, 2I, H] and
down [E, H, I] (temper's `Experts` layout).

Device path (no host sync): the (token, slot) pairs are sorted by expert (`argsort`, stable), the
per-expert segment ends come from a scatter-add count + `cumsum` on the device, and each projection runs as one
grouped GEMM over all experts:

* `torch._grouped_mm` where it exists on CUDA for the dtype (bf16 on Hopper; 626 TFLOP/s measured on
  an H200 for 32 experts x 2,048 rows, 4.4x a per-expert loop);
* otherwise a Triton grouped GEMM: a device-built schedule maps each tile of BM sorted rows to its
  expert, so the grid is fixed (⌈M/BM⌉ + E tiles) and empty experts cost nothing; its backward is
  the same kernel on the transposed weights (dX) and a per-expert reduction kernel (dW).

The unpermute places every row back at its (token, slot) position and sums the k slots of a token:
deterministic, unlike an atomic `index_add_`, and its backward keeps only the permutation. The SwiGLU between the two
GEMMs is the fused `swiglu` (temper_kernels/act.py), which keeps g and u and not silu(g), and applies each row's
routing weight (so the second GEMM's output is not kept for the weights' gradient).

`route(logits, bias, ...)` is the router's selection (sigmoid scores, the bias for selection only,
group-limited top-k, normalised and scaled weights): on the Triton path the selection is one fused kernel,
`route_reference` writes it with torch's device ops. Neither syncs with the host. Both pick the same experts in the
same order: exact ties go to the lowest group and expert id, a NaN score ranks above every number. A call with no
tokens returns an empty result on both paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import backend
from .act import swiglu
from .memory import recomputed


def route(logits, bias, k: int, n_group: int, topk_group: int, scoring: str, norm: bool, scaling: float):
    """logits [N, E] (fp32) → (expert ids [N, k], weights [N, k] fp32). No host sync. On the Triton path the
    selection (the biased group-limited top-k) is one fused kernel, `_route_kernel`; the weights are read from the
    scores with torch ops either way, so their gradient is autograd's."""
    if backend(logits, bias) == "reference" or not _route_kernel_fits(logits.shape[-1], k, n_group, topk_group):
        return route_reference(logits, bias, k, n_group, topk_group, scoring, norm, scaling)
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    idx = route_select(scores.detach(), bias, k, n_group, topk_group)
    return idx, _route_weights(scores, idx, norm, scaling)


def _route_weights(scores, idx, norm: bool, scaling: float):
    w = scores.gather(1, idx)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling


def _best(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, best first: ties to the lowest index, NaN ranked as +inf (the
    fused kernel's rule; torch.topk's order on ties is its own, and differed from the kernel's)."""
    x = torch.where(x.isnan(), float("inf"), x)
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def route_reference(logits, bias, k: int, n_group: int, topk_group: int, scoring: str, norm: bool, scaling: float):
    """The torch twin of `route` (device ops, no host sync either): the same experts in the same order as the kernel,
    ties included (the lowest group, then the lowest expert id), a NaN choice ranked above every number."""
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    choice = scores + bias
    choice = torch.where(choice.isnan(), float("inf"), choice)
    n, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        g = choice.view(n, n_group, e // n_group)
        group_scores = g.topk(2, dim=-1).values.sum(-1)  # values only: the order of ties does not matter here
        keep = _best(group_scores, topk_group)  # inf + (-inf) = NaN: a group holding a NaN expert ranks first
        gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~gmask[:, :, None].expand_as(g).reshape(n, e), float("-inf"))  # no repeat_interleave
    idx = _best(choice, k)
    return idx, _route_weights(scores, idx, norm, scaling)


def _route_kernel_fits(e: int, k: int, n_group: int, topk_group: int) -> bool:
    """The fused selection holds a token's E scores in one program (E ≤ 1024) and unrolls its k and group picks."""
    groups_ok = n_group <= 1 or topk_group >= n_group or e % n_group == 0
    return 0 < k <= min(e, 64) and e <= 1024 and groups_ok


def route_select(scores: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """The experts a token routes to [N, k] (int64, best first): the top k of scores + bias among the experts of its
    `topk_group` best groups (a group's score: the sum of its two best), one fused Triton kernel per call."""
    n, e = scores.shape
    s2, b2 = scores.float().contiguous(), bias.float().contiguous()
    idx = torch.empty(n, k, dtype=torch.long, device=scores.device)
    if n == 0:
        return idx
    limit = n_group > 1 and topk_group < n_group
    g = n_group if limit else 1
    eg = e // g
    _route_kernel[(n,)](s2, b2, idx, e, eg, s2.stride(0), K=k, G=g, TOPG=topk_group if limit else 1, LIMIT=limit,
                        BG=triton.next_power_of_2(g), BJ=triton.next_power_of_2(eg))
    return idx


def expert_counts(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens per expert [n_experts] (int64) of expert ids `idx`, on their device, by scatter-add: CUDA's `bincount`
    reads the ids' max back to the host (a sync)."""
    flat = idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def _no_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The result of a call with no (token, expert) pair (no tokens, or k = 0): zeros like x, in x's and w's graph."""
    return torch.zeros_like(x) + (x[:0].sum() + w.sum()).to(x.dtype)  # both sums are of nothing: exactly 0


def moe_experts_dense(x, idx, w, gate_up, down) -> torch.Tensor:
    """The same sum with no shape that depends on the routing: every expert over every token, weighted by a dense
    [N, E] matrix of the routing weights (exact zeros off the selection). E/k times the expert FLOPs, no host sync and
    no data-dependent shape: what a compiled (`torch.compile`) decode step runs, where a handful of tokens make the
    extra FLOPs cheaper than the loop's per-expert ops. Equal to the loop up to the GEMMs' rounding."""
    n = idx.shape[0]
    e, two_i, h = gate_up.shape
    dense = torch.zeros(n, e, dtype=x.dtype, device=x.device).scatter_add_(1, idx, w.to(x.dtype))
    g, u = F.linear(x, gate_up.reshape(e * two_i, h)).view(n, e, two_i).chunk(2, dim=-1)
    act = (F.silu(g) * u) * dense[..., None]  # [N, E, I], the routing weight on the way in, as the loop's swiglu
    return torch.einsum("nei,ehi->nh", act, down)


# Calls of at most this many tokens (a decode step of up to 32 rows) take `moe_experts_dense`: one GEMM for every
# expert instead of the loop's ~8 small ops an expert plus a host sync. Chosen by the shape alone, so a row gets the
# same path, and the same bits, wherever it is forwarded (the engine's rescoring, the trainer).
DENSE_ROWS = 32


def moe_experts_reference(x, idx, w, gate_up, down) -> torch.Tensor:
    """The torch twin: a loop over experts on their contiguous slices (host sync on the counts). Under
    `torch.compile`, and for a call of at most DENSE_ROWS tokens, it is `moe_experts_dense` (no data-dependent
    shape, a few ops)."""
    if idx.numel() == 0:
        return _no_rows(x, w)
    n, k = idx.shape
    if torch.compiler.is_dynamo_compiling() or n <= DENSE_ROWS:
        return moe_experts_dense(x, idx, w, gate_up, down)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x.index_select(0, token_of)
    outs = []
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        seg = xs[start : start + c]
        g, u = F.linear(seg, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(g) * u, down[e]))
        start += c
    ys = torch.cat(outs, 0) * w.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token_of, ys)


def moe_experts(x, idx, w, gate_up, down) -> torch.Tensor:
    if backend(x, gate_up) == "reference":
        return moe_experts_reference(x, idx, w, gate_up, down)
    if idx.numel() == 0:  # (a shape, known on the host: no sync)
        return _no_rows(x, w)
    n, k = idx.shape
    e = gate_up.shape[0]
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    ends = expert_counts(flat, e).cumsum(0).to(torch.int32)
    token = order // k
    xs = x.index_select(0, token)
    # the sorted rows (n·k × H) are kept for the first GEMM's weight gradient as a gather from x, which the layer
    # keeps anyway (the router, the shared expert): 128 MiB a layer at the 524M config
    with recomputed(xs, lambda: x.detach().index_select(0, token)):
        g, u = grouped_mm(xs, gate_up, ends).chunk(2, dim=-1)
    ys = grouped_mm(swiglu(g, u, w.reshape(-1)[order].to(x.dtype)), down, ends)  # the routing weight on the way in
    return _Unpermute.apply(ys, order).view(n, k, -1).sum(1)


class _Unpermute(torch.autograd.Function):
    """Sorted row j back to (token, slot) position order[j]: `index_copy` forward, `index_select` backward, both
    deterministic, and only the permutation kept for the backward (autograd's `index_copy` keeps its source, the
    rows: 128 MiB a layer at the 524M config)."""

    @staticmethod
    def forward(ctx, ys, order):
        ctx.save_for_backward(order)
        return torch.zeros_like(ys).index_copy_(0, order, ys)

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad.index_select(0, order), None


def grouped_mm(xs: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of xs [M, Kin] times w[e]ᵀ (w [E, Nout, Kin]) → [M, Nout]; `ends` (int32) on the
    device, the rows sorted by expert. torch's grouped GEMM where it applies, else the Triton kernel (no host sync
    either way). Differentiable in xs and w."""
    if _torch_grouped_ok(xs, w):
        return torch._grouped_mm(xs, w.transpose(-2, -1), offs=ends)
    return _GroupedMM.apply(xs, w, ends)


def grouped_mm_reference(xs: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The torch twin of `grouped_mm`: one `F.linear` per expert's rows (reads `ends` back to the host)."""
    outs, start = [], 0
    for e, end in enumerate(ends.tolist()):
        outs.append(F.linear(xs[start:end], w[e]))
        start = end
    if start != xs.shape[0]:
        raise ValueError(f"grouped_mm: the groups cover {start} rows of {xs.shape[0]}")
    return torch.cat(outs, 0)


def grouped_linear(xs: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` on a device the kernels serve (`backend`), its twin elsewhere: the op for a caller that runs on
    either (Megatron's expert module, `trainers/megatron/experts.py`)."""
    if backend(xs, w) == "reference":
        return grouped_mm_reference(xs, w, ends)
    return grouped_mm(xs, w, ends.to(torch.int32))


def _torch_grouped_ok(xs: torch.Tensor, w: torch.Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and xs.device.type == "cuda"
        and xs.dtype == w.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(xs.device) >= (9, 0)
    )


# ---- Triton ------------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _route_kernel(s_ptr, b_ptr, idx_ptr, E, EG, ss, K: tl.constexpr, G: tl.constexpr, TOPG: tl.constexpr,
                      LIMIT: tl.constexpr, BG: tl.constexpr, BJ: tl.constexpr):
        """One token: the scores + bias laid out [groups, experts of a group]; with LIMIT, each group scored by the
        sum of its two best, the TOPG best groups kept; then K picks of the best remaining expert (its id stored,
        itself taken out), best first."""
        row = tl.program_id(0).to(tl.int64)  # row × stride can pass 2^31 elements
        gi = tl.arange(0, BG)
        j = tl.arange(0, BJ)
        e2 = gi[:, None] * EG + j[None, :]
        ok = (gi[:, None] < G) & (j[None, :] < EG)
        neg = float("-inf")
        c = tl.load(s_ptr + row * ss + e2, mask=ok, other=0.0) + tl.load(b_ptr + e2, mask=ok, other=0.0)
        c = tl.where(c != c, float("inf"), c)  # NaN ranks above every number, as in torch's topk
        c = tl.where(ok, c, neg)
        if LIMIT:
            m1 = tl.max(c, 1)
            a1 = tl.argmax(c, 1)
            m2 = tl.max(tl.where(j[None, :] == a1[:, None], neg, c), 1)
            gs = m1 + m2
            gs = tl.where(gi < G, tl.where(gs != gs, float("inf"), gs), neg)  # inf + (-inf): a NaN expert's group first
            keep = gi < 0
            for _ in tl.static_range(TOPG):  # the best group not kept yet, the lowest id on a tie
                free = (gi < G) & ~keep
                top = tl.max(tl.where(free, gs, neg), 0)
                pick = tl.min(tl.where(free & (gs == top), gi, BG + 1), 0)
                keep = keep | (gi == pick)
            c = tl.where(keep[:, None], c, neg)
        # what is still to pick: real experts not picked yet (a -inf score, from the group mask or the bias, is still
        # pickable, as `topk` returns it when fewer than K are finite; a picked one never is again)
        avail = ok
        for t in tl.static_range(K):
            best = tl.max(tl.max(tl.where(avail, c, neg), 1), 0)
            # the lowest expert id holding the best value among those still to pick
            at = tl.min(tl.min(tl.where(avail & (c == best), e2, E + 1), 1), 0)
            tl.store(idx_ptr + row * K + t, at.to(tl.int64))
            avail = avail & (e2 != at)

BM, BN, BK = 32, 32, 32

if triton is not None:

    @triton.jit
    def _gmm_kernel(
        x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr, E, NOUT, KIN,
        sx_m, sw_e, sw_n, sw_k, sy_m,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    ):
        tile = tl.program_id(0)
        e = tl.load(tile_expert_ptr + tile)
        if e < E:
            row0 = tl.load(tile_row_ptr + tile)
            end = tl.load(ends_ptr + e)
            r = tl.arange(0, BM)
            rows = row0 + r
            cols = tl.program_id(1) * BN + tl.arange(0, BN)
            rm, cm = rows < end, cols < NOUT
            # 64-bit bases: row × stride and expert × stride pass 2^31 elements at GLM-5's shapes (0.5M routed rows
            # × 6144; 256 experts × 4096 × 6144); the offsets within a tile stay 32-bit
            xb = x_ptr + row0.to(tl.int64) * sx_m
            wb = w_ptr + e.to(tl.int64) * sw_e
            acc = tl.zeros((BM, BN), tl.float32)
            for k0 in range(0, KIN, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < KIN
                a = tl.load(xb + r[:, None] * sx_m + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
                b = tl.load(wb + cols[None, :] * sw_n + kk[:, None] * sw_k, mask=km[:, None] & cm[None, :], other=0.0)
                acc += tl.dot(a, b, input_precision=PREC)
            tl.store(y_ptr + row0.to(tl.int64) * sy_m + r[:, None] * sy_m + cols[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])

    @triton.jit
    def _gmm_dw_kernel(
        dy_ptr, x_ptr, dw_ptr, ends_ptr, NOUT, KIN, sdy_m, sx_m, sdw_e, sdw_n,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    ):
        e = tl.program_id(0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        kk = tl.program_id(2) * BK + tl.arange(0, BK)
        cm, km = cols < NOUT, kk < KIN
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        acc = tl.zeros((BN, BK), tl.float32)
        r = tl.arange(0, BM)
        # row × stride passes 2^31 elements at GLM-5's shapes: 64-bit bases, advanced a tile at a time
        dyp = dy_ptr + start.to(tl.int64) * sdy_m + r[:, None] * sdy_m + cols[None, :]
        xp = x_ptr + start.to(tl.int64) * sx_m + r[:, None] * sx_m + kk[None, :]
        for r0 in range(start, end, BM):
            rm = r0 + r < end
            dy = tl.load(dyp, mask=rm[:, None] & cm[None, :], other=0.0)
            xx = tl.load(xp, mask=rm[:, None] & km[None, :], other=0.0)
            acc += tl.dot(tl.trans(dy), xx, input_precision=PREC)
            dyp += BM * sdy_m
            xp += BM * sx_m
        tl.store(dw_ptr + e.to(tl.int64) * sdw_e + cols[:, None] * sdw_n + kk[None, :], acc.to(dw_ptr.dtype.element_ty),
                 mask=cm[:, None] & km[None, :])


def _schedule(ends: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of each BM-row tile, on the device; tiles past the last are marked E."""
    e = ends.shape[0]
    ends = ends.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + BM - 1) // BM
    cum = tiles.cumsum(0)
    ids = torch.arange(triton.cdiv(m, BM) + e, device=ends.device)
    expert = torch.searchsorted(cum, ids, right=True)
    first_tile = (cum - tiles).gather(0, expert.clamp_max(e - 1))
    row = starts.gather(0, expert.clamp_max(e - 1)) + (ids - first_tile) * BM
    return expert.to(torch.int32), row.to(torch.int32)


def _gmm(xs, w_ptr_view, ends, nout, kin, sw):
    m = xs.shape[0]
    y = torch.empty(m, nout, dtype=xs.dtype, device=xs.device)
    expert, row = _schedule(ends, m)
    grid = (expert.shape[0], triton.cdiv(nout, BN))
    _gmm_kernel[grid](
        xs, w_ptr_view, y, expert, row, ends, ends.shape[0], nout, kin,
        xs.stride(0), sw[0], sw[1], sw[2], y.stride(0),
        BM=BM, BN=BN, BK=BK, PREC="ieee" if xs.dtype == torch.float32 else "tf32",
    )
    return y


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, w, ends):
        xs, w, ends = xs.contiguous(), w.contiguous(), ends.contiguous()
        e, nout, kin = w.shape
        ctx.save_for_backward(xs, w, ends)
        return _gmm(xs, w, ends, nout, kin, (w.stride(0), w.stride(1), w.stride(2)))

    @staticmethod
    def backward(ctx, dy):
        xs, w, ends = ctx.saved_tensors
        e, nout, kin = w.shape
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX_e = dY_e · W_e: the forward kernel on Wᵀ (swapped strides)
            dx = _gmm(dy, w, ends, kin, nout, (w.stride(0), w.stride(2), w.stride(1)))
        if ctx.needs_input_grad[1]:
            dw = torch.empty(e, nout, kin, dtype=torch.float32, device=w.device)
            grid = (e, triton.cdiv(nout, BN), triton.cdiv(kin, BK))
            _gmm_dw_kernel[grid](
                dy, xs, dw, ends, nout, kin, dy.stride(0), xs.stride(0), dw.stride(0), dw.stride(1),
                BM=BM, BN=BN, BK=BK, PREC="ieee" if xs.dtype == torch.float32 else "tf32",
            )
            dw = dw.to(w.dtype)
        return dx, dw, None
