"""The embedded engine against the model's own full forward (the reference)."""

import threading
import time

import pytest
import torch
from engine_helpers import PROMPTS, full_forward_greedy
from engine_helpers import run_all as _run

from model.generate import generate
from rollout.engine import Engine, EngineError, GenRequest, QueueFull
from rollout.sampling import SamplingParams


def _greedy(n=24, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("spec", [0, 3])
def test_greedy_equals_full_forward_argmax(micro_model, spec):
    eng = Engine(micro_model, n_slots=4, max_len=96, chunk_size=8, start=False, spec_drafts=spec)
    reqs = _run(eng, [GenRequest(p, _greedy()) for p in PROMPTS])
    for r, p in zip(reqs, PROMPTS):
        assert r.output_ids == full_forward_greedy(micro_model, p, 24)
    if spec:
        assert eng.stats.spec_verifies > 0


def test_speculative_greedy_with_accepted_drafts(mtp_model):
    """With a model trained with the MTP loss most drafts are accepted; output stays the target's argmax."""
    model, prompts = mtp_model
    eng = Engine(model, n_slots=4, max_len=160, start=False, spec_drafts=4)
    reqs = _run(eng, [GenRequest(p, _greedy(40)) for p in prompts])
    for r, p in zip(reqs, prompts):
        assert r.output_ids == full_forward_greedy(model, p, 40)
    assert eng.stats.accept_length > 1.5  # drafts really were accepted, several per verify
    r = reqs[0]
    ids = torch.tensor([r.input_ids + r.output_ids])
    with torch.no_grad():
        lp = model(ids).log_softmax(-1)[0]
    n = len(r.input_ids)
    assert max(abs(a - float(lp[n - 1 + i, t])) for i, (a, t) in enumerate(zip(r.output_logprobs, r.output_ids))) < 1e-5


def test_speculative_sampling_keeps_the_distribution():
    """Rejection sampling is exact: the joint law of generated tokens matches the target model's."""
    from scipy.stats import chisquare

    from model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=6, hidden_size=32, num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=64,
                      num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                      n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, use_dsa=False,
                      initializer_range=0.5, num_nextn_predict_layers=1, eos_token_id=None)
    torch.manual_seed(1)
    model = Transformer(cfg).eval()
    prompt = [1, 2]
    with torch.no_grad():
        p1 = model(torch.tensor([prompt]))[0, -1].softmax(-1)
        joint = torch.zeros(6, 6)  # exact law of (t2, t3), summed over t1
        for t1 in range(6):
            p2 = model(torch.tensor([prompt + [t1]]))[0, -1].softmax(-1)
            for t2 in range(6):
                p3 = model(torch.tensor([prompt + [t1, t2]]))[0, -1].softmax(-1)
                joint[t2] += p1[t1] * p2[t2] * p3
    eng = Engine(model, n_slots=64, max_len=16, start=False, spec_drafts=2, max_queue=4000)
    n = 3000
    reqs = _run(eng, [GenRequest(prompt, SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=i,
                                                        ignore_eos=True)) for i in range(n)])
    counts = torch.zeros(6, 6)
    for r in reqs:
        counts[r.output_ids[1], r.output_ids[2]] += 1
    accepted = sum(r.spec_accepted for r in reqs)
    assert 0.1 * n < accepted < 1.9 * n  # both the accept and the reject branch are exercised
    stat = chisquare(counts.flatten().numpy(), (joint.flatten() * n).numpy())
    assert stat.pvalue > 1e-3, stat


def test_logprobs_equal_the_models(micro_model):
    eng = Engine(micro_model, n_slots=2, max_len=96, chunk_size=5, start=False)
    [r] = _run(eng, [GenRequest(PROMPTS[2], SamplingParams(max_new_tokens=12, temperature=0.8, sampling_seed=3),
                                return_logprob=True)])
    ids = torch.tensor([r.input_ids + r.output_ids])
    with torch.no_grad():
        lp = micro_model(ids).log_softmax(-1)[0]
    n = len(r.input_ids)
    want_out = [float(lp[n - 1 + i, t]) for i, t in enumerate(r.output_ids)]
    want_in = [None] + [float(lp[i - 1, r.input_ids[i]]) for i in range(1, n)]
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, want_out)) <= 1e-5
    assert r.input_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(r.input_logprobs[1:], want_in[1:])) <= 1e-5


