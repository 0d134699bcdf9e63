"""The sparse MLA kernels (`temper_kernels.mla`: all heads of a token in one program, split-K for few tokens, the
backward's dkv from all heads at once) under TRITON_INTERPRET=1 in fp32 against `sparse_mla_reference`: head counts up
to GLM-5's 64 in one program, a pool of slots, −1 pads, causal limits, a query with no usable key, the split-K
forward (decode at batch 1) merged against the one-pass one, NaN, and the dkv atomics counted as the interpreter runs
them."""

from __future__ import annotations

import pytest
import torch

import temper_kernels as kernels
from temper_kernels import mla as kmla

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed on this platform")


def _inputs(b, t, h, dv, dr, kk, s=48, seed=0):
    """q [B,T,H,dv+dr], a pool of 3 slots of s rows, idx [B,T,kk] (distinct rows, pads, picks past qpos), qpos, slots
    (row b reads slot slots[b]); query (0, 1) has no usable key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dv + dr, generator=g, requires_grad=True)
    kv = torch.randn(3, s, dv + dr, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(s, generator=g)[:kk] for _ in range(b * t)]).view(b, t, kk)
    qpos = torch.randint(s // 3, s, (b, t), generator=g)
    idx[0, 0, :5] = -1  # pads
    idx[-1, -1, 3::4] = -1
    if t > 1:
        qpos[0, 1] = 2
        idx[0, 1] = torch.arange(s - kk, s)  # every pick past the causal limit: output 0, no gradient
    return q, kv, idx, qpos, torch.tensor([2, 0, 1][:b])


def _check(q, kv, idx, qpos, slots, dv, atol=2e-5):
    got = kernels.sparse_mla(q, kv, idx, qpos, 0.3, dv, slots)
    want = kmla.sparse_mla_reference(q, kv, idx, qpos, 0.3, dv, slots)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    gout = torch.randn(got.shape, generator=torch.Generator().manual_seed(9))
    dq, dkv = torch.autograd.grad(got, (q, kv), gout)
    rq, rkv = torch.autograd.grad(want, (q, kv), gout)
    torch.testing.assert_close(dq, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dkv, rkv, atol=1e-5, rtol=1e-5)
    unused = sorted(set(range(kv.shape[0])) - set(slots.tolist()))
    assert all(dkv[u].abs().max() == 0 for u in unused)
    return got


class _Grids:
    """Record each launch's grid of the named kernels (the real kernels still run)."""

    def __init__(self, monkeypatch, *names):
        self.seen = {n: [] for n in names}
        for n in names:
            real = getattr(kmla, n)
            spy = type("Spy", (), {"__getitem__": lambda _, grid, n=n, real=real: (self.seen[n].append(grid),
                                                                                 real[grid])[1]})()
            monkeypatch.setattr(kmla, n, spy)


@pytest.mark.parametrize("b, t, h, dv, dr, kk", [(2, 3, 4, 16, 16, 20), (1, 3, 33, 32, 16, 24),
                                                 (2, 2, 64, 16, 16, 18)])
