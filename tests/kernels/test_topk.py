"""The indexer's radix-select top-k (`temper_kernels.indexer.topk_rows`, under TRITON_INTERPRET=1 on a machine without
a GPU) against an independent sort-based selection and the twin `stable_topk`: ties, all-equal rows, −inf, NaN and
−0.0 scores, causal limits (none allowed, exactly k, k + 1, past the row), rows split over several programs and merged
(one, two and three merge passes), decode rows split by the default sizes, and the fused indexer path on the same."""

from __future__ import annotations

import math

import pytest
import torch

import temper_kernels as kernels
from temper_kernels import indexer as kix

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed on this platform")

NEG_NAN = torch.tensor([-0x400000], dtype=torch.int32).view(torch.float32).item()  # bits 0xFFC00000: a NaN, sign set


def _slow(scores: torch.Tensor, qpos: torch.Tensor, k: int) -> torch.Tensor:
    """Independent selection: per row, sort (score desc with NaN and s > qpos as −inf, then position asc), take k,
    return them ascending. Python floats: −0.0 == 0.0."""
    out = []
    for row, qp in zip(scores.tolist(), qpos.tolist(), strict=True):
        ranked = sorted((-(v if v == v and p <= qp else -math.inf), p) for p, v in enumerate(row))
        out.append(sorted(p for _, p in ranked[:k]))
    return torch.tensor(out, dtype=torch.long)


def _twin(scores: torch.Tensor, qpos: torch.Tensor, k: int) -> torch.Tensor:
    past = torch.arange(scores.shape[-1]) > qpos[:, None]
    return kix.stable_topk(scores.masked_fill(past, float("-inf")), k)


