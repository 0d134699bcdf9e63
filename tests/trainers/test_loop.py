"""The RL loop end to end on the micro model: async and sync modes, weight pushes, version stamps.

A randomly initialised micro policy never earns an environment's reward, so these tests set the rewards
themselves (the `on_trajectory` hook sees every trajectory before the trainer does): alternating 0 / 1 gives
every batch, and every GRPO group of two, a learning signal; all-equal rewards give GRPO none.
"""

import pytest
import torch

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, Transformer
from rollout.agent import AgentConfig
from trainers.loop import LoopConfig, RLLoop
from trainers.sao import SAOConfig

TOK = ByteTokenizer()
# short episodes: at most 16 generated tokens each
AGENT = AgentConfig(system_prompt="Use tools.", max_context=384, max_action_tokens=8, max_total_tokens=16,
                    max_obs_tokens=32, compact_margin=0)

pytestmark = pytest.mark.usefixtures("one_thread")


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _loop(mode: str, rewards, **sao):
    torch.manual_seed(0)
    actor = Transformer(configs.load("micro").model)
    specs = generate(["kv-lookup", "calc-chain"], 6, seed=3)
    seen = []

    def on_trajectory(t):
        t.reward = rewards(len(seen))
        seen.append(t)

    group = 2 if mode == "sync" else 1
    cfg = SAOConfig(**{"critic_updates": 1, "staleness": 4, "value_pretrain_steps": 2, "lr": 1e-3,
                       "loss": "sao" if mode == "async" else "grpo", **sao})
    loop = RLLoop(actor, specs, TOK, make_sandbox(), AGENT, cfg,
                  LoopConfig(mode=mode, batch_size=4, in_flight=4, n_slots=4, group_size=group, push_every=1),
                  on_trajectory=on_trajectory)
    return loop, actor, seen


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_loop_trains_and_pushes_versioned_weights(mode):
    loop, actor, seen = _loop(mode, lambda i: float(i % 2))
    init = _snapshot(actor)
    hist = loop.run(2)
    assert len(hist) == 2
    assert [h["updated"] for h in hist] == [True, True]
    # the actor learned: its weights moved away from the initial ones
    assert not _same(init, _snapshot(actor))
    # one new policy version per updating step, and the engine holds exactly the trainer's weights
    assert loop.version == 2 and [p["version"] for p in loop.pushes] == [1, 2] and [h["version"] for h in hist] == [1, 2]
    assert _same(_snapshot(loop.backend.engine.model), _snapshot(actor))
    assert loop.backend.engine.version == 2
    assert len(seen) >= 8
    versions = {v for t in seen for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m}
    assert versions <= {0, 1, 2} and 0 in versions
    # what the trainer did with each trajectory: one row per trajectory handed to it, with the step that took it
    rows = loop.consumption
    assert [r["step"] for r in rows if r["outcome"] == "trained"] == [1] * 4 + [2] * 4
    assert all(r["stage"] == ("sao" if mode == "async" else "grpo") for r in rows)
    by_id = {t.trajectory_id: t for t in seen}
    for r in rows:
        if r["outcome"] == "trained":
            assert r["staleness"] == r["policy_version"] - by_id[r["trajectory_id"]].policy_versions()[0] >= 0
    # train/inference mismatch on tokens of the version being trained: the engine rescored each finished segment
    # with the trainer's own forward, so on the same weights the two log-probs are the same bits
    assert hist[0]["mismatch_fresh_tokens"] > 0
    assert all(h["mismatch_fresh_max"] == 0.0 for h in hist if "mismatch_fresh_tokens" in h)
    if mode == "sync":  # every batch was generated entirely by the weights of its step
        assert all(t.policy_versions()[0] == t.policy_versions()[1] for t in seen)
        assert {t.policy_versions()[0] for t in seen[:4]} == {0} and {t.policy_versions()[0] for t in seen[4:8]} == {1}


def test_loop_step_without_signal_is_no_new_version():
    """GRPO with equal rewards in every group: every advantage is 0, nothing may change and no version is made."""
    loop, actor, _ = _loop("sync", lambda i: 1.0)
    init = _snapshot(actor)
    hist = loop.run(2)
    assert [h["updated"] for h in hist] == [False, False]
    assert loop.version == 0 and loop.pushes == [] and [h["version"] for h in hist] == [0, 0]
    assert _same(init, _snapshot(actor)) and _same(init, _snapshot(loop.backend.engine.model))