def test_continuous_batching_equals_one_at_a_time(micro_model):
    params = [SamplingParams(max_new_tokens=6 + 5 * i, temperature=0.9, top_k=20, sampling_seed=i) for i in range(4)]
    alone = []
    for p, sp in zip(PROMPTS, params):
        eng = Engine(micro_model, n_slots=1, max_len=96, start=False)
        alone.append(_run(eng, [GenRequest(p, sp.model_copy())])[0].output_ids)
    eng = Engine(micro_model, n_slots=2, max_len=96, chunk_size=7, start=False)  # fewer slots than requests
    reqs = [GenRequest(p, sp.model_copy()) for p, sp in zip(PROMPTS, params)]
    eng.submit(reqs[0])
    eng.step()
    eng.step()  # the others join while the first is already decoding
    together = _run(eng, reqs[1:])
    while not reqs[0].future.done():
        eng.step()
    assert [r.output_ids for r in [reqs[0], *together]] == alone
    assert eng.stats.generated_tokens == sum(len(a) for a in alone)


def test_reference_generate_matches(micro_model):
    eng = Engine(micro_model, n_slots=4, max_len=96, start=False)
    reqs = _run(eng, [GenRequest(p, _greedy(10)) for p in PROMPTS])
    assert [r.output_ids for r in reqs] == generate(micro_model, PROMPTS, 10)


def test_stops_and_limits(micro_model):
    eng = Engine(micro_model, n_slots=2, max_len=96, start=False)
    free = _run(eng, [GenRequest(PROMPTS[0], _greedy(20))])[0].output_ids
    tok = free[5]
    [r] = _run(eng, [GenRequest(PROMPTS[0], _greedy(20, stop_token_ids=[tok]))])
    assert r.output_ids == free[: free.index(tok) + 1] and r.finish == {"type": "stop", "matched": tok}
    text = eng.tok.decode(free[3:5])
    [r] = _run(eng, [GenRequest(PROMPTS[0], _greedy(20, stop=[text]))])
    assert r.finish["type"] == "stop" and r.finish["matched"] == text and len(r.output_ids) <= 5
    [r] = _run(eng, [GenRequest(PROMPTS[0], _greedy(20, min_new_tokens=8, stop_token_ids=[free[0]]))])
    assert len(r.output_ids) >= 8
    [r] = _run(eng, [GenRequest(PROMPTS[0], _greedy(7))])
    assert r.finish == {"type": "length", "length": 7}
    [r] = _run(eng, [GenRequest(PROMPTS[0], _greedy(0), return_logprob=True)])
    assert r.output_ids == [] and len(r.input_logprobs) == len(PROMPTS[0])
    with pytest.raises(EngineError, match="exceeds the context length"):
        eng.submit(GenRequest(list(range(90)), _greedy(20)))
    with pytest.raises(EngineError, match="out of range"):
        eng.submit(GenRequest([10**6], _greedy(2)))


def test_per_request_seed_is_reproducible(micro_model):
    eng = Engine(micro_model, n_slots=2, max_len=96, start=False)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, sampling_seed=7)
    a = _run(eng, [GenRequest(PROMPTS[1], sp.model_copy())])[0].output_ids
    b = _run(eng, [GenRequest(PROMPTS[1], sp.model_copy())])[0].output_ids
    c = _run(eng, [GenRequest(PROMPTS[1], sp.model_copy(update={"sampling_seed": 8}))])[0].output_ids
    assert a == b and a != c


def test_session_prefix_reuse(micro_model):
    eng = Engine(micro_model, n_slots=2, max_len=96, start=False)
    [t1] = _run(eng, [GenRequest(PROMPTS[2], _greedy(6), session_id="ep")])
    turn2 = t1.input_ids + t1.output_ids + [3, 4, 5]
    [t2] = _run(eng, [GenRequest(turn2, _greedy(6), session_id="ep")])
    assert t2.reused == len(t1.input_ids) + len(t1.output_ids) - 1  # the last sampled token was never fed
    assert t2.output_ids == full_forward_greedy(micro_model, turn2, 6)
    [t3] = _run(eng, [GenRequest(PROMPTS[2][:5] + [9, 9], _greedy(4), session_id="ep")])  # diverges early
    assert t3.reused == 5 and t3.output_ids == full_forward_greedy(micro_model, PROMPTS[2][:5] + [9, 9], 4)


