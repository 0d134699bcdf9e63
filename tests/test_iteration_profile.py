"""bench/iteration_profile.py's attribution, against hand computations on a fake clock (no iteration runs, no wall-clock
speed matters): nested categories count once, in the innermost; context markers are transparent; each thread keeps
its own stack and is charged to the stage running when its segment began, in its own group (main, engine, workers);
the main thread's categories add up to the stage's wall time; the engine hooks count decode and prefill tokens."""

import importlib
import sys
import threading
import types
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def _bench(name: str):
    if BENCH not in sys.path:
        sys.path.append(BENCH)
    return importlib.import_module(name)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _at(clock: Clock, t: float, call, *args) -> None:
    clock.t = float(t)
    call(*args)


def _in_thread(name: str, work) -> None:
    """`work()` on a thread called `name`, to its end (the fake clock is set inside, so the order is fixed)."""
    th = threading.Thread(target=work, name=name)
    th.start()
    th.join()


@pytest.fixture
def prof():
    clock = Clock()
    p = _bench("profile_timers").Profiler(clock=clock)
    p.clock_ = clock
    return p


def test_nested_categories_count_once_in_the_innermost_and_main_adds_up_to_the_wall(prof):
    c = prof.clock_
    _at(c, 0, prof.begin)
    _at(c, 1, prof.stage_start, "s")
    _at(c, 2, prof.push, "A")
    _at(c, 3, prof.push, "B")
    _at(c, 5, prof.pop)          # B: 3-5
    _at(c, 6, prof.push, "@ctx")  # a marker: its own time is A's
    _at(c, 7, prof.push, "C")
    _at(c, 8, prof.pop)          # C: 7-8
    _at(c, 9, prof.pop)
    _at(c, 10, prof.pop)         # A: 2-3, 5-7, 8-10
    _at(c, 12, prof.stage_end, "s")
    _at(c, 13, prof.end)
    rep = prof.report()
    s = rep["stages"]["s"]
    assert s["wall"] == 11.0 and rep["wall"] == 13.0
    assert s["main"] == {"A": 5.0, "B": 2.0, "C": 1.0, "other": 3.0}
    assert sum(s["main"].values()) == s["wall"]
    between = rep["stages"]["(between steps)"]
    assert between["wall"] == 2.0 and between["main"] == {"other": 2.0}
    assert s["engine"] == {} and s["workers"] == {}


def test_threads_keep_their_own_stacks_groups_and_the_stage_their_segment_began_in(prof):
    c = prof.clock_
    _at(c, 0, prof.begin)
    _at(c, 1, prof.stage_start, "s")
    _at(c, 2, prof.push, "agent_loop")  # the main thread awaits while the engine computes

    def engine():
        _at(c, 3, prof.push, "decode")
        _at(c, 4, prof.push, "emit")
        _at(c, 5, prof.pop)
        _at(c, 7, prof.pop)             # decode 3-4, 5-7; emit 4-5

    _in_thread("engine-x", engine)
    _at(c, 8, prof.pop)                 # agent_loop 2-8, all of it: the engine's time is not taken out of it
    pushed, switched = threading.Event(), threading.Event()

    def worker():  # its segment (9-12) begins in s and ends in s2: it is s's
        _at(c, 9, prof.push, "sandbox")
        pushed.set()
        switched.wait(10)
        _at(c, 12, prof.pop)

    th = threading.Thread(target=worker, name="asyncio_0")
    th.start()
    pushed.wait(10)
    _at(c, 10, prof.stage_end, "s")
    _at(c, 10, prof.stage_start, "s2")
    switched.set()
    th.join()
    _at(c, 13, prof.push, "store")
    _at(c, 14, prof.pop)
    _at(c, 15, prof.stage_end, "s2")
    _at(c, 15, prof.end)
    rep = prof.report()
    s, s2 = rep["stages"]["s"], rep["stages"]["s2"]
    assert s["wall"] == 9.0 and s2["wall"] == 5.0
    assert s["main"] == {"agent_loop": 6.0, "other": 3.0}
    assert s["engine"] == {"decode": 3.0, "emit": 1.0}
    assert s["workers"] == {"sandbox": 3.0}
    assert s2["main"] == {"store": 1.0, "other": 4.0} and s2["workers"] == {} and s2["engine"] == {}
    for row in (s, s2):
        assert sum(row["main"].values()) == row["wall"]


