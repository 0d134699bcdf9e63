"""The indexer's scores kernel (`temper_kernels.indexer._scores_kernel`: heads folded into the M side of one dot,
only causal tiles) under TRITON_INTERPRET=1 in fp32: its scores against `scores_reference` on every key a row may
see, the tiles it must skip left untouched, −inf past a row's qpos inside the tiles it computes, and the fused
top-k against the twin when every unwritten score is a sentinel that would win if read."""

from __future__ import annotations

import pytest
import torch

import temper_kernels as kernels
from temper_kernels import indexer as kix

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed on this platform")

SENTINEL = 12345.0


def _grid_inputs(b, t, s, hi, d, seed):
    """Dyadic values: every score is exact in fp32 whatever the summation order (heads, D slices), and many tie."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (b, t, hi, d), generator=g) * 0.5
    w = torch.randint(-2, 3, (b, t, hi), generator=g) * 0.25
    k = torch.randint(-2, 3, (b, s, d), generator=g) * 0.5
    return q.float(), w.float(), k.float()


def _qpos(b, t, s, seed, bs):
    """Per-row limits that differ inside a row block, not monotone: −1 (nothing), a block's first key exactly
    (that block is needed for that row alone), past the last key, and random ones."""
    g = torch.Generator().manual_seed(seed)
    qpos = torch.randint(0, s // 2, (b, t), generator=g)  # the first batch row: its last tiles skipped
    qpos[1:] = torch.randint(0, s, (b - 1, t), generator=g)
    qpos[0, 0] = -1
    qpos[0, min(1, t - 1)] = 2 * bs  # the first key of column block 2
    qpos[-1, -1] = s + 3
    if t > 3:
        qpos[0, 3] = 0
    return qpos


def _filled(fill):
    def alloc(b, n, s, device):
        return torch.full((b, n, s), fill, dtype=torch.float32, device=device)

    return alloc


def _computed(qpos, bt, bs, n_cols):
    """[B, T, n_cols // bs] which column blocks the row block of each row must compute: those starting at or before
    the largest qpos of the block's rows (independent of how programs group the column blocks)."""
    b, t = qpos.shape
    out = torch.zeros(b, t, n_cols, dtype=torch.bool)
    for r0 in range(0, t, bt):
        top = qpos[:, r0 : r0 + bt].max(1).values  # [B]
        starts = torch.arange(0, n_cols) * bs
        out[:, r0 : r0 + bt] = (starts[None, :] <= top[:, None])[:, None, :]
    return out


# (B, T, HI, D, S, BLOCKS (rows, keys, warps, top-k warps) or None, column blocks a program walks, relu):
# T not a multiple of the row block; HI 3 and 5 (padded to 4 and 8 heads); S not a multiple of the key block and
# several groups of column blocks; the default tiles (fp32: M = 64, one row block covering T); GLM-5's 32 heads; an
# index dim the fp32 path slices
SHAPES = [
    (2, 7, 3, 16, 100, (2, 16, 4, 4), 2, True),
    (1, 9, 5, 32, 70, (4, 16, 4, 4), 3, False),
    (2, 5, 2, 16, 200, None, 1, True),
    (1, 3, 32, 16, 50, (1, 16, 4, 4), 2, True),
    (1, 5, 4, 64, 80, (4, 16, 4, 4), 2, True),  # fp32 dots over D in two slices of 32
]


@pytest.mark.parametrize("b, t, hi, d, s, blocks, group, relu", SHAPES)
def test_scores_kernel_computes_only_causal_tiles_and_matches_the_twin(triton_mode, monkeypatch, b, t, hi, d, s,
                                                                      blocks, group, relu):
    monkeypatch.setattr(kix, "BLOCKS", blocks)
    monkeypatch.setattr(kix, "SCORE_GROUP", group)
    monkeypatch.setattr(kix, "_alloc_scores", _filled(SENTINEL))
    q, w, k = _grid_inputs(b, t, s, hi, d, seed=t * s)
    hp = 1 << (hi - 1).bit_length()
    bt, bs, _, _ = kix._score_tiles(hp, d, t, False)
    qpos = _qpos(b, t, s, seed=s, bs=bs)
    got = kix._indexer_topk_triton(q, w, k, qpos, 4, False, relu, scores_only=True)
    want = kix.scores_reference(q, w, k, relu)
    n_blocks = -(-s // bs)
    block = _computed(qpos, bt, bs, n_blocks).repeat_interleave(bs, -1)[..., :s]  # [B, T, S]
    seen = torch.arange(s) <= qpos[..., None]
    assert (block & seen).sum() > 0 and (~block).sum() > 0  # both kinds of tile occur
    assert torch.equal(got[seen], want[seen])  # every key a row may see: its exact score (no needed tile skipped)
    assert (got[~block] == SENTINEL).all()  # the tiles past every row's qpos: neither computed nor written
    assert (got[block & ~seen] == float("-inf")).all()  # inside a computed tile, past the row's own qpos: −inf


@pytest.mark.parametrize("b, t, hi, d, s, blocks, group, relu", SHAPES)
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_topk_never_reads_an_unwritten_score(triton_mode, monkeypatch, b, t, hi, d, s, blocks, group, relu,
                                                   fp8):
    """Every score the kernel does not write is +inf: a top-k reading one would pick it (and a skipped tile a row
    needs would show the same way); the selection is still the twin's, ties included."""
    monkeypatch.setattr(kix, "BLOCKS", blocks)
    monkeypatch.setattr(kix, "SCORE_GROUP", group)
    monkeypatch.setattr(kix, "_alloc_scores", _filled(float("inf")))
    q, w, k = _grid_inputs(b, t, s, hi, d, seed=t + s)
    qpos = _qpos(b, t, s, seed=s + 1, bs=16)
    for topk in (5, 16):
        got = kernels.indexer_topk(q, w, k, qpos, topk, fp8=fp8, relu=relu)
        assert torch.equal(got, kix.indexer_topk_reference(q, w, k, qpos, topk, fp8=fp8, relu=relu)), topk


def test_score_tiles_are_wgmma_sized_at_glm5_shapes():
    """GLM-5's indexer (32 heads × 128): M = 4 rows × 32 heads = 128 against 128 keys on tensor cores, the whole D in
    one dot; a decode step (one row) keeps M = 32 rather than padding rows; fp32 FMA dots take M = 64 in slices of
    D; M never drops below a dot's 16 (two heads, one row)."""
    assert kix._score_tiles(32, 128, 4096, True) == (4, 128, 8, 128)
    assert kix._score_tiles(32, 128, 1, True) == (1, 128, 8, 128)
    assert kix._score_tiles(32, 128, 4096, False) == (2, 64, 8, 32)
    bt, _, _, _ = kix._score_tiles(2, 16, 1, True)
    assert bt * 2 == 16


def test_an_index_dim_the_kernel_cannot_tile_takes_the_twin(triton_mode):
    q, w, k = _grid_inputs(1, 3, 10, 2, 24, seed=0)
    qpos = torch.tensor([[9, 4, 7]])
    with pytest.raises(ValueError, match="power-of-two index dim ≥ 16, not 24"):
        kix._indexer_topk_triton(q, w, k, qpos, 4, False)
    assert torch.equal(kernels.indexer_topk(q, w, k, qpos, 4), kix.indexer_topk_reference(q, w, k, qpos, 4))
