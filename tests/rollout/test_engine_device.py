"""The engine on the model's device (checked on the CPU), batched on-device sampling, CUDA-graph fallback, the serve
flags, and session prefix reuse under load."""

import logging
import sys
from pathlib import Path

import pytest
import torch
from engine_helpers import PROMPTS, full_forward_greedy
from engine_helpers import run_all as _run

from rollout.engine import DecodeGraphs, Engine, GenRequest
from rollout.sampling import SamplingParams, filtered_logits, sample

ENGINE_FILES = {str(Path(__file__).parents[2] / "rollout" / f) for f in ("engine.py", "sampling.py")}


def _mixed(i: int, n: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=[0, 0.7, 1.0, 1.3][i % 4], top_k=[-1, 3, 20][i % 3],
                          top_p=[1.0, 0.8][i % 2], min_p=[0.0, 0.05][(i // 2) % 2], min_new_tokens=i % 3,
                          stop_token_ids=[i + 1], sampling_seed=100 + i)


def _workload(eng, spec: bool = False) -> list:
    """Seeded sampling, a session's second turn, input log-probs, a flush mid-prefill and a pure-scoring request."""
    reqs = _run(eng, [GenRequest(p, _mixed(i), return_logprob=i == 2, session_id="s" if i == 0 else None)
                      for i, p in enumerate(PROMPTS)])
    t1 = reqs[0]
    [t2] = _run(eng, [GenRequest(t1.input_ids + t1.output_ids + [3, 4], _mixed(5), session_id="s")])
    long = GenRequest(PROMPTS[0] + PROMPTS[2], _mixed(6, 4), return_logprob=True, logprob_start_len=0)
    eng.submit(long)
    eng.step()
    eng.flush_cache()
    while not long.future.done():
        eng.step()
    score = eng.submit(GenRequest(PROMPTS[2], SamplingParams(max_new_tokens=0), return_logprob=True,
                                  logprob_start_len=0)).future.result()
    return [(r.output_ids, r.output_logprobs, r.input_logprobs) for r in [*reqs, t2, long, score]]


@pytest.mark.parametrize("spec", [0, 2])
def test_every_engine_tensor_is_made_on_the_models_device(micro_model, spec):
    """With the default device set to `meta`, a tensor the engine created without naming the model's device would be a
    meta tensor and the step would fail: the same workload runs unchanged, and the cache, the per-step inputs of the
    forward and the seeded generators are on the model's device."""
    want = _workload(Engine(micro_model, n_slots=3, max_len=96, chunk_size=6, start=False, spec_drafts=spec))
    seen = []
    with torch.device("meta"):
        eng = Engine(micro_model, n_slots=3, max_len=96, chunk_size=6, start=False, spec_drafts=spec)
        run = eng.model.run

        def spy(ids, **kw):
            seen.append([ids.device] + [v.device for v in kw.values() if isinstance(v, torch.Tensor)])
            with torch.device("cpu"):  # the model's own code is not under test here
                return run(ids, **kw)

        eng.model.run = spy
        try:
            got = _workload(eng)
            seeded = eng.submit(GenRequest(PROMPTS[1], _mixed(1, 2)))
        finally:
            del eng.model.run
    dev = next(micro_model.parameters()).device
    assert got == want
    assert seen and all(d == dev for row in seen for d in row)
    assert {t.device for t in [*eng.cache.kv, eng.cache.lengths, eng.cache.mtp_lengths]} == {dev}
    assert seeded.gen.device == dev


def test_a_bfloat16_model_gets_a_bfloat16_latent_cache(micro_model):
    m = type(micro_model)(micro_model.config)
    m.load_state_dict(micro_model.state_dict())
    m = m.to(torch.bfloat16).eval()
    eng = Engine(m, n_slots=2, max_len=64, start=False, spec_drafts=1)
    assert all(t.dtype == torch.bfloat16 for t in eng.cache.kv) and eng._hidden[0].dtype == torch.bfloat16
    [r] = _run(eng, [GenRequest(PROMPTS[0], _mixed(1, 6), return_logprob=True)])
    assert len(r.output_ids) >= 1 and all(lp <= 0 for lp in r.output_logprobs)


def test_batched_sampling_draws_what_the_row_sampler_drew():
    """`sample` over a batch = `torch.multinomial` per row with the row's own generator (the engine's former sampler),
    for mixed parameters, ties and bf16 logits, step after step; greedy rows leave their generator untouched."""
    for s in range(40):
        torch.manual_seed(s)
        v, b = [6, 257, 1000][s % 3], 1 + s % 6
        logits = (torch.randn(b, v) * (1 + s % 4)).to(torch.bfloat16 if s % 2 else torch.float32)
        if s % 5 == 0:
            logits[:, : v // 3] = logits[:, :1]
        ps = [_mixed(s + i) for i in range(b)]
        g_ref = [torch.Generator().manual_seed(p.sampling_seed) for p in ps]
        g_new = [torch.Generator().manual_seed(p.sampling_seed) for p in ps]
        for _ in range(3):
            want = [int(logits[i].argmax()) if p.greedy else
                    int(torch.multinomial(filtered_logits(logits[i], p).softmax(-1), 1, generator=g_ref[i]))
                    for i, p in enumerate(ps)]
            assert sample(logits, ps, g_new).tolist() == want
        assert all(torch.equal(a.get_state(), c.get_state()) for a, c in zip(g_ref, g_new))


def test_one_host_transfer_per_decode_step(micro_model, monkeypatch):
    """Token ids and log-probs of the whole batch cross to the host at once: engine code reads tensors on the host once
    per decode step, whatever the batch size (before: an int() and a float() per request)."""
    reads = []

    def counting(name):
        orig = getattr(torch.Tensor, name)

        def f(self, *a, **kw):
            if sys._getframe(1).f_code.co_filename in ENGINE_FILES:
                reads.append(name)
            return orig(self, *a, **kw)
        return f

    for name in ["tolist", "item", "__int__", "__float__", "__bool__", "cpu", "numpy", "__index__"]:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    eng = Engine(micro_model, n_slots=4, max_len=96, start=False)
    reqs = [GenRequest(p, _mixed(i, 8)) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        eng.submit(r)
    eng.step()  # prefill (one chunk holds all four prompts): the first tokens
    assert len(reads) == 1
    for _ in range(3):
        reads.clear()
        eng.step()
        assert reads == ["tolist"] and all(len(r.output_ids) > 1 for r in reqs if r.finish is None)


def test_cuda_graphs_stay_off_the_cpu_and_fall_back_loudly(micro_model, caplog):
    want = [r.output_ids for r in _run(Engine(micro_model, n_slots=3, max_len=96, start=False),
                                       [GenRequest(p, _mixed(i)) for i, p in enumerate(PROMPTS)])]
    eng = Engine(micro_model, n_slots=3, max_len=96, start=False, cuda_graphs=True)
    assert eng.graphs is None and eng.cache.n_slots == 3 and eng.stats.cuda_graphs == "off"
    assert [r.output_ids for r in _run(eng, [GenRequest(p, _mixed(i)) for i, p in enumerate(PROMPTS)])] == want
    # a forward that cannot be captured (here: no CUDA at all) turns graphs off with a warning, never a failed step
    eng = Engine(micro_model, n_slots=3, max_len=96, start=False)
    eng.graphs = DecodeGraphs(eng.model, eng.cache, eng.n_slots, eng.stats)
    assert eng.graphs.buckets == [1, 2, 4] and eng.stats.cuda_graphs == "on"
    with caplog.at_level(logging.WARNING, logger="rollout.engine"):
        got = [r.output_ids for r in _run(eng, [GenRequest(p, _mixed(i)) for i, p in enumerate(PROMPTS)])]
    assert got == want and eng.stats.cuda_graphs.startswith("fallback: ") and eng.stats.graph_replays == 0
    assert "CUDA graphs off" in caplog.text


def test_a_key_bound_gives_the_exact_forwards_outputs(micro_model):
    """`run(n_keys=…)` (the sync-free forward CUDA graphs capture) equals the forward that reads the key count from
    the device: contiguous and scattered slots, bounds at the true count and far above it, the indexer's top-k (8)
    taken or not."""
    from model.cache import KVCache

    cfg = micro_model.config

    def filled(lens):
        c = KVCache(cfg, 4, 64)
        with torch.no_grad():
            for s, n in enumerate(lens):
                micro_model.run(torch.arange(1, n + 1)[None] * (s + 3) % 250, cache=c, slots=torch.tensor([s]))
        return c

    ids = torch.tensor([[7], [11], [13], [17]])
    for lens, slots, bound in [([5, 6, 3, 2], [0, 1, 2], 7), ([5, 6, 3, 2], [2, 0, 3], 64), ([20, 9, 30, 2], [1, 3], 31),
                               ([20, 9, 30, 2], [3, 2, 1, 0], 64), ([20, 9, 30, 2], [2], 31)]:
        exact, bounded = filled(lens), filled(lens)
        b = len(slots)
        with torch.no_grad():
            want = micro_model.run(ids[:b], cache=exact, slots=torch.tensor(slots)).logits
            got = micro_model.run(ids[:b], cache=bounded, slots=torch.tensor(slots), n_keys=bound).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(bounded.lengths, exact.lengths)
    with pytest.raises(ValueError, match="n_keys must lie in"):
        micro_model.run(ids[:1], cache=filled([2, 2, 2, 2]), slots=torch.tensor([0]), n_keys=65)


def test_the_graph_step_reads_nothing_back(micro_model):
    """No op that makes CUDA wait for the host (a scalar read, nonzero, a boolean-mask index, bincount,
    repeat_interleave by tensor, a tensor made from Python data, a 0-dim host scalar copied in: what `t[i] = 0` does
    on a CUDA tensor) runs in the model's or the engine's code during the step DecodeGraphs captures: the ops are seen
    on the CPU through a dispatch mode. (The torch reference kernels may sync; on CUDA the Triton kernels run
    instead.) On the H200, `lengths[pad] = 0` in that step kept every capture from happening."""
    from torch.utils._python_dispatch import TorchDispatchMode


    roots = [str(Path(__file__).parents[2] / "model"), str(Path(__file__).parents[2] / "rollout" / "engine.py")]
    syncing = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "lift_fresh", "unique_consecutive",
               "_unique2", "is_nonzero", "equal"}
    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            bool_index = name in ("index", "index_put", "index_put_") and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in (args[1] or []))
            by_tensor = name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) > 1 and \
                isinstance(args[1], torch.Tensor) and (kwargs or {}).get("output_size") is None
            scalar_in = name == "copy_" and isinstance(args[1], torch.Tensor) and args[1].dim() == 0
            if name in syncing or bool_index or by_tensor or scalar_in:
                import traceback

                stack = traceback.extract_stack()
                frames = [f for f in stack if f.filename.startswith(tuple(roots))]
                if frames and not any("temper_kernels" in f.filename and f.name.endswith("_reference") for f in stack):
                    seen.append((name, f"{frames[-1].filename}:{frames[-1].lineno}"))
            return func(*args, **(kwargs or {}))

    eng = Engine(micro_model, n_slots=4, max_len=64, start=False)
    graphs = DecodeGraphs(micro_model, eng.cache, 3, eng.stats)  # the cache's last slot is the padding slot
    c = eng.cache
    with torch.no_grad():
        for s, n in enumerate([20, 9, 30]):
            micro_model.run(torch.arange(1, n + 1)[None], cache=c, slots=torch.tensor([s]))
        ids, slots = torch.tensor([[3], [4], [5], [6]]), torch.tensor([2, 0, 1, graphs.pad])
        n_new = torch.ones(4, dtype=torch.long)
        with Watch():
            graphs.step(ids, slots, n_new, 32)
        assert seen == [] and c.lengths.tolist() == [21, 10, 31, 0]
        with Watch():  # the check can fail: the unbounded forward reads the key count and the slots back
            micro_model.run(ids, cache=c, slots=slots, n_new=n_new)
        assert any(name == "_local_scalar_dense" for name, _ in seen)
        seen.clear()
        roots.append(__file__)
        with Watch():  # and a host scalar written into a device tensor is seen (what the step did before)
            c.lengths[graphs.pad] = 0
        assert "copy_" in [name for name, _ in seen]


def test_the_sync_check_counts_this_threads_syncs_only(recwarn):
    """The capture warm-up's check: a sync warning from the decode step is found with its line; one another thread
    raises meanwhile (an in-process trainer's `.item()`) is not blamed on the step and still reaches the handler."""
    import threading
    import warnings

    from rollout.engine import SYNC_WARNING, syncs_in

    def other():
        warnings.warn(f"called a {SYNC_WARNING} (other thread)", UserWarning, stacklevel=1)

    def step():
        t = threading.Thread(target=other)
        t.start()
        t.join()
        warnings.warn(f"called a {SYNC_WARNING}", UserWarning, stacklevel=1)  # the line syncs_in reports
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)

    got = syncs_in(step)
    assert len(got) == 1 and got[0].startswith("test_engine_device.py:")
    assert [str(w.message) for w in recwarn] == [f"called a {SYNC_WARNING} (other thread)", "an unrelated warning"]
    assert syncs_in(lambda: None) == []


