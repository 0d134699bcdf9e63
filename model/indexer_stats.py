"""The lightning indexer's whole-score paths in query chunks: the tensor-parallel selection and the indexer-KL
statistics hold O(T·k) (the selection, the statistics over the selected keys), never a [B, T, S] score matrix or
[B, T·H, S] head logits.

* `select_topk`: the selection where a rank holds some of the indexer heads (Megatron TP ≥ 2): each chunk of query
  rows is scored over this rank's heads, summed over the ranks (`reduce`), masked causally and reduced to its top-k
  (`stable_topk`, the kernels' tie rule), so the [B, C, S] scores of one chunk are all that exists at a time. With
  `fp8`, the queries and keys are quantised to e4m3 first (`quantize_fp8`, per query head and per key), exactly as
  the fused kernel's twin does, so a rank's partial sums add up to the single-rank FP8 scores.
* `indexer_logits`: the indexer scores with their graph, at the selected keys ([B, T, k]) or, without a selection
  (the dense warm-up), at every key ([B, T, S]); an autograd function that keeps only its inputs for the backward
  and recomputes each chunk there (plain autograd would keep the [B, T·H, S] ReLU'd head logits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from temper_kernels import stable_topk
from temper_kernels.indexer import quantize_fp8, scores_reference


def _rows(budget: int, per_row: int) -> int:
    """Query rows per chunk so that a chunk's largest intermediate (`per_row` elements a row) stays within `budget`."""
    return max(1, budget // max(1, per_row))


def select_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, qpos: torch.Tensor, topk: int, relu: bool,
                fp8: bool, reduce: Callable[[torch.Tensor], torch.Tensor], budget: int) -> torch.Tensor:
    """Selected key positions [B, T, min(topk, S)] (ascending) from this rank's heads q [B,T,H,d], w [B,T,H] and the
    keys k [B,S,d], the partial scores summed by `reduce` chunk by chunk; no graph."""
    b, t, h, _ = q.shape
    s = k.shape[1]
    topk = min(topk, s)
    ks = None
    with torch.no_grad():
        if fp8:
            q, qs = quantize_fp8(q)
            k, ks = quantize_fp8(k)
            q, w, k = q.float(), w.float() * qs, k.float()
        kpos = torch.arange(s, device=k.device)
        step = _rows(budget, b * h * s)
        out = []
        for t0 in range(0, t, step):
            sc = scores_reference(q[:, t0 : t0 + step], w[:, t0 : t0 + step], k, relu)
            if ks is not None:
                sc = sc * ks[:, None, :]
            sc = reduce(sc).masked_fill(kpos > qpos[:, t0 : t0 + step, None], float("-inf"))
            out.append(stable_topk(sc, topk))
        return torch.cat(out, 1)


def indexer_logits(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, sel: torch.Tensor | None, relu: bool,
                   budget: int) -> torch.Tensor:
    """Σ_j w[b,t,j]·f(q[b,t,j]·k[b,s]) (f = ReLU or identity, fp32) at s = sel[b,t,:] ([B,T,k]), or at every key
    when `sel` is None ([B,T,S]); differentiable in q, w and k (see the module docstring)."""
    return _IndexerLogits.apply(q, w, k, sel, relu, budget)


def _chunk_logits(qc, kf, selc):
    """Head logits of a chunk: [B,C,H,k] at the selected keys (and those keys [B,C,k,d]), or [B,C,H,S]."""
    if selc is None:
        b, c, h, d = qc.shape
        return torch.matmul(qc.reshape(b, c * h, d), kf.transpose(1, 2)).view(b, c, h, -1), None
    kg = kf[torch.arange(kf.shape[0], device=kf.device)[:, None, None], selc]  # [B,C,k,d]
    return torch.einsum("bchd,bckd->bchk", qc, kg), kg


class _IndexerLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, k, sel, relu, budget):
        b, t, h, d = q.shape
        n = sel.shape[-1] if sel is not None else k.shape[1]
        out = torch.empty(b, t, n, dtype=torch.float32, device=q.device)
        kf = k.float()
        step = ctx.step = _rows(budget, b * n * max(h, d if sel is not None else 1))
        for t0 in range(0, t, step):
            if sel is None:  # the whole-matrix twin's own ops, a chunk of rows at a time
                out[:, t0 : t0 + step] = scores_reference(q[:, t0 : t0 + step], w[:, t0 : t0 + step], k, relu)
                continue
            lg, _ = _chunk_logits(q[:, t0 : t0 + step].float(), kf, sel[:, t0 : t0 + step])
            if relu:
                lg = lg.relu()
            out[:, t0 : t0 + step] = torch.einsum("bch,bchk->bck", w[:, t0 : t0 + step].float(), lg)
        ctx.save_for_backward(q, w, k, sel)
        ctx.relu = relu
        return out

    @staticmethod
    def backward(ctx, g):
        q, w, k, sel = ctx.saved_tensors
        b, t, h, d = q.shape
        kf = k.float()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        g = g.float()
        rows = torch.arange(b, device=q.device)[:, None, None]
        for t0 in range(0, t, ctx.step):
            t1 = min(t, t0 + ctx.step)
            qc, wc, gc = q[:, t0:t1].float(), w[:, t0:t1].float(), g[:, t0:t1]
            selc = sel[:, t0:t1] if sel is not None else None
            lg, kg = _chunk_logits(qc, kf, selc)
            f = lg.relu() if ctx.relu else lg
            dw[:, t0:t1] = torch.einsum("bck,bchk->bch", gc, f)
            dl = gc[:, :, None, :] * wc[..., None]
            if ctx.relu:
                dl = dl * (lg > 0)  # torch's ReLU backward: a zero or NaN logit passes no gradient
            if selc is None:
                dq[:, t0:t1] = torch.einsum("bchs,bsd->bchd", dl, kf)
                dk += torch.einsum("bchs,bchd->bsd", dl, qc)
            else:
                dq[:, t0:t1] = torch.einsum("bchk,bckd->bchd", dl, kg)
                dk.index_put_((rows.expand_as(selc), selc), torch.einsum("bchk,bchd->bckd", dl, qc), accumulate=True)
        return dq.to(q.dtype), dw.to(w.dtype), dk.to(k.dtype), None, None, None