def _rows(s: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grid = lambda: torch.randint(-2, 3, (s,), generator=g).float()  # noqa: E731  (many exact ties)
    rows, qpos = [], []
    rows.append(torch.randn(s, generator=g)), qpos.append(s - 1)
    rows.append(grid()), qpos.append(s // 2)
    rows.append(torch.zeros(s)), qpos.append(s - 1)  # all equal: the first k
    rows.append(torch.full((s,), float("-inf"))), qpos.append(s - 1)
    odd = grid()
    odd[1::7], odd[3::11], odd[5::13] = float("nan"), NEG_NAN, float("inf")
    odd[2::9] = float("-inf")
    rows.append(odd), qpos.append(s + 5)  # NaN of either sign ranks as −inf; a limit past the row
    rows.append(torch.randn(s, generator=g)), qpos.append(-1)  # nothing allowed: the first k, as stable_topk
    rows.append(torch.randn(s, generator=g)), qpos.append(k - 1)  # exactly k allowed
    rows.append(grid()), qpos.append(k)  # k + 1 allowed
    fill = torch.full((s,), float("-inf"))
    fill[::2] = float("nan")
    fill[-4:-2] = 1.0  # two real scores; the other k − 2 slots go to NaN and −inf keys alike, the earliest first
    rows.append(fill), qpos.append(s - 2)
    signed_zeros = torch.tensor([-0.0, 0.0, -1.0])[torch.randint(0, 3, (s,), generator=g)]
    rows.append(signed_zeros), qpos.append(s - 1)  # −0.0 ties with +0.0 (earlier position first)
    late = torch.full((s,), -1.0)
    late[-k:] = 1.0  # the winners all in the last block, the threshold ties spread over every block
    rows.append(late), qpos.append(s - 1)
    return torch.stack(rows), torch.tensor(qpos)


@pytest.mark.parametrize("s, k, block, merges", [(40, 8, 8192, 0), (70, 16, 64, 1), (100, 4, 16, 2), (257, 3, 16, 3)])
def test_topk_rows_is_the_sort_based_selection(monkeypatch, s, k, block, merges):
    """One program a row; and rows split into blocks of 16 or 64 keys, merged two or four candidate lists at a time
    (k = 3: lists padded to 4; the merge passes counted). The twin and the slow sort agree with the kernel."""
    monkeypatch.setattr(kix, "TOPK_BLOCK", block)
    launches = []
    real = kix._topk_merge_kernel
    monkeypatch.setattr(kix, "_topk_merge_kernel", type("Spy", (), {"__getitem__": lambda _, grid: (
        launches.append(grid), real[grid])[1]})())
    scores, qpos = _rows(s, k, seed=s)
    got = kix.topk_rows(scores, qpos, k)
    want = _slow(scores, qpos, k)
    assert torch.equal(got, want)
    assert torch.equal(_twin(scores, qpos, k), want)
    assert len(launches) == merges
    assert torch.equal(got[2], torch.arange(k)) and torch.equal(got[5], torch.arange(k))
    assert torch.equal(got[8], torch.cat([torch.arange(k - 2), torch.tensor([s - 4, s - 3])]))
    assert torch.equal(got[-1], torch.arange(s - k, s))


def test_long_decode_rows_split_over_programs_at_the_default_sizes(monkeypatch):
    """Two rows of 3,000 keys at the default block size: few rows, so each is split into blocks of 1,024 keys (three
    programs a row) and merged once; ties straddle the blocks."""
    launches = []
    real_block, real_merge = kix._topk_block_kernel, kix._topk_merge_kernel
    spy = lambda real: type("Spy", (), {"__getitem__": lambda _, grid: (launches.append(grid), real[grid])[1]})()  # noqa: E731
    monkeypatch.setattr(kix, "_topk_block_kernel", spy(real_block))
    monkeypatch.setattr(kix, "_topk_merge_kernel", spy(real_merge))
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (2, 3000), generator=g).float()
    qpos = torch.tensor([2999, 1700])
    got = kix.topk_rows(scores, qpos, 300)
    assert launches == [(2, 3), (2, 1)]
    assert torch.equal(got, _slow(scores, qpos, 300))


def test_indexer_nan_scores_rank_as_minus_inf_on_both_paths(triton_mode):
    """A NaN key (its scores NaN for every query): the twin ranks it as −inf; the kernel path used to rank it as 0
    (ReLU dropped the NaN) or, without ReLU, above every number (a positive NaN's bits). Negative head weights make
    every real score ≤ 0, so 0 or +NaN would win."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 2, 16, generator=g), torch.randn(1, 20, 16, generator=g)
    w = -torch.randn(1, 2, 2, generator=g).abs()
    k[0, 3] = float("nan")
    qpos = torch.tensor([[19, 10]])
    for relu in (True, False):
        want = kix.indexer_topk_reference(q, w, k, qpos, 4, relu=relu)
        assert 3 not in want.tolist()[0][0]
        assert torch.equal(kernels.indexer_topk(q, w, k, qpos, 4, relu=relu), want)


def test_indexer_causal_and_decode_rows_split_over_programs(triton_mode, monkeypatch):
    """The fused path with rows split into blocks of 16 keys: causal prefill rows (ties from a coarse grid) and decode
    rows (one query a sequence over 300 keys), against the twin."""
    monkeypatch.setattr(kix, "TOPK_BLOCK", 16)
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-2, 3, (2, 6, 2, 16), generator=g) * 0.5
    w = torch.randint(-2, 3, (2, 6, 2), generator=g) * 0.25
    k = torch.randint(-2, 3, (2, 80, 16), generator=g) * 0.5
    qpos = torch.arange(74, 80).expand(2, 6).clone()
    qpos[1, :3] = torch.tensor([0, 5, 6])  # 1, exactly k (6) and k + 1 keys allowed
    assert torch.equal(kernels.indexer_topk(q, w, k, qpos, 6), kix.indexer_topk_reference(q, w, k, qpos, 6))
    q, w, k = torch.randn(3, 1, 2, 16, generator=g), torch.randn(3, 1, 2, generator=g), torch.randn(3, 300, 16, generator=g)
    qpos = torch.tensor([[299], [150], [7]])
    assert torch.equal(kernels.indexer_topk(q, w, k, qpos, 8), kix.indexer_topk_reference(q, w, k, qpos, 8))
