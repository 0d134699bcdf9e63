"""Losses through the head in row chunks (`model.losses.head_chunk_rows`): the same values and gradients as the
whole logits, and no [N, V] tensor kept for the backward. The threshold is lowered so that the micro model's
losses split into several chunks, the last one ragged."""

import copy

import pytest
import torch

import configs
import model.losses as losses
from model import Transformer, lm_forward_loss, mtp_loss, token_logprobs
from trainers.config import TrainConfig
from trainers.lm import LMTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

B, T = 2, 24  # 2 × 23 = 46 next-token positions


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(configs.load("micro").model)


def _batch(v: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.6
    return ids, mask


def _grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.fixture
def chunks_of_7(monkeypatch):
    """Chunks of 7 rows on the micro model: 46 positions go through in 7 chunks, the last of 4 rows."""
    v = configs.load("micro").model.vocab_size
    monkeypatch.setattr(losses, "LOGITS_CHUNK", 7 * v)
    assert losses.head_chunk_rows(_model(), 46) == 7 and losses.head_chunk_rows(_model(), 7) is None
    return 7


def _both(fn):
    """fn(model) with the whole logits and through chunks, each on a fresh copy of the same weights: (values, grads)."""
    m = _model()
    whole, chunked = copy.deepcopy(m), copy.deepcopy(m)
    out = []
    for mm, limit in ((whole, 1 << 40), (chunked, None)):
        saved = losses.LOGITS_CHUNK
        if limit is not None:
            losses.LOGITS_CHUNK = limit
        try:
            vals = fn(mm)
        finally:
            losses.LOGITS_CHUNK = saved
        sum(v.float().sum() * (i + 1) for i, v in enumerate(vals)).backward()
        out.append(([v.detach() for v in vals], _grads(mm)))
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_next_token_and_mtp_losses_match_the_whole_logits(chunks_of_7, masked):
    ids, mask = _batch(272)
    mask = mask if masked else None

    def fn(m):
        out, loss = lm_forward_loss(m, ids, mask)
        return [loss, mtp_loss(m, out.hidden, ids, mask, steps=2)]

    (v_whole, g_whole), (v_chunk, g_chunk) = _both(fn)
    for a, b in zip(v_whole, v_chunk, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    _close(g_whole, g_chunk)
    # and against a hand computation of the next-token loss from the whole logits
    m = _model()
    logits = m(ids)[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    w = torch.ones_like(ce) if mask is None else mask[:, 1:].flatten().float()
    torch.testing.assert_close(v_chunk[0], (ce * w).sum() / w.sum(), rtol=1e-6, atol=1e-6)


def test_token_logprobs_and_entropy_match_the_whole_logits(chunks_of_7):
    ids, _ = _batch(272)
    (v_whole, g_whole), (v_chunk, g_chunk) = _both(lambda m: list(token_logprobs(m, ids)))
    for a, b in zip(v_whole, v_chunk, strict=True):
        assert a.shape == b.shape == (B, T)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    _close(g_whole, g_chunk)
    with torch.no_grad():  # scoring without a graph (the engine's rescoring) takes the chunks too
        lp, ent = token_logprobs(_model(), ids)
    torch.testing.assert_close(lp, v_whole[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, v_whole[1], rtol=1e-5, atol=1e-5)


def test_no_logits_are_kept_for_the_backward(chunks_of_7):
    """What autograd saves for the backward, seen by a saved-tensors hook: the whole-logits path keeps [.., V]
    tensors (the log-softmax), the chunked path none (each chunk's are recomputed)."""
    ids, mask = _batch(272)
    v = configs.load("micro").model.vocab_size

    def widest(limit):
        saved = losses.LOGITS_CHUNK
        losses.LOGITS_CHUNK = limit
        seen = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
                m = _model()
                out, loss = lm_forward_loss(m, ids, mask)
                mtp_loss(m, out.hidden, ids, mask, steps=1)
                token_logprobs(m, ids)
        finally:
            losses.LOGITS_CHUNK = saved
        return [s for s in seen if len(s) and s[-1] == v and s.numel() >= 2 * 7 * v]

    assert widest(1 << 40)  # the test sees logits where they are kept
    assert widest(7 * v) == []


def test_an_lm_step_through_chunks_takes_the_same_step(chunks_of_7):
    """The LM trainer's step (next-token and MTP losses) moves the weights as with the whole logits."""
    ids, mask = _batch(272)
    tc = TrainConfig(lr=1e-3, warmup_steps=0, mtp_loss_weight=0.3)
    m = _model()
    whole, chunked = copy.deepcopy(m), copy.deepcopy(m)
    saved = losses.LOGITS_CHUNK
    losses.LOGITS_CHUNK = 1 << 40
    try:
        a = LMTrainer(whole, tc, indexer_loss=False).step(ids, mask)
    finally:
        losses.LOGITS_CHUNK = saved
    b = LMTrainer(chunked, tc, indexer_loss=False).step(ids, mask)
    assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.mtp_loss == pytest.approx(b.mtp_loss, rel=1e-6)
    moved = {n: p.detach() for n, p in chunked.named_parameters()}
    _close({n: p.detach() for n, p in whole.named_parameters()}, moved, tol=1e-6)
    assert any(not torch.equal(moved[n], p) for n, p in m.named_parameters())  # the step did move them