@pytest.mark.parametrize("split", [1, 3])
def test_all_heads_of_a_token_in_one_program_forward_and_backward(triton_mode, monkeypatch, b, t, h, dv, dr, kk,
                                                                    split):
    """Up to 64 heads (a padded block of 33, GLM-5's 64) run as one program per token in every kernel, one pass or
    the selection split (16-slot tiles: two parts; query (0, 1) has no usable key in either part)."""
    monkeypatch.setattr(kmla, "SPLIT", split)
    monkeypatch.setattr(kmla, "BLOCKS", (kmla._blocks(h, dv)[0], 16, 4))
    grids = _Grids(monkeypatch, "_fwd_kernel", "_combine_kernel", "_bwd_ds_kernel", "_bwd_dq_kernel", "_bwd_dkv_kernel")
    q, kv, idx, qpos, slots = _inputs(b, t, h, dv, dr, kk, seed=h)
    got = _check(q, kv, idx, qpos, slots, dv)
    if t > 1:
        assert got[0, 1].abs().max() == 0
    parts = min(split, -(-kk // 16))
    assert grids.seen["_fwd_kernel"] == [(b * t, 1, parts)]
    assert grids.seen["_combine_kernel"] == ([(b * t, 1, 1)] if parts > 1 else [])
    assert all(g == [(b * t, 1)] for n, g in grids.seen.items() if n.startswith("_bwd"))


def test_the_default_tiles_put_every_head_in_one_program():
    """GLM-5 (64 heads × 512 + 64): one head block of 64 in 8 warps (two warpgroups, each a [64, 256] half of the
    accumulator); 128 heads: two blocks; few heads: a block of at least 16 (a dot's least M)."""
    assert kmla._blocks(64, 512) == (64, 32, 8)
    assert kmla._blocks(128, 512)[0] == 64
    assert kmla._blocks(5, 16) == (16, 32, 4)
    assert kmla._blocks(20, 64)[0] == 32


def test_split_k_only_where_programs_are_few():
    """Decode at batch 1 (one program) at GLM-5's top-2048 splits into 32 parts of 64 slots; a 4,096-token prefill
    does not split; a batch of 64 decode rows splits in 5; the parts cover the selection."""
    assert kmla._parts(1, 2048, 32) == (32, 64)
    assert kmla._parts(4096, 2048, 32) == (1, 2048)
    ns, per = kmla._parts(64, 2048, 32)
    assert ns == 5 and per % 32 == 0 and (ns - 1) * per < 2048 <= ns * per
    assert kmla._parts(1, 20, 32) == (1, 32)


@pytest.mark.parametrize("split", [None, 2, 4])
def test_split_k_decode_at_batch_one_matches_the_twin(triton_mode, monkeypatch, split):
    """One query token a sequence (decode), K = 96 slots in 16-slot tiles: split by the default rule (few programs:
    as many parts as the tiles allow, two tiles each) or into 2 or 4 parts, merged by the log-sum-exp; the gradient
    (which reads the merged log-sum-exp) matches too. The second row's slots past position 40 are unusable: its
    later parts hold no usable key."""
    monkeypatch.setattr(kmla, "SPLIT", split)
    monkeypatch.setattr(kmla, "BLOCKS", (16, 16, 4))
    grids = _Grids(monkeypatch, "_fwd_kernel", "_combine_kernel")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, 48, generator=g, requires_grad=True)
    kv = torch.randn(2, 120, 48, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(120, generator=g)[:96].sort().values for _ in range(2)])[:, None]
    qpos = torch.tensor([[119], [40]])
    _check(q, kv, idx, qpos, torch.tensor([1, 0]), 32)
    parts = {None: 3, 2: 2, 4: 3}[split]  # 6 tiles: the default two a part; 4 asked → 2 tiles a part → 3 parts
    assert grids.seen["_fwd_kernel"] == [(2, 1, parts)] and grids.seen["_combine_kernel"] == [(2, 1, 1)]


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's max of a NaN head
@pytest.mark.parametrize("split", [1, 3])
def test_nan_in_a_used_row_or_a_query_head_propagates_through_the_split(triton_mode, monkeypatch, split):
    """As tests/kernels/test_twins_agree.py, over several parts: a used row with a NaN makes every head NaN (the part
    holding it is NaN, and the merge keeps it); an unusable NaN row stays out; a NaN query head is NaN alone."""
    monkeypatch.setattr(kmla, "SPLIT", split)
    monkeypatch.setattr(kmla, "BLOCKS", (16, 16, 4))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 3, 3, 32, generator=g)
    kv = torch.randn(1, 60, 32, generator=g)
    idx = torch.stack([torch.randperm(59, generator=g)[:40] for _ in range(3)])[None]
    kv[0, 59, 3] = float("nan")
    idx[0, :2, 33] = 59  # in the third part
    qpos = torch.tensor([[59, 50, 59]])
    q[0, 2, 1, 5] = float("nan")
    got = kernels.sparse_mla(q, kv, idx, qpos, 0.3, 16)
    want = kmla.sparse_mla_reference(q, kv, idx, qpos, 0.3, 16)
    assert got[0, 0].isnan().all() and got[0, 2, 1].isnan().all()
    assert not got[0, 1].isnan().any() and not got[0, 2, [0, 2]].isnan().any()
    torch.testing.assert_close(got[0, 1], want[0, 1], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got[0, 2, [0, 2]], want[0, 2, [0, 2]], atol=2e-5, rtol=1e-5)


@pytest.fixture
def atomics(monkeypatch):
    """Counts the elements the interpreter's atomic adds write (their mask), kernel by kernel run."""
    from triton.runtime import interpreter

    seen = []
    real = interpreter.InterpreterBuilder.create_atomic_rmw

    def count(self, rmw_op, ptr, val, mask, sem, scope):
        seen.append(int(mask.data.sum()))
        return real(self, rmw_op, ptr, val, mask, sem, scope)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_atomic_rmw", count)
    return seen


@pytest.mark.parametrize("h, blocks", [(33, None), (33, (16, 16, 4))])
def test_dkv_atomics_are_one_row_per_usable_slot_and_head_block(triton_mode, monkeypatch, atomics, h, blocks):
    """The backward's fp32 atomic adds, counted as the interpreter runs them: DV + DR per usable (token, slot) pair
    with every head in one program; a head block of 16 (bench/gpu.py's sweep) issues one row per block (3× at 33
    heads). `dkv_atomics` predicts both."""
    monkeypatch.setattr(kmla, "BLOCKS", blocks)
    q, kv, idx, qpos, slots = _inputs(2, 3, h, 16, 16, 20, seed=1)
    o = kernels.sparse_mla(q, kv, idx, qpos, 0.3, 16, slots)
    assert atomics == []  # the forward adds nothing
    torch.autograd.grad(o.sum(), (q, kv))
    pairs = int(kmla._valid(idx, qpos).sum())
    blocks_ = 1 if blocks is None else 3
    assert sum(atomics) == pairs * blocks_ * 32 == kmla.dkv_atomics(idx, qpos, h, 16, 16)


def test_dkv_atomics_at_glm5_shapes():
    """T 4,096, 64 heads, top-2048, every slot usable: 2048·576 = 1.18 M a token (4.83 G a call); the former head
    block of 16 issued four times as many (4.72 M a token, the figure issue 41 quotes)."""
    t, k = 4096, 2048
    idx = torch.arange(k).expand(1, t, k)
    qpos = torch.full((1, t), k)
    assert kmla.dkv_atomics(idx, qpos, 64, 512, 64) == t * k * 576 == 4_831_838_208
    assert kmla.dkv_atomics(idx, qpos, 64, 512, 64, bh=16) == 4 * t * k * 576