def test_key_buckets_cover_the_count_and_keep_the_dense_path(micro_model):
    """A key bucket is at least the count, at most the cache's max_len, and never crosses the indexer's top-k from
    below (a step with no more keys than the top-k stays dense, as eager decode is)."""
    from model.cache import KVCache

    topk = micro_model.config.index_topk  # 8 here: below MIN_KEYS
    g = DecodeGraphs(micro_model, KVCache(micro_model.config, 3, 200), 2, Engine(micro_model, start=False).stats)
    for n in range(1, 201):
        kb = g.key_bucket(n)
        assert n <= kb <= 200 and (kb <= topk if n <= topk else kb > topk), (n, kb)
    assert g.key_bucket(9) == 64 and g.key_bucket(65) == 128 and g.key_bucket(129) == 200 and g.key_bucket(3) == topk


def test_the_engine_bounds_the_keys_of_every_graph_step(micro_model):
    """The key count the engine hands DecodeGraphs (from its host-side bookkeeping) is never below a row's true
    count after the step, through session prefix reuse, stops and a flush: a stand-in for the graphs checks it on
    the cache and runs the bounded forward, and the tokens equal an eager engine's."""
    want = _workload(Engine(micro_model, n_slots=3, max_len=96, start=False))
    eng = Engine(micro_model, n_slots=3, max_len=96, start=False)
    calls = []

    class Bounded:
        def run(self, ids, slots, n_keys):
            true = int((eng.cache.lengths[slots] + 1).max())
            calls.append((n_keys, true))
            return eng.model.run(ids, cache=eng.cache, slots=slots, n_new=torch.ones_like(slots),
                                 n_keys=min(n_keys, eng.cache.max_len)).logits

    eng.graphs = Bounded()
    got = _workload(eng)
    assert calls and all(n >= t for n, t in calls) and any(n == t for n, t in calls)
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_with_graphs_equals_eager(micro_model):
    m = type(micro_model)(micro_model.config)
    m.load_state_dict(micro_model.state_dict())
    m = m.cuda().eval()
    greedy = [GenRequest(p, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)) for p in PROMPTS]
    eager = Engine(m, n_slots=8, max_len=96, start=False)
    assert eager.cache.kv[0].is_cuda and eager.cache.lengths.is_cuda
    want = [r.output_ids for r in _run(eager, greedy)]
    eng = Engine(m, n_slots=8, max_len=96, start=False, cuda_graphs=True)
    got = [r.output_ids for r in _run(eng, [GenRequest(r.input_ids, r.params) for r in greedy])]
    assert got == want
    assert eng.stats.cuda_graphs == "on" and eng.stats.graph_replays > 0, eng.stats.cuda_graphs