def test_abort_pause_resume_and_queue_bound(micro_model):
    eng = Engine(micro_model, n_slots=1, max_len=96, max_queue=2)
    try:
        eng.pause()
        a = eng.submit(GenRequest(PROMPTS[0], _greedy(50)))
        b = eng.submit(GenRequest(PROMPTS[1], _greedy(5)))
        with pytest.raises(QueueFull):
            eng.submit(GenRequest(PROMPTS[2], _greedy(5)))
        time.sleep(0.1)
        assert not a.future.done() and eng.load()["paused"]
        assert eng.abort(a.rid) == 1
        assert a.future.result(5).finish["type"] == "abort"
        eng.resume()
        assert b.future.result(10).finish["type"] == "length"
    finally:
        eng.shutdown()


def test_weight_update_bumps_the_version_on_later_tokens(micro_model, tmp_path):
    from model import Transformer, save_checkpoint

    other = Transformer(micro_model.config)
    save_checkpoint(other, tmp_path / "ck", policy_version=5)
    m = Transformer(micro_model.config)
    m.load_state_dict(micro_model.state_dict())
    eng = Engine(m, n_slots=2, max_len=96, start=False)
    r = eng.submit(GenRequest(PROMPTS[0], _greedy(12)))
    for _ in range(5):
        eng.step()
    res = eng.update_weights(path=tmp_path / "ck")
    assert res["success"] and eng.version == 5 and res["num_paused_requests"] == 1
    while not r.future.done():
        eng.step()
    assert r.output_versions[0] == 0 and r.output_versions[-1] == 5 and len(r.output_ids) == 12
    [after] = _run(eng, [GenRequest(PROMPTS[1], _greedy(6))])
    assert after.output_ids == full_forward_greedy(other.eval(), PROMPTS[1], 6)
    eng.update_weights(state_dict=micro_model.state_dict(), version=9, flush_cache=True)
    [back] = _run(eng, [GenRequest(PROMPTS[1], _greedy(6))])
    assert back.output_versions == [9] * 6 and back.output_ids == full_forward_greedy(micro_model, PROMPTS[1], 6)
    with pytest.raises(EngineError, match="do not match"):
        eng.update_weights(state_dict={"x": torch.zeros(1)})


def test_engine_thread_serves_concurrent_callers(micro_model):
    eng = Engine(micro_model, n_slots=3, max_len=96)
    try:
        out = {}

        def call(i):
            out[i] = eng.generate(PROMPTS[i % 4], params=_greedy(8)).output_ids

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(out[i] == full_forward_greedy(micro_model, PROMPTS[i % 4], 8) for i in range(6))
    finally:
        eng.shutdown()


def test_min_new_tokens_holds_with_mtp_speculation(micro_model):
    """With MTP drafts, a stop token is neither drafted into nor accepted before `min_new_tokens`: the output
    equals plain decoding's, token for token, and the engine speculates again after the minimum."""
    free = _run(Engine(micro_model, n_slots=2, max_len=96, start=False), [GenRequest(PROMPTS[0], _greedy(20))])[0]
    stop = free.output_ids[1]  # greedy decoding wants it at position 1
    want = _run(Engine(micro_model, n_slots=2, max_len=96, start=False),
                [GenRequest(PROMPTS[0], _greedy(20, min_new_tokens=8, stop_token_ids=[stop]))])[0]
    spec = Engine(micro_model, n_slots=2, max_len=96, start=False, spec_drafts=3)
    got = _run(spec, [GenRequest(PROMPTS[0], _greedy(20, min_new_tokens=8, stop_token_ids=[stop]))])[0]
    assert len(got.output_ids) >= 8 and stop not in got.output_ids[:7]
    assert got.output_ids == want.output_ids and got.finish == want.finish
    assert spec.stats.spec_verifies > 0 or len(got.output_ids) <= 9