def test_loop_all_stale_batch_is_no_new_version():
    """The trainer is at version 3 while the engine still generates with version 0 and τ = 1: every sample is
    stale, so the actor stays as it was and the version is not bumped."""
    loop, actor, _ = _loop("sync", lambda i: float(i % 2), loss="sao", staleness=1, value_pretrain_steps=0)
    loop.version = 3
    init = _snapshot(actor)
    hist = loop.run(1)
    assert hist[0]["updated"] is False and hist[0]["dropped_stale"] == 4 and hist[0]["trajectories"] == 0
    assert loop.version == 3 and loop.pushes == []
    assert _same(init, _snapshot(actor))


def test_a_resumed_loop_counts_updates_not_loop_steps(tmp_path):
    """A loop step that made no update does not count as one after a resume either: the trainer's update count
    (which sets the lr schedule and the replay cursor) and the policy version come back as they were."""
    from trainers.checkpoint import load_training_state

    loop, _, _ = _loop("sync", lambda i: 1.0 if i < 4 else float(i % 2), warmup_steps=5)
    hist = loop.run(2)  # the first batch ties in every group: no update; the second updates
    assert [h["updated"] for h in hist] == [False, True] and loop.trainer.steps == 1 and loop.version == 1
    loop.save_state(tmp_path / "state", step=2)
    loop.backend.close()
    again, _, _ = _loop("sync", lambda i: 1.0)
    again.resume(load_training_state(tmp_path / "state"))
    assert again.loop_steps == 2 and again.trainer.steps == 1 and again.version == 1
    again.backend.close()
    # SAO (a critic) whose only step made no update (every sample stale): a resume pre-trains the critic no second
    # time, although the trainer has made no update yet
    loop, _, _ = _loop("async", lambda i: float(i % 2), staleness=1, value_pretrain_steps=1)
    loop.version = 3  # the engine's episodes are version 0: all stale
    assert [h["updated"] for h in loop.run(1)] == [False] and loop.trainer.steps == 0
    assert sum(r["outcome"] == "value_pretrain" for r in loop.consumption) > 0
    loop.save_state(tmp_path / "sao", step=1)
    loop.backend.close()
    again, _, _ = _loop("async", lambda i: float(i % 2), staleness=1, value_pretrain_steps=1)
    again.resume(load_training_state(tmp_path / "sao"))
    again.run(1)
    again.backend.close()
    assert again.consumption and not any(r["outcome"] == "value_pretrain" for r in again.consumption)


def _warm_rollouts(n: int = 6):
    """Episodes of the untrained micro actor (policy version 0), rewards alternating 1 / 0: what
    `rollout_batches` stores for SAO to read back."""
    loop, actor, seen = _loop("sync", lambda i: float((i + 1) % 2))
    loop.cfg = loop.cfg.model_copy(update={"batch_size": n, "group_size": 1})
    trajs = loop._generate()
    loop.backend.close()
    return trajs


@pytest.mark.parametrize("use", ["train", "critic", "off"])
def test_loop_warm_rollouts(use):
    warm = _warm_rollouts(6)
    assert all(t.policy_versions() == (0, 0) for t in warm if t.n_trainable)
    loop, actor, seen = _loop("async", lambda i: float(i % 2))  # the same initial actor (seed 0)
    loop.cfg = loop.cfg.model_copy(update={"warm_rollouts": use})
    loop.warm = warm if use != "off" else []
    hist = loop.run(2)
    ids = {t.trajectory_id for t in warm}
    rows = loop.consumption
    pre = [r["trajectory_id"] for r in rows if r["outcome"] == "value_pretrain"]
    step1 = [r for r in rows if r["step"] == 1]
    step2 = [r for r in rows if r["step"] == 2]
    fitted = {t.trajectory_id for t in warm if t.n_trainable}
    if use == "off":  # the critic pre-trains on the first fresh batch, as without warm rollouts
        assert len(pre) == 4 and not ids & set(pre)
    else:  # the critic pre-trains on the warm rollouts (a batch of 4 per update, 2 updates: all 6), nothing else
        assert sorted(pre) == sorted(fitted) and len(fitted) >= 5
    if use == "train":  # the first step trains on all six warm rollouts at once, on-policy (staleness 0)
        assert sorted(r["trajectory_id"] for r in step1) == sorted(ids)
        assert all(r["outcome"] == "trained" and r["staleness"] == 0 for r in step1)
        assert hist[0]["trajectories"] == 6 and hist[0]["updated"]
    else:  # a fresh batch of the loop's own size
        assert len(step1) == 4 and not ids & {r["trajectory_id"] for r in step1}
    # then fresh rollouts only
    assert len(step2) == 4 and not ids & {r["trajectory_id"] for r in step2}
    assert not ids & {t.trajectory_id for t in seen}


