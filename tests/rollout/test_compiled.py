"""The engine's compiled decode step (rollout/compiled.py) against the eager engine and the trainers' own forward."""

from pathlib import Path

import pytest
import torch
from engine_helpers import run_all

from model import load_checkpoint, token_logprobs
from rollout.engine import Engine, GenRequest
from rollout.sampling import SamplingParams
from temper_kernels.moe import DENSE_ROWS, moe_experts_dense, moe_experts_reference

ROOT = Path(__file__).resolve().parents[2]
# prompts of the ladder's lengths; 70 new tokens take every row past the indexer's top-k (64): both compiled variants
PROMPTS = [list(range(40, 70)), [5, 6, 7], list(range(100, 141)), [200, 201, 202, 203, 204]]


@pytest.fixture(scope="module")
def base():
    return load_checkpoint(ROOT / "checkpoints/tiny-base")


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("n", [6, DENSE_ROWS + 8])
def test_dense_moe_is_the_loop_over_experts(n):
    """moe_experts_dense (what a compiled step and every call of at most DENSE_ROWS tokens run) and the reference's
    loop (longer calls) are both the sum by hand: every expert over every token with exact zeros off the selection.
    A weight on the wrong expert, a dropped routing weight or a missing SwiGLU factor moves the result by O(1)."""
    g = torch.Generator().manual_seed(0)
    h, i, e, k = 16, 8, 8, 2
    x = torch.randn(n, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    idx = torch.rand(n, e, generator=g).topk(k, -1).indices
    w = torch.rand(n, k, generator=g)
    by_hand = torch.zeros(n, h)
    for t in range(n):
        for j in range(k):
            gg, uu = (gate_up[idx[t, j]] @ x[t]).chunk(2)
            by_hand[t] += w[t, j] * (down[idx[t, j]] @ (torch.nn.functional.silu(gg) * uu))
    torch.testing.assert_close(moe_experts_dense(x, idx, w, gate_up, down), by_hand, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(moe_experts_reference(x, idx, w, gate_up, down), by_hand, rtol=1e-5, atol=1e-4)


def test_compiled_decode_is_the_eager_engine(base):
    """Greedy decoding through the compiled step gives the eager engine's tokens, for a batch of four prompts of
    different lengths and for a request alone (padded to two rows with the spare slot, which must touch no real slot),
    on both sides of the indexer's top-k (the dense and the selected variants); each step's log-prob of its token is
    the eager one's up to the GEMMs' rounding. The step really ran compiled."""
    eager = run_all(Engine(base, n_slots=4, max_len=160, start=False), [GenRequest(p, _greedy(70)) for p in PROMPTS])
    eng = Engine(base, n_slots=4, max_len=160, start=False, compile_decode=True)
    got = run_all(eng, [GenRequest(p, _greedy(70)) for p in PROMPTS])
    alone = run_all(eng, [GenRequest(PROMPTS[1], _greedy(70))])[0]
    assert eng.stats.compiled == "on" and eng.stats.compiled_steps >= 2 * 69, eng.stats
    assert [r.output_ids for r in got] == [r.output_ids for r in eager]
    assert alone.output_ids == eager[1].output_ids
    for r, e in zip(got, eager):
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, e.output_logprobs)) < 1e-4
    assert eng.cache.lengths[eng.cache.n_slots - 1] == 0  # the spare slot forgets its padding row


def test_compiled_engine_scores_with_the_trainers_function(base):
    """What a rollout records comes from the engine's scoring forward, not from the compiled step: a sampled
    continuation, scored as the agent rescores a finished segment, carries exactly the trainers' log-probs
    (`token_logprobs`, mismatch 0), though its tokens were chosen by the compiled step."""
    eng = Engine(base, n_slots=2, max_len=160, start=False, compile_decode=True)
    sp = SamplingParams(max_new_tokens=40, temperature=1.0, ignore_eos=True, sampling_seed=3)
    r = run_all(eng, [GenRequest(PROMPTS[0], sp)])[0]
    seq = r.input_ids + r.output_ids
    s = run_all(eng, [GenRequest(seq, SamplingParams(max_new_tokens=0), return_logprob=True, logprob_start_len=0)])[0]
    assert eng.stats.compiled == "on" and eng.stats.compiled_steps > 0
    want, _ = token_logprobs(base, torch.tensor([seq]))
    assert s.input_logprobs[1:] == want[0, 1:].tolist()