def _ref_input_logprobs(model, ids) -> list:
    with torch.no_grad():
        lp = model(torch.tensor([ids])).float().log_softmax(-1)[0]
    return [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _close(got, ref, start=0):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        if i >= start and b is not None:
            assert a is not None and abs(a - b) < 1e-4, (i, a, b)


def test_input_logprobs_stay_aligned_under_prefix_reuse_flush_and_weight_updates(micro_model):
    """Input log-probs are stored by token position and checked against a full forward: after a session's prefix
    is reused (asked from token k, the engine reuses at most k-1 positions), after a flush in the middle of a
    chunked prefill (recomputed, never duplicated), and after a weight update without a flush (idle cached
    prefixes are dropped: the next turn is scored by the new weights)."""
    from model import Transformer

    m = Transformer(micro_model.config)
    m.load_state_dict(micro_model.state_dict())
    eng = Engine(m, n_slots=2, max_len=96, chunk_size=4, start=False)
    [t1] = _run(eng, [GenRequest(PROMPTS[2], _greedy(5), session_id="s")])
    turn2 = t1.input_ids + t1.output_ids + [3, 4, 5]
    k = len(t1.input_ids) + 2
    [t2] = _run(eng, [GenRequest(turn2, _greedy(3), session_id="s", return_logprob=True, logprob_start_len=k)])
    assert 0 < t2.reused <= k - 1
    _close(t2.input_logprobs, _ref_input_logprobs(m, turn2), start=k)
    # the default (-1): every position computed here is right and in its place; reused ones are None
    turn3 = turn2 + t2.output_ids + [7]
    [t3] = _run(eng, [GenRequest(turn3, _greedy(2), session_id="s", return_logprob=True)])
    n = t3.reused + 1  # token `reused` is predicted at position reused-1, inside the reused prefix
    assert t3.reused > 0 and t3.input_logprobs[:n] == [None] * n
    _close(t3.input_logprobs, _ref_input_logprobs(m, turn3), start=n)
    # a flush while a long prompt is half prefilled (chunks of 4): recomputed from the start, no duplicates
    long = PROMPTS[0] + PROMPTS[1] + PROMPTS[2]
    r = GenRequest(long, _greedy(2), return_logprob=True, logprob_start_len=0)
    eng.submit(r)
    eng.step()
    eng.step()
    assert 0 < r.cached < len(long)
    eng.flush_cache()
    while not r.future.done():
        eng.step()
    _close(r.future.result().input_logprobs, _ref_input_logprobs(m, long))
    # a weight update without a flush: the idle session's prefix was computed by the old weights and is dropped
    other = Transformer(micro_model.config)
    eng.update_weights(state_dict=other.state_dict(), version=2)
    turn4 = turn3 + [8, 9]
    [t4] = _run(eng, [GenRequest(turn4, _greedy(2), session_id="s", return_logprob=True)])
    assert t4.reused == 0
    _close(t4.input_logprobs, _ref_input_logprobs(other, turn4))


def test_a_weight_update_invalidates_the_rows_of_a_running_session(micro_model):
    """An update without a flush lands while a session's turn is decoding: the turn goes on with its context
    re-prefilled under the new weights, so its later tokens and the session's next turn (which reuses the slot's
    rows) have the log-probs a fresh engine on the new weights computes, never the old rows' (once off by 0.2)."""
    from model import Transformer

    m = Transformer(micro_model.config)
    m.load_state_dict(micro_model.state_dict())
    torch.manual_seed(11)
    other = Transformer(micro_model.config).eval()
    eng = Engine(m, n_slots=2, max_len=96, chunk_size=8, start=False)
    r1 = eng.submit(GenRequest(PROMPTS[2], _greedy(10), session_id="s", return_logprob=True))
    while len(r1.output_ids) < 4:
        eng.step()
    eng.update_weights(state_dict=other.state_dict(), version=1)  # no flush_cache
    while not r1.future.done():
        eng.step()
    k = r1.output_versions.count(0)
    assert k >= 4 and r1.output_versions == [0] * k + [1] * (10 - k)
    # after the update: what the new weights generate from the context as it stood
    assert r1.output_ids[k:] == full_forward_greedy(other, PROMPTS[2] + r1.output_ids[:k], 10 - k)
    turn2 = r1.input_ids + r1.output_ids + [3, 4, 5]
    [t2] = _run(eng, [GenRequest(turn2, _greedy(6), session_id="s", return_logprob=True)])
    fresh = Engine(other, n_slots=2, max_len=96, chunk_size=8, start=False)
    [ref] = _run(fresh, [GenRequest(turn2, _greedy(6), return_logprob=True, logprob_start_len=0)])
    assert t2.reused > 0 and t2.output_ids == ref.output_ids == full_forward_greedy(other, turn2, 6)
    _close(t2.output_logprobs, ref.output_logprobs)
    _close(t2.input_logprobs, _ref_input_logprobs(other, turn2), start=t2.reused + 1)