class _Jittery:
    """A rollout backend that delays every generate call by a random amount (its own RNG): episodes finish in an
    order set by that RNG, as on a machine with other work on it."""

    kind = "in-process"

    def __init__(self, inner, seed: int):
        import contextlib
        import random

        self.inner, self.rng, self.contextlib = inner, random.Random(seed), contextlib

    def session(self):
        import asyncio

        inner, rng = self.inner, self.rng

        class Slow:
            def __init__(self, policy):
                self.policy = policy

            def __getattr__(self, name):
                return getattr(self.policy, name)

            async def generate(self, *a, **kw):
                await asyncio.sleep(rng.uniform(0.0, 0.03))
                return await self.policy.generate(*a, **kw)

        @self.contextlib.asynccontextmanager
        async def cm():
            async with inner.session() as policy:
                yield Slow(policy)

        return cm()

    def __getattr__(self, name):  # push, abort, close, engine
        return getattr(self.inner, name)


def _pipelined(jitter_seed: int, steps: int = 3, on_step=None, state=None):
    """The pipelined loop on the micro actor; each trajectory's reward is a fixed function of its environment and
    its tokens (not of the order it finished in). `state`: a training state to resume from first."""
    import zlib

    from rollout.backend import InProcessBackend

    torch.manual_seed(0)
    actor = Transformer(configs.load("micro").model)
    specs = generate(["kv-lookup", "calc-chain"], 6, seed=3)
    seen = []

    def on_trajectory(t):
        toks = [tok for s in t.segments for tok in s.tokens]
        t.reward = float(zlib.crc32(f"{t.env_id}:{toks}".encode()) % 2)
        seen.append(t)

    lc = LoopConfig(mode="pipelined", batch_size=4, in_flight=4, n_slots=4, push_every=1)
    backend = _Jittery(InProcessBackend(actor, TOK, n_slots=4, max_len=AGENT.max_context + 8), jitter_seed)
    loop = _pipelined.loop = RLLoop(actor, specs, TOK, make_sandbox(), AGENT.model_copy(update={"seed": 0}),
                  SAOConfig(critic_updates=1, staleness=2, value_pretrain_steps=1, lr=1e-3), lc,
                  on_trajectory=on_trajectory, backend=backend)
    try:
        if state is not None:
            loop.resume(state)
        hist = loop.run(steps, on_step)
    finally:
        backend.close()
    return loop, actor, seen, hist


def test_pipelined_loop_is_deterministic_and_one_version_off():
    """Pipelined mode: the same seed gives the same weights whatever order the episodes finish in (two different
    delay patterns), every sample after the first batch is exactly one version old, and the engine ends on the
    trainer's weights."""
    a_loop, a, a_seen, a_hist = _pipelined(jitter_seed=1)
    b_loop, b, b_seen, b_hist = _pipelined(jitter_seed=2)
    assert [h["updated"] for h in a_hist] == [True, True, True]
    assert _same(_snapshot(a), _snapshot(b))
    assert [t.env_id for t in a_seen] == [t.env_id for t in b_seen]
    assert [[tok for s in t.segments for tok in s.tokens] for t in a_seen] == \
           [[tok for s in t.segments for tok in s.tokens] for t in b_seen]
    # value pre-training batch, then batch 0 (version 0, lag 0), then batches 1 and 2 (lag exactly 1)
    rows = [r for r in a_loop.consumption if r["outcome"] == "trained"]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4 + [3] * 4
    assert [r["staleness"] for r in rows] == [0] * 4 + [1] * 8
    by_id = {t.trajectory_id: t for t in a_seen}
    for r in rows:  # a whole episode on one version: the one its batch started with
        vs = by_id[r["trajectory_id"]].policy_versions()
        assert vs[0] == vs[1] == r["step"] - 1 - (r["step"] > 1)
    # the batch generated during the last step is not made: 4 (critic) + 3 × 4 episodes
    assert len(a_seen) == 16 and a_loop.version == 3
    assert _same(_snapshot(a_loop.backend.engine.model), _snapshot(a))