# ---- temper serve --device / --dtype / --cuda-graphs ---------------------------------------------------------------
def test_serve_device_flags(monkeypatch, capsys):
    from pipelines.cli import main

    calls = []
    monkeypatch.setattr("rollout.server.serve", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["serve", "--checkpoint", "ck", "--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err and not calls
    assert main(["serve", "--checkpoint", "ck", "--cuda-graphs"]) == 2
    assert "--cuda-graphs" in capsys.readouterr().err and not calls
    assert main(["serve", "--checkpoint", "ck"]) == 0 and calls[-1]["device"] == "cpu" and calls[-1]["dtype"] is None
    assert main(["serve", "--checkpoint", "ck", "--device", "auto", "--dtype", "bfloat16"]) == 0
    assert calls[-1]["device"] == "cpu" and calls[-1]["dtype"] == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["serve", "--checkpoint", "ck", "--device", "auto", "--cuda-graphs"]) == 0
    assert calls[-1]["device"] == "cuda" and calls[-1]["cuda_graphs"] is True


def test_serve_loads_the_checkpoint_on_the_device_in_the_dtype(micro_model, tmp_path, monkeypatch):
    import uvicorn

    from model import save_checkpoint
    from rollout.server import serve

    save_checkpoint(micro_model, tmp_path / "ck", policy_version=3)
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    serve(str(tmp_path / "ck"), n_slots=2, max_len=64, device="cpu", dtype="bfloat16")
    eng = apps[0].state.engine
    try:
        assert eng.device == torch.device("cpu") and eng.version == 3
        assert eng.model.embed_tokens.weight.dtype == torch.bfloat16 and eng.cache.kv[0].dtype == torch.bfloat16
    finally:
        eng.shutdown()


# ---- session prefix reuse under load -------------------------------------------------------------------------------
def _episodes(eng, n_sessions: int, turns: int, think: int = 0) -> list[GenRequest]:
    """`n_sessions` agent episodes started at once; each next turn (the context so far + 3 observation tokens) is
    submitted `think` scheduler steps after the previous turn finished (0: before the next step)."""
    sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    live = {s: eng.submit(GenRequest(PROMPTS[s % 4] + [s + 1], sp, session_id=f"ep{s}")) for s in range(n_sessions)}
    left, due, done, k = dict.fromkeys(live, turns - 1), [], [], 0
    while live or due:
        eng.step()
        k += 1
        for s, r in list(live.items()):
            if r.future.done():
                done.append(live.pop(s))
                if left[s]:
                    left[s] -= 1
                    due.append((k + think, s, r.input_ids + r.output_ids + [7, 8, 9]))
        for d in [d for d in due if d[0] <= k]:
            due.remove(d)
            live[d[1]] = eng.submit(GenRequest(d[2], sp, session_id=f"ep{d[1]}"))
    return done


def test_session_reuse_holds_with_more_sessions_than_slots(micro_model):
    """6 episodes of 5 turns on 2 slots, each next turn queued as soon as the last one ends. The old policy let a
    waiting newcomer evict the session that had just finished — the one whose next turn was queued — and reuse fell
    to 0.0; now a returning turn is admitted first and all but the first turn of each episode reuse their prefix."""
    eng = Engine(micro_model, n_slots=2, max_len=160, start=False)
    done = _episodes(eng, 6, 5)
    assert eng.stats.prefix_reuse > 0.7  # the ceiling here is 0.784; the old policy: 0.0
    assert sum(r.reused > 0 for r in done) == 6 * 4
    for r in done[-3:]:
        assert r.output_ids == full_forward_greedy(micro_model, r.input_ids, 4)


def test_session_grace_keeps_the_slot_while_the_client_thinks(micro_model):
    """A next turn arriving 3 steps after the last one ended (the environment's step): within `session_grace` the idle
    session is not evicted by waiting newcomers; with no grace the prefix is lost every time (the old behaviour)."""
    eng = Engine(micro_model, n_slots=2, max_len=160, start=False, session_grace=2.0)
    _episodes(eng, 4, 5, think=3)
    assert eng.stats.prefix_reuse > 0.7
    eng = Engine(micro_model, n_slots=2, max_len=160, start=False, session_grace=0.0)
    _episodes(eng, 4, 5, think=3)
    assert eng.stats.prefix_reuse < 0.1


def test_speculative_verify_is_one_forward_for_the_whole_batch(mtp_model, monkeypatch):
    """Several requests of different prompt and output lengths decode concurrently with spec_drafts=3 (rows near
    max_new_tokens or max_len get fewer drafts, or none): the output is the plain engine's greedy output, and every
    decode step runs ONE main-model forward for the whole batch (drafts verified together, ragged), where the former
    per-request speculation ran one per request."""
    model, prompts = mtp_model
    prompts = [prompts[i % len(prompts)][: 6 + 5 * i] for i in range(5)]
    news = [7, 30, 12, 25, 19]
    greedy = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in news]
    max_len = max(len(p) + n for p, n in zip(prompts, news))  # the longest row runs into max_len
    want = [r.output_ids for r in _run(Engine(model, n_slots=5, max_len=max_len, start=False),
                                       [GenRequest(p, sp) for p, sp in zip(prompts, greedy)])]
    eng = Engine(model, n_slots=5, max_len=max_len, start=False, spec_drafts=3)
    calls = []
    run = model.run
    monkeypatch.setattr(model, "run", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    reqs = [eng.submit(GenRequest(p, sp)) for p, sp in zip(prompts, greedy)]
    eng.step()  # prefill: every prompt in one chunk, the first tokens
    assert len(calls) == 1 and all(len(r.output_ids) == 1 for r in reqs)
    per_step, batch = [], []
    while any(not r.future.done() for r in reqs):
        calls.clear()
        batch.append(len(eng.running))
        eng.step()
        per_step.append(len(calls))
    assert [r.output_ids for r in reqs] == want
    assert max(batch) == 5 and per_step == [1] * len(per_step)  # the per-request code: one per running request
    assert eng.stats.accept_length > 1.5  # drafts really were accepted