def test_wrapped_calls_resolve_their_category_from_the_open_ones_and_count(prof):
    ip = _bench("iteration_profile")
    c = prof.clock_

    class Trainer:
        def step(self):
            c.t += 1
            self._critic_update()
            c.t += 1
            loss_backward()
            return {"tokens": 7}

        def _critic_update(self):
            c.t += 2
            loss_backward()

    def loss_backward():
        c.t += 3

    wrapped_bwd = prof.wrap(loss_backward, ip._bwd_cat)
    mod = types.ModuleType("fakeroot.losses")
    mod.backward = loss_backward
    sys.modules["fakeroot.losses"] = mod
    try:
        assert prof.patch_everywhere(loss_backward, ip._bwd_cat, ("fakeroot",)) == 1
        assert mod.backward is not loss_backward
        prof.patch(Trainer, "step", "sao_other", measure=ip._trained("sao"))
        prof.patch(Trainer, "_critic_update", "@critic")
        loss_backward = wrapped_bwd  # the name Trainer's methods call
        _at(c, 0, prof.begin)
        _at(c, 0, prof.stage_start, "sao")
        Trainer().step()            # 1 rest, 2 critic (marker: rest), 3 critic bwd, 1 rest, 3 policy bwd
        _at(c, c.t, prof.stage_end)
        _at(c, c.t, prof.end)
        prof.restore()
        assert mod.backward is not wrapped_bwd and "step" in vars(Trainer) and Trainer.step.__name__ == "step"
        assert not hasattr(Trainer.step, "__profiled__")
    finally:
        del sys.modules["fakeroot.losses"]
    s = prof.report()["stages"]["sao"]
    assert s["main"] == {"sao_other": 4.0, "sao_critic_bwd": 3.0, "sao_policy_bwd": 3.0, "other": 0.0}
    assert s["counts"] == {"sao_tokens": 7.0, "sao_steps": 1.0}
    assert ip._fwd_cat(["opd_other", "opd_teacher"], (), {}) == "opd_teacher"
    assert ip._fwd_cat(["opd_other"], (), {}) == "opd_student_fwd" and ip._fwd_cat([], (), {}) == "fwd_other"
    assert ip._env_cat(["verify", "@x"], (), {}) == "verify" and ip._env_cat(["agent_loop"], (), {}) == "sandbox"


def test_engine_forward_hook_splits_decode_from_prefill_and_counts_the_cached_positions(prof):
    ip = _bench("iteration_profile")
    c = prof.clock_

    class Req:
        def __init__(self, cached, ctx):
            self.cached, self.ctx = cached, ctx

    class Engine:
        def _forward(self, reqs, chunked):
            c.t += 2 if chunked else 1
            for r in reqs:
                r.cached = min(r.ctx, r.cached + (5 if chunked else 1))
            return []

    prof.patch(Engine, "_forward", lambda _s, a, k: "prefill" if ip._arg(a, k, 2, "chunked", False) else "decode",
               measure=ip._forward_tokens)
    _at(c, 0, prof.begin)
    _at(c, 0, prof.stage_start, "rollouts")

    def engine():
        e = Engine()
        e._forward([Req(0, 3), Req(0, 10)], chunked=True)  # 3 + 5 positions, 2 s
        e._forward([Req(3, 9), Req(5, 9)], False)           # 2 positions, 1 s
        e._forward(reqs=[Req(6, 9)], chunked=False)         # 1 position, 1 s

    _in_thread("engine-embedded-0", engine)
    _at(c, 10, prof.stage_end)
    _at(c, 10, prof.end)
    s = prof.report()["stages"]["rollouts"]
    assert s["engine"] == {"prefill": 2.0, "decode": 2.0}
    assert s["counts"] == {"prefill_tokens": 8.0, "decode_tokens": 3.0}
    assert s["main"] == {"other": 10.0}
    r = ip.rates(s)
    assert r["decode_tok_s"] == 1.5 and r["prefill_tok_s"] == 4.0 and r["engine_busy_s"] == 4.0


def test_a_compiled_decode_steps_first_run_of_a_variant_is_compile_and_later_ones_decode():
    ip = _bench("iteration_profile")
    cfg = types.SimpleNamespace(use_dsa=True, index_topk=64)
    step = types.SimpleNamespace(model=types.SimpleNamespace(config=cfg), seen={False})
    assert ip._compile_cat([], (step, "ids", "slots", 10), {}) == "decode"        # dense: run before
    assert ip._compile_cat([], (step, "ids", "slots"), {"n_keys": 65}) == "compile"  # selected: its first run
    step.seen.add(True)
    assert ip._compile_cat([], (step, "ids", "slots", 65), {}) == "decode"
    assert ip._compile_cat([], (object(),), {}) == "decode"  # a changed class: decode, never an error