def test_a_resumed_pipelined_loop_takes_the_uninterrupted_steps(tmp_path):
    """A training state saved after a pipelined step keeps the batch generated ahead (on the weights before that step)
    and the cursor past it. A loop resumed from it trains on that very batch, then on the same environments with the
    same samples, and ends on the uninterrupted run's weights, bit for bit, with the same consumption rows (that
    batch's ids, then environments, steps and staleness). Before, a resume drew that batch again on the saved weights,
    so its first step differed."""
    from trainers.checkpoint import load_training_state

    saved = []

    def on_step(st):  # after step 1: the critic's batch and batch 0 used (8 draws), batch 1 generated ahead (12)
        if not saved:
            running = _pipelined.loop
            saved.append([t.trajectory_id for t in running._ahead_batch])
            running.save_state(tmp_path / "state", step=1)

    whole, w_actor, w_seen, _ = _pipelined(jitter_seed=1, steps=3, on_step=on_step)
    state = load_training_state(tmp_path / "state")
    assert state.data_cursor == 12 and [t.trajectory_id for t in state.extra["ahead_batch"]] == saved[0]
    again, a_actor, a_seen, a_hist = _pipelined(jitter_seed=2, steps=2, state=state)  # another finish order, too
    assert len(a_hist) == 2 and again.loop_steps == 3 and again.version == whole.version == 3
    assert _same(_snapshot(a_actor), _snapshot(w_actor))
    trained = [r for r in whole.consumption if r["outcome"] == "trained"][4:]  # steps 2 and 3
    assert [r["trajectory_id"] for r in again.consumption][:4] == saved[0] == [r["trajectory_id"] for r in trained[:4]]
    env = {t.trajectory_id: t.env_id for t in [*w_seen, *a_seen]}
    assert [(env[r["trajectory_id"]], r["step"], r["staleness"]) for r in again.consumption] == \
           [(env[r["trajectory_id"]], r["step"], r["staleness"]) for r in trained]
    # the resumed run generated only batch 2, the uninterrupted run's last batch, on the same environments and samples
    toks = [[(t.env_id, [tok for s in t.segments for tok in s.tokens]) for t in ts] for ts in (w_seen[-4:], a_seen)]
    assert toks[0] == toks[1]
    with pytest.raises(ValueError, match="loop.mode: sync"):
        loop, _, _ = _loop("sync", lambda i: 1.0)
        try:
            loop.resume(state)
        finally:
            loop.backend.close()


def _async_jittery(tau: int, in_flight: int, steps: int, admission: bool = True, push_every: int = 1):
    """Async SAO on the micro actor with a jittery backend (episodes finish out of order); records, at every step,
    how many episodes had been started and how many fresh batches the trainer had finished before it."""
    from rollout.backend import InProcessBackend

    torch.manual_seed(0)
    actor = Transformer(configs.load("micro").model)
    specs = generate(["kv-lookup", "calc-chain"], 6, seed=3)
    seen = []

    def on_trajectory(t):
        t.reward = float(len(seen) % 2)
        seen.append(t)

    lc = LoopConfig(mode="async", batch_size=4, in_flight=in_flight, n_slots=8, push_every=push_every,
                    bound_admission=admission)
    backend = _Jittery(InProcessBackend(actor, TOK, n_slots=8, max_len=AGENT.max_context + 8), 5)
    loop = RLLoop(actor, specs, TOK, make_sandbox(), AGENT.model_copy(update={"seed": 0}),
                  SAOConfig(critic_updates=1, staleness=tau, value_pretrain_steps=1, lr=1e-3), lc,
                  on_trajectory=on_trajectory, backend=backend)
    started = []  # (episodes started, fresh batches finished) as each step begins

    collect = loop._collect

    def spy(ahead=None):
        batch = collect(ahead)
        started.append((loop._admitted, loop._batches_done))
        return batch

    loop._collect = spy
    try:
        hist = loop.run(steps)
    finally:
        backend.close()
    return loop, hist, started


def test_async_admission_at_tau_0_is_synchronous():
    """τ = 0 with 16 episodes allowed in flight: admission control starts each batch only after the previous one is
    trained and pushed, so every sample is trained on the version that generated all of it and none is dropped.
    Without admission, the same loop drops stale samples."""
    loop, hist, started = _async_jittery(tau=0, in_flight=16, steps=3)
    assert [h["updated"] for h in hist] == [True, True, True]
    trained = [r for r in loop.consumption if r["outcome"] == "trained"]
    assert len(trained) == 12 and all(r["staleness"] == 0 for r in trained)
    assert loop.trainer.dropped["stale"] == 0
    # the critic's batch and three training batches: never more than one batch started beyond the finished ones
    assert all(n <= (done + 1) * 4 for n, done in started)
    free, _, _ = _async_jittery(tau=0, in_flight=16, steps=3, admission=False)
    assert free.trainer.dropped["stale"] > 0


def test_async_admission_bounds_episodes_started_ahead():
    """τ = 1, push every step, 32 allowed in flight: at most τ + 1 batches started beyond those the trainer has
    finished, and the loop still fills every batch (no deadlock when the gate is shut)."""
    loop, hist, started = _async_jittery(tau=1, in_flight=32, steps=4)
    assert len(hist) == 4
    assert all(n <= (done + 2) * 4 for n, done in started)
    assert max(n - done * 4 for n, done in started) > 4  # it did run ahead of the trainer: more than one batch
    trained = [r for r in loop.consumption if r["outcome"] == "trained"]
    assert trained and all(r["staleness"] <= 1 for r in trained)
