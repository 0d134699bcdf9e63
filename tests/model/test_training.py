"""Losses and learning: masked CE, MTP, the indexer KL in both modes, and that `tiny` learns."""

import pytest
import torch

import configs
from model import ByteTokenizer, Transformer, indexer_kl_loss, indexer_parameters, lm_loss, mtp_loss
from model.losses import next_token_loss
from trainers.data import generated_corpus, lm_batches, unigram_entropy
from trainers.lm import LMTrainer, dense_indexer_warmup, train_lm


def test_lm_loss_hand_computation():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    targets = torch.tensor([[0, 0, 1]])
    mask = torch.tensor([[True, False, True]])
    import math

    ce0 = -math.log(math.exp(2) / (math.exp(2) + 1))
    ce2 = math.log(2)
    assert abs(lm_loss(logits, targets, mask).item() - (ce0 + ce2) / 2) < 1e-6
    # shifted: mask is over the input ids, position t's logits predict token t+1
    ids = torch.tensor([[1, 0, 0, 1]])
    m = torch.tensor([[False, True, False, True]])
    assert abs(next_token_loss(torch.cat([logits, logits[:, :1]], 1), ids, m).item() - (ce0 + ce2) / 2) < 1e-6


def test_mtp_loss_uses_the_token_two_ahead(cfg_factory):
    torch.manual_seed(0)
    m = Transformer(cfg_factory(mtp_draft_steps=1))
    ids = torch.randint(0, 300, (2, 12))
    h = m.run(ids).hidden
    logits, _ = m.mtp(h[:, :-1], ids[:, 1:])
    want = lm_loss(logits[:, :-1], ids[:, 2:])
    torch.testing.assert_close(mtp_loss(m, h, ids), want)


def test_mtp_loss_falls_when_trained():
    cfg = configs.load("micro", ["train.max_seconds=1800", "train.mtp_loss_weight=1.0"])
    torch.manual_seed(0)
    m = Transformer(cfg.model)
    ids = ByteTokenizer().encode(generated_corpus(500))
    hist = train_lm(m, lm_batches(ids, 64, 8), cfg.train, steps=80)
    first = sum(s.mtp_loss for s in hist[:5]) / 5
    last = sum(s.mtp_loss for s in hist[-5:]) / 5
    assert last < 0.5 * first


def test_dense_warmup_trains_only_the_indexer_and_kl_falls(cfg_factory):
    torch.manual_seed(0)
    m = Transformer(cfg_factory(index_topk=8, initializer_range=0.1))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batches = iter(lambda: torch.randint(0, 300, (4, 32), generator=g), None)
    kls = dense_indexer_warmup(m, batches, steps=60, lr=3e-3)
    assert kls[-1] < 0.7 * kls[0]
    ix = {id(p) for p in indexer_parameters(m)}
    assert ix
    assert any(not torch.equal(before[n], p) for n, p in m.named_parameters() if ".indexer." in n)
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters() if ".indexer." not in n)


def test_sparse_mode_keeps_gradient_paths_apart(cfg_factory):
    """Sparse training: the KL trains only the indexer (input detached); the LM loss never reaches it."""
    torch.manual_seed(0)
    m = Transformer(cfg_factory(index_topk=8))
    ids = torch.randint(0, 300, (2, 30))
    out = m.run(ids, collect_indexer=True, detach_indexer_input=True)
    assert all(st["sel"] is not None for st in out.indexer_stats)
    kl = indexer_kl_loss(out.indexer_stats)
    params = dict(m.named_parameters())
    g_kl = torch.autograd.grad(kl, list(params.values()), allow_unused=True, retain_graph=True)
    for (n, _), g in zip(params.items(), g_kl):
        expect = ".indexer." in n and not n.startswith("mtp_layers")  # the MTP block is not in this forward
        assert (g is not None and g.abs().sum() > 0) == expect, n
    g_lm = torch.autograd.grad(next_token_loss(out.logits, ids), list(params.values()), allow_unused=True)
    for (n, _), g in zip(params.items(), g_lm):
        if ".indexer." in n:
            assert g is None or g.abs().sum() == 0, n


def test_indexer_kl_hand_case():
    # one query, three keys: target head-sum [1, 3, 0] → p = [.25, .75, 0]; indexer logits [0, log 3, -inf]
    import math

    logits = torch.tensor([[[0.0, math.log(3.0), float("-inf")]]])
    target = torch.tensor([[[1.0, 3.0, 0.0]]])
    kl = indexer_kl_loss([{"index_logits": logits, "target": target, "sel": None}])
    assert abs(kl.item()) < 1e-6
    logits2 = torch.tensor([[[0.0, 0.0, float("-inf")]]])
    want = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    kl2 = indexer_kl_loss([{"index_logits": logits2, "target": target, "sel": None}])
    assert abs(kl2.item() - want) < 1e-6
    # restricted to a selection {1}: both distributions are a point mass → 0
    kl3 = indexer_kl_loss([{"index_logits": logits2, "target": target, "sel": torch.tensor([[[1]]])}])
    assert abs(kl3.item()) < 1e-6


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # two threads beside other work can slow it tenfold (OpenMP spin-waits)
def test_tiny_learns_within_a_cpu_minute():
    cfg = configs.load("tiny", ["train.max_steps=80"])  # held-out loss / unigram entropy: 0.36 at 50 steps, 0.12 at 80
    torch.manual_seed(0)
    tok = ByteTokenizer()
    ids = tok.encode(generated_corpus(4000))
    h = unigram_entropy(ids)
    m = Transformer(cfg.model)
    hist = train_lm(m, lm_batches(ids, cfg.train.seq_len, cfg.train.batch_size), cfg.train)
    # held-out text from another seed
    held = tok.encode(generated_corpus(200, seed=99))
    x = torch.tensor(held[: 8 * 128]).view(8, 128)
    m.eval()
    with torch.no_grad():
        loss = next_token_loss(m(x), x).item()
    assert hist[0].loss > h  # starts above the unigram entropy ...
    assert loss < 0.25 * h  # ... and ends well below it on held-out text


def test_trainer_step_respects_the_mask(cfg_factory):
    torch.manual_seed(0)
    m = Transformer(cfg_factory())
    tr = LMTrainer(m, configs.load("micro").train, indexer_loss=False)
    ids = torch.randint(0, 300, (2, 16))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 8:] = True
    st = tr.step(ids, mask)
    assert st.tokens == 16 and st.loss > 0
