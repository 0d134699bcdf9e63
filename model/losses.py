"""Losses: masked next-token cross-entropy, the MTP loss, the DSA indexer KL loss.

Masks mark *target* tokens: mask[b, t] says whether token t of row b is trained on (for agent turns: the policy's
own tokens, not prompts or observations).

Where a loss's logits would be large (more than `LOGITS_CHUNK` fp32 elements: 16K positions of a 32K vocabulary are
2 GiB, of GLM-5's 154K 9.5 GiB, and the log-softmax and its gradient as much again), temper's `Transformer` goes
through its head in row chunks instead (`head_chunk_rows`): each chunk's `lm_head(norm(h))`, log-softmax and loss
are computed, reduced to per-row values and dropped, then recomputed in the backward (non-reentrant
`torch.utils.checkpoint` per chunk). No [N, V] tensor is kept for the backward. The next-token loss
(`lm_forward_loss`), the MTP loss, `token_logprobs` (log-probabilities and entropy, what SAO and OPD train on and
the engine rescores with) and `next_token_kl` (SAO's replay anchor) all do. Below the threshold (every CPU preset)
the losses are computed on the whole logits as before, bit for bit. Megatron's model goes through its
tensor-parallel head the same way (each chunk's logits gathered over the vocabulary's ranks, and again in the
backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import temper_kernels as kernels

from .transformer import ModelOutput, Transformer

LOGITS_CHUNK = 1 << 26  # fp32 logits elements (256 MiB) above which a loss goes through the head in row chunks


def head_chunk_rows(model, rows: int) -> int | None:
    """Rows per chunk for a loss over `rows` positions of `model`'s head, or None to compute the whole logits: chunks
    of about `LOGITS_CHUNK` logits where the whole would exceed it, on a model that can go through its head in
    chunks (`supports_head_chunks`: temper's `Transformer`, and Megatron's, whose head gathers the vocabulary from
    its tensor-parallel ranks chunk by chunk)."""
    if not getattr(model, "supports_head_chunks", False):
        return None
    v = model.config.vocab_size
    return max(1, LOGITS_CHUNK // v) if rows * v > LOGITS_CHUNK else None


def head_loss(norm, head, hidden: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None,
              chunk: int) -> torch.Tensor:
    """`lm_loss(head(norm(hidden)), targets, mask)` (hidden [B,T,H] before the norm; `head` the lm-head module or its
    weight) through the head in chunks of `chunk` rows."""
    weights = None if mask is None else mask.float()  # (None: every position)
    return kernels.chunked_cross_entropy(hidden, head, targets, chunk=chunk, norm=norm, weights=weights)


def lm_forward_loss(model, ids: torch.Tensor, mask: torch.Tensor | None = None, **run_kw
                    ) -> tuple[ModelOutput, torch.Tensor]:
    """`model.run(ids, **run_kw)` and its next-token loss (`next_token_loss`), through the head in chunks where the
    logits would be large (`head_chunk_rows`; the output's `logits` are then empty)."""
    chunk = head_chunk_rows(model, ids.shape[0] * (ids.shape[1] - 1))
    if chunk is None:
        out = model.run(ids, **run_kw)
        return out, next_token_loss(out.logits, ids, mask)
    out = model.run(ids, logits=False, **run_kw)
    loss = head_loss(model.norm, model.lm_head, out.hidden[:, :-1], ids[:, 1:], None if mask is None else mask[:, 1:],
                     chunk)
    return out, loss


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of logits [B,T,V] against targets [B,T] over positions where mask is true."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    if mask is None:
        return ce.mean()
    m = mask.to(ce.dtype)
    return (ce * m).sum() / m.sum().clamp_min(1.0)


def token_logprobs(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(token_p | prefix) at p ≥ 1 (0 at p = 0), entropy of the predictive distribution) [B, T].

    The one function every side scores tokens with: the trainers on their rows, and the engine when it rescores
    a finished segment (`Engine` pure-scoring requests). Called on the same unpadded row with the same weights it
    returns the same bits (CPU kernels are deterministic for one shape), which is what makes the embedded path's
    training/inference mismatch exactly 0."""
    chunk = head_chunk_rows(model, ids.shape[0] * (ids.shape[1] - 1))
    if chunk is None:
        logits = model(ids).float()
        logp_all = logits[:, :-1].log_softmax(-1)
        lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
    else:  # through the head in row chunks (see the module docstring)
        hidden = model.run(ids, logits=False).hidden[:, :-1]
        lp, ent = kernels.chunked_logprobs(hidden, model.lm_head, ids[:, 1:], chunk, norm=model.norm)
        lp, ent = lp.view(ids[:, 1:].shape), ent.view(ids[:, 1:].shape)
    z = lp.new_zeros(ids.shape[0], 1)
    return torch.cat([z, lp], 1), torch.cat([z, ent], 1)


def rows_logprobs(model: Transformer, ids: torch.Tensor, lengths: list[int] | None, exact: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` of right-padded rows [R, T]. `exact`: each row is forwarded alone at its true length (as
    the engine scores a segment), so its values do not depend on the other rows or on the padding — batched
    kernels reduce in a shape-dependent order and differ in the last bits (~5e-7). Else one padded forward."""
    if not exact or lengths is None or ids.shape[0] == 0:
        return token_logprobs(model, ids)
    lps, ents = [], []
    width = ids.shape[1]
    for i, n in enumerate(lengths):
        lp, ent = token_logprobs(model, ids[i : i + 1, :n])
        lps.append(F.pad(lp, (0, width - n)))
        ents.append(F.pad(ent, (0, width - n)))
    return torch.cat(lps), torch.cat(ents)


def next_token_kl(ref, model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Σ over the next-token positions `positions` (bool [T − 1] of one row `ids` [1, T]: position p predicts token
    p + 1) of KL(π_ref(· | prefix) ‖ π(· | prefix)) over the vocabulary; `ref` frozen (no gradient). Through both
    heads in row chunks where the logits would be large (`head_chunk_rows`), else on the whole logits."""
    chunk = head_chunk_rows(model, int(ids.shape[1]) - 1)
    if chunk is None or not getattr(ref, "supports_head_chunks", False):
        with torch.no_grad():
            lref = ref(ids).float()[:, :-1].log_softmax(-1)[0][positions]
        lp = model(ids).float()[:, :-1].log_softmax(-1)[0][positions]
        return (lref.exp() * (lref - lp)).sum()
    with torch.no_grad():
        href = ref.run(ids, logits=False).hidden[0, :-1][positions]
    h = model.run(ids, logits=False).hidden[0, :-1][positions]
    return kernels.chunked_kl(h, model.lm_head, href, ref.lm_head, chunk, norm=model.norm, ref_norm=ref.norm)


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None = None):
    """Shifted LM loss: logits at t predict input_ids[t+1]; mask is over input_ids."""
    return lm_loss(logits[:, :-1], input_ids[:, 1:], None if mask is None else mask[:, 1:])


def mtp_loss(
    model: Transformer,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    steps: int | None = None,
    weights: list[float] | None = None,
) -> torch.Tensor:
    """Mean over draft steps s = 0..steps-1 of the CE of predicting token i+2+s at position i.

    Step s combines its own previous hidden state (step 0: the main model's pre-norm `hidden`) with the
    embedding of token i+1+s, exactly as speculative decoding chains the drafts. `weights` scale each step's
    mean (data parallelism uses them to turn per-rank means into the global batch's mean)."""
    steps = steps or model.config.mtp_draft_steps
    t = input_ids.shape[1]
    h = hidden[:, : t - 1]
    losses = []
    for s in range(steps):
        n = t - 1 - s
        if n < 2:
            break
        tgt, tmask = input_ids[:, 2 + s :], None if mask is None else mask[:, 2 + s :]
        chunk = head_chunk_rows(model, input_ids.shape[0] * (n - 1))
        if chunk is None:
            logits, h = model.mtp(h[:, :n], input_ids[:, 1 + s : 1 + s + n], s)
            step_loss = lm_loss(logits[:, : n - 1], tgt, tmask)
        else:  # through the head in row chunks
            _, h = model.mtp(h[:, :n], input_ids[:, 1 + s : 1 + s + n], s, logits=False)
            step_loss = head_loss(model.mtp_head_norm(s), model.lm_head, h[:, : n - 1], tgt, tmask, chunk)
        losses.append(step_loss * weights[s] if weights is not None else step_loss)
    if not losses:
        raise ValueError("sequence too short for the MTP loss (need at least 3 tokens)")
    return torch.stack(losses).mean()


def indexer_kl_loss(stats: list[dict]) -> torch.Tensor:
    """KL(p_t ‖ softmax(I_t)) averaged over queries and indexer groups.

    `stats` comes from `model.run(..., collect_indexer=True)`: per indexer group, the indexer logits
    (with their graph) and the head-summed main attention of every layer of the group. With a selection
    recorded (sparse mode) both distributions are restricted to the selected tokens: the model records both
    at the selected keys only ([B, T, k], aligned with `sel`: what keeps long contexts at O(T·k)); logits and
    target over every key ([B, T, S]) with a selection are restricted here. Otherwise (dense warm-up, or no more
    keys than top-k) they cover every causal token. The target is L1-normalised.
    """
    if not stats:
        raise ValueError("no indexer statistics: run the model with collect_indexer=True on a DSA config")
    total = []
    for st in stats:
        logits, target, sel = st["index_logits"], st["target"], st["sel"]
        if sel is not None and logits.shape[-1] != sel.shape[-1]:  # over every key: keep the selected ones
            logits, target = logits.gather(-1, sel), target.gather(-1, sel)
        p = target / target.sum(-1, keepdim=True).clamp_min(1e-12)
        logq = logits.log_softmax(-1)
        kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - logq), torch.zeros_like(p)).sum(-1)
        total.append(kl.mean())
    return torch.stack(total).mean()


def indexer_parameters(model: Transformer) -> list[torch.nn.Parameter]:
    """Parameters of every lightning indexer (what the dense warm-up trains)."""
    return [p for n, p in model.named_parameters() if ".indexer." in n]
