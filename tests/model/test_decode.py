"""Incremental decoding with the latent cache reproduces full-sequence logits."""

import pytest
import torch

from model import KVCache, Transformer


def _model(cfg_factory, **kw):
    torch.manual_seed(0)
    m = Transformer(cfg_factory(initializer_range=0.08, **kw)).eval()
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.uniform_(0, 0.1)
    return m


@pytest.mark.parametrize("dsa", [True, False])
def test_token_by_token_absorbed_matches_full(cfg_factory, dsa):
    m = _model(cfg_factory, use_dsa=dsa)
    ids = torch.randint(0, 300, (3, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(ids)
        cache = KVCache(m.config, n_slots=3, max_len=40)
        steps = [m(ids[:, t : t + 1], cache=cache, impl="absorbed")[:, 0] for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [30, 30, 30]


def test_ragged_batch_chunked_prefill_then_decode(cfg_factory):
    """Sequences of different lengths in one batch: right-padded prefill chunks, then decode steps."""
    m = _model(cfg_factory)
    g = torch.Generator().manual_seed(2)
    lens = [25, 11, 18]
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in lens]
    with torch.no_grad():
        refs = [m(s[None])[0] for s in seqs]
        cache = KVCache(m.config, n_slots=5, max_len=32)
        slots = torch.tensor([4, 0, 2])  # not contiguous: exercises the gather path
        # prefill the first 9 / 5 / 7 tokens in one ragged call (expanded path)
        pre = [9, 5, 7]
        batch = torch.zeros(3, max(pre), dtype=torch.long)
        for b, s in enumerate(seqs):
            batch[b, : pre[b]] = s[: pre[b]]
        out = m(batch, cache=cache, slots=slots, n_new=torch.tensor(pre), impl="expanded")
        for b in range(3):
            torch.testing.assert_close(out[b, : pre[b]], refs[b][: pre[b]], atol=1e-5, rtol=0)
        # then one token at a time; finished sequences send a padded row with n_new = 0
        pos = list(pre)
        while any(p < n for p, n in zip(pos, lens)):
            step = torch.zeros(3, 1, dtype=torch.long)
            n_new = torch.tensor([int(p < n) for p, n in zip(pos, lens)])
            for b in range(3):
                if n_new[b]:
                    step[b, 0] = seqs[b][pos[b]]
            out = m(step, cache=cache, slots=slots, n_new=n_new)
            for b in range(3):
                if n_new[b]:
                    torch.testing.assert_close(out[b, 0], refs[b][pos[b]], atol=1e-5, rtol=0)
                    pos[b] += 1
    assert cache.lengths[slots].tolist() == lens


def test_absorbed_equals_expanded_on_a_multi_token_step(cfg_factory):
    m = _model(cfg_factory)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outs = {}
        for impl in ("absorbed", "expanded"):
            cache = KVCache(m.config, 2, 32)
            m(ids[:, :14], cache=cache, impl=impl)
            outs[impl] = m(ids[:, 14:], cache=cache, impl=impl)
    torch.testing.assert_close(outs["absorbed"], outs["expanded"], atol=1e-5, rtol=0)


def test_cache_overflow_and_bad_n_new_are_refused(cfg_factory):
    m = _model(cfg_factory)
    cache = KVCache(m.config, 1, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="cache overflow"):
        m(torch.zeros(1, 9, dtype=torch.long), cache=cache)
    with torch.no_grad(), pytest.raises(ValueError, match="n_new"):
        m(torch.zeros(1, 2, dtype=torch.long), cache=cache, n_new=torch.tensor([3]))
    assert cache.lengths.tolist() == [0]


def test_truncate_rolls_back(cfg_factory):
    m = _model(cfg_factory)
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(5))
    other = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = m(ids)
        cache = KVCache(m.config, 1, 32)
        m(ids[:, :15], cache=cache)
        m(other, cache=cache)  # speculative tokens that get rejected
        cache.truncate(torch.tensor([0]), torch.tensor([15]))
        out = m(ids[:, 15:], cache=cache)
    torch.testing.assert_close(out, full[:, 15:], atol=1e-5, rtol=0)


def test_mtp_incremental_matches_full(cfg_factory):
    m = _model(cfg_factory)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        h = m.run(ids).hidden
        full, _ = m.mtp(h[:, :-1], ids[:, 1:])
        cache = KVCache(m.config, 2, 32)
        steps = [m.mtp(h[:, t : t + 1], ids[:, t + 1 : t + 2], cache=cache)[0][:, 0] for t in range(19)]
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=0)
