"""Activation checkpointing (`Transformer.activation_checkpointing`, `trainer.activation_checkpointing`): the same
losses, gradients and side effects as the plain forward, with fewer tensors kept for backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import configs
from model import Transformer, indexer_kl_loss, mtp_loss, next_token_loss


def _loss(m: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, list, list]:
    """The LM trainer's loss: next token + MTP + the indexer's KL (its statistics collected in the forward)."""
    out = m.run(ids, collect_indexer=True, detach_indexer_input=True)
    total = next_token_loss(out.logits, ids, None) + 0.3 * mtp_loss(m, out.hidden, ids, None)
    return total + indexer_kl_loss(out.indexer_stats), out.indexer_stats, out.indexer_calls


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for backward while `fn` runs."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    # two indexer groups, so a replayed layer writing into the last collected entry would show
    plain = Transformer(configs.load("tiny", ["model.indexer_types=[full,shared,full,shared]"]).model).train()
    with torch.no_grad():
        for moe in plain.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.01)
    ckpt = copy.deepcopy(plain)
    ckpt.activation_checkpointing = True
    return plain, ckpt


def test_checkpointed_layers_give_the_same_loss_gradients_and_side_effects(pair):
    plain, ckpt = pair
    ids = torch.randint(0, 256, (3, 90), generator=torch.Generator().manual_seed(1))  # past index_topk 64: sparse
    for m in pair:
        m.zero_grad(set_to_none=True)
        for moe in m.moe_layers():
            moe.expert_load.zero_()
    la, stats_a, calls_a = _loss(plain, ids)
    lb, stats_b, calls_b = _loss(ckpt, ids)
    la.backward()
    lb.backward()
    assert torch.equal(la.detach(), lb.detach())
    # the statistics were collected once: after backward (the replay) every entry is still the plain forward's,
    # with no entry, indexer call, attention target or selection added or overwritten by the replay
    assert calls_a == calls_b and len(stats_a) == len(stats_b) > 0
    for ea, eb in zip(stats_a, stats_b):
        assert ea["layer"] == eb["layer"] and torch.equal(ea["sel"], eb["sel"])
        torch.testing.assert_close(eb["target"], ea["target"], rtol=0, atol=0)
        torch.testing.assert_close(eb["index_logits"].detach(), ea["index_logits"].detach(), rtol=0, atol=0)
    grads = dict(plain.named_parameters())
    for n, p in ckpt.named_parameters():
        g = grads[n].grad
        assert (g is None) == (p.grad is None), n
        if g is not None:
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7, msg=n)
    # the MoE load counts (the router-bias update reads them) were counted once, not again in the replay
    for a, b in zip(plain.moe_layers(), ckpt.moe_layers()):
        assert a.expert_load.sum() > 0 and torch.equal(a.expert_load, b.expert_load)


def test_the_replay_adds_no_indexer_call_without_statistics(pair):
    plain, ckpt = pair
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(3))
    outs = [m.run(ids) for m in pair]
    for o in outs:
        o.logits.float().sum().backward()
    assert outs[0].indexer_calls and outs[1].indexer_calls == outs[0].indexer_calls


def test_checkpointing_keeps_fewer_tensors_for_backward(pair, monkeypatch):
    import model.transformer as mt

    plain, ckpt = pair
    ids = torch.randint(0, 256, (3, 90), generator=torch.Generator().manual_seed(2))
    full = _saved_bytes(lambda: plain.run(ids).logits.sum())
    kept = _saved_bytes(lambda: ckpt.run(ids).logits.sum())
    assert kept < full / 2, (kept, full)
    calls, real = [], mt._checkpointed
    monkeypatch.setattr(mt, "_checkpointed", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():  # inference forwards are never checkpointed (nothing is kept for a backward anyway)
        ckpt.run(ids)
    assert calls == []
    ckpt.run(ids)  # a training forward checkpoints every main layer
    assert len(calls) == len(ckpt.layers)


def test_the_trainer_config_turns_it_on_and_megatron_refuses_it():
    from pydantic import ValidationError

    from trainers.config import TrainerConfig
    from trainers.runtime import make_train_backend

    be = make_train_backend(TrainerConfig(activation_checkpointing=True))
    m = be.wrap(Transformer(configs.load("micro").model))
    assert m.activation_checkpointing and not Transformer.activation_checkpointing
    assert not make_train_backend(TrainerConfig()).wrap(Transformer(configs.load("micro").model)).activation_checkpointing
    with pytest.raises(ValidationError, match="activation_checkpointing"):
        TrainerConfig(kind="megatron", activation_checkpointing=True)
