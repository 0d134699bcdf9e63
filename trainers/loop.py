"""The RL loop in slime's shape: a trainer, rollout engines, and a weight sync between them.

The trainer reaches the engines only through a `rollout.backend` RolloutBackend: its Policy (generate) and
its WeightSync (push). The default is one in-process engine (the CPU default); a `ServerBackend` drives
engine servers by URL — temper's or SGLang's, behind a router — with nothing here changing.

Async mode: a rollout thread keeps `in_flight` episodes running against the backend's policy (agent
loop + sandboxed environments); every finished trajectory goes into a queue at once. The trainer takes
`batch_size` trajectories as they arrive (one rollout per prompt), runs one SAO step, and every
`push_every` steps pushes its weights (versioned and checksummed on every engine). Engines swap them
between decoding steps; in-flight requests keep going and their later tokens carry the new version —
which is what the staleness bound τ measures. With SAO's bound, admission control starts an episode only
if, trained in its turn, it would be within τ versions (`bound_admission`); the trainer drops the late ones.

What the trainer did with every trajectory (trained on it at step s, or dropped it as stale, crashed or
empty) is kept in `consumption`, for the trajectory store. Every fresh batch is counted in `crashes` (per family:
crashed and aborted episodes, with their causes) before it is trained on; with `max_crashed_share` the loop fails
(`CrashedShareExceeded`) instead of training on what is left (see `rollout/crashes.py`).

Sync mode: generate a batch with the current weights, wait for all of it, train, push (GRPO's shape:
`group_size` rollouts per prompt).

Pipelined mode: asynchronous and deterministic, one step off-policy. Batch s+1 (the next `batch_size`
environments in order) is generated, all of it with the weights before step s, while the trainer takes step s
on batch s; then the new weights are pushed and batch s+2 starts. Every sample is exactly one policy version
old when it is trained on (0 for the first batch), what each step trains on does not depend on which episode
finished first, and sampling is seeded per environment and visit, so the same seed gives the same weights on a
busy machine and on a quiet one. The overlap is one batch of generation against one training step; async
mode's free-running rollouts keep more in flight at the price of an order that depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable

from envs import TaskSpec
from envs.sandbox import Sandbox
from model import (
    Transformer,
    weights_checksum,  # noqa: F401 - re-exported (older callers import it from here)
)
from model.tokenizer import Tokenizer
from rollout.agent import Agent, AgentConfig, run_episodes
from rollout.backend import InProcessBackend
from rollout.crashes import CrashTally
from rollout.types import Trajectory

from .config import LoopConfig
from .sao import SAOConfig, SAOTrainer


class RLLoop:
    def __init__(self, actor: Transformer, specs: list[TaskSpec], tok: Tokenizer, sandbox: Sandbox,
                 agent_cfg: AgentConfig, sao_cfg: SAOConfig, cfg: LoopConfig | None = None, version: int = 0,
                 on_trajectory: Callable[[Trajectory], None] | None = None, iteration: int = 0,
                 backend=None, consumer: str = "sao", train_backend=None, warm: list[Trajectory] | None = None,
                 replay: list[Trajectory] | None = None, max_crashed_share: float | None = None):
        """`backend`: a RolloutBackend already serving `actor` at `version` (None: an in-process engine).
        `train_backend`: the trainer's data-parallel runtime (trainers/backends.py). With several ranks, rank 0
        owns the rollout side (episodes, the batch queue, the weight pushes) and hands every batch to the other
        ranks; every rank trains on its share and all end each step with the same weights.
        `warm`: trajectories the actor's current weights already generated (the iteration's `rollout_batches`,
        read back from the store). By `cfg.warm_rollouts` they pre-train the critic ("critic": the value
        pre-training's updates cycle through them a batch at a time), and are also the first training batch, all
        at once ("train": one large, costly step), before any fresh rollout; "off" ignores them.
        `replay`: warm-start trajectories this loop does not train on, the rows of the replay anchor
        (`sao.replay_coef`; see `SAOTrainer.set_replay`). Every rank needs them, and the actor must still be the
        warm start (a resumed loop is restored after it is built).
        `max_crashed_share`: fail when a family's crashed share (crashed episodes of the fresh batches; aborted ones
        are only counted) is above it, as soon as that is certain (the stages pass `loop.max_crashed_share`); None: count only."""
        from .backends import TorchBackend

        self.actor, self.specs, self.tok, self.sandbox = actor, specs, tok, sandbox
        self.agent_cfg, self.cfg = agent_cfg, cfg or LoopConfig()
        self.dp = train_backend or TorchBackend()
        self.trainer = SAOTrainer(actor, sao_cfg, backend=self.dp)
        self.replay_tokens = self.trainer.set_replay(list(replay or []))
        if sao_cfg.replay_coef > 0 and not self.replay_tokens:  # an anchor asked for must not be silently off
            raise ValueError(f"sao.replay_coef is {sao_cfg.replay_coef} but this loop has no replay rows (warm-start "
                             "trajectories it does not train on, with policy tokens): pass `replay`, or set it to 0")
        self.version, self.iteration = version, iteration
        self._own_backend = backend is None and self.dp.is_main
        served = self.dp.export(actor) if backend is None or self.dp.sharded_state else None  # sharded: every rank
        if self.dp.is_main:
            self.backend = backend or InProcessBackend(served, tok, n_slots=self.cfg.n_slots,
                                                       max_len=agent_cfg.max_context + 8, version=version,
                                                       compile_decode=self.cfg.compile_decode)
        else:
            self.backend = None  # the trainer ranks other than 0 never talk to engines
        self.on_trajectory = on_trajectory
        self.consumer = consumer
        self.stage = "grpo" if sao_cfg.loss == "grpo" else "sao"
        self.consumption: list[dict] = []  # one row per trajectory the trainer was handed (see store.trajectories)
        self.loop_steps = 0  # trainer steps taken (an update or not): the `step` of a consumption row
        self.wait_seconds = 0.0  # time the trainer spent waiting for a batch
        self.pushes: list[dict] = []
        self.finished = 0
        # bounded: when the trainer falls behind, rollouts wait instead of piling up trajectories that the
        # staleness bound would later drop
        self._q: queue.Queue[Trajectory] = queue.Queue(maxsize=self.cfg.batch_size)
        self._stop = threading.Event()
        self._cursor = 0
        self._since_push = 0  # actor updates not yet pushed to the engine
        # pipelined mode: the batch generated ahead, once complete (what a checkpoint keeps; the cursor is past it)
        self._ahead_batch: list[Trajectory] | None = None
        self._resumed_ahead: list[Trajectory] | None = None  # a restored one: the resumed run's first batch
        # async mode's admission control (see `_admission_limit`): episodes started and fresh batches finished in
        # this run, and the rollout thread's event loop and gate (set when a batch is done or on stop)
        self._admitted = 0
        self._batches_done = 0
        self._rloop: asyncio.AbstractEventLoop | None = None
        self._gate: asyncio.Event | None = None
        self.warm = list(warm or []) if self.cfg.warm_rollouts != "off" else []
        self.crashes, self.max_crashed_share = CrashTally(), max_crashed_share
        self._planned: int | None = None  # fresh episodes this loop will have counted when `run` ends

    def _next_spec(self) -> TaskSpec:
        s = self.specs[self._cursor % len(self.specs)]
        self._cursor += 1
        return s

    def _next(self) -> tuple[TaskSpec, int]:
        """The next environment and how many times this loop has handed it out before (its sampling stream)."""
        n = self._cursor // len(self.specs)
        return self._next_spec(), n

    def push_weights(self) -> dict:
        """WeightSync: every engine serves the actor as the next version (checked there), or this raises."""
        self.version += 1
        served = self.dp.export(self.actor)  # temper's model; on a sharded backend a collective of every rank
        if self.backend is None:  # not rank 0: rank 0 pushes the (identical) weights
            return {"version": self.version}
        rec = self.backend.push(served, self.version)
        self.pushes.append(rec)
        return rec

    def _consumed(self, outcomes, step: int | None) -> None:
        for t, outcome in outcomes:
            vs = t.policy_versions()
            self.consumption.append({"trajectory_id": t.trajectory_id, "stage": self.stage, "consumer": self.consumer,
                                     "step": step, "policy_version": self.version,
                                     "staleness": self.version - vs[0] if vs else 0, "outcome": outcome})

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_state(self, dir, step: int, extra: dict | None = None, keep: int = 3):
        """Atomic training checkpoint: actor, critic, both optimisers, RNG, step, data cursor, policy version."""
        from .checkpoint import save_training_state

        t = self.trainer
        # the trainer's own count is of updates (the lr schedule and the replay cursor follow it), not of loop steps:
        # a step that made no update is in `step` and not in it
        extra = {**(extra or {}), "trainer_updates": t.steps}
        # a batch generated ahead (pipelined mode, on the weights before this step) goes with the state, so that a
        # resumed run trains on that very batch next, as the uninterrupted run does, and on the same environments after
        # it; without one (another mode, the last step) the cursor is that of the environments trained on
        if self._ahead_batch is not None:
            extra["ahead_batch"] = self._ahead_batch
        extra["crashes"] = self.crashes.state()  # (the ahead batch is counted when it is trained on)
        return save_training_state(dir, policy=self.actor, optimizer=t.opt, step=step, policy_version=self.version,
                                   data_cursor=self._cursor, critic=t.critic,
                                   critic_optimizer=getattr(t, "copt", None), extra=extra, keep=keep, backend=self.dp)

    def resume(self, state) -> None:
        """Continue from a `load_training_state` result: weights, optimisers, RNG, data cursor and policy version
        restored, the engine given the restored policy, and no second value pre-training."""
        from .checkpoint import restore

        t = self.trainer
        restore(state, self.actor, t.opt, t.critic, getattr(t, "copt", None), backend=self.dp)
        t.steps = int(state.extra.get("trainer_updates", state.step))  # states saved before it was kept: the step
        self.loop_steps = state.step
        self._cursor = int(state.data_cursor)
        self.crashes = CrashTally.from_state(state.extra.get("crashes"))
        ahead = state.extra.get("ahead_batch")
        self._resumed_ahead = ahead if self.dp.is_main else None  # (rank 0 hands every batch to the others)
        if ahead is not None and self.cfg.mode != "pipelined":  # on every rank: none goes on to wait for the others
            raise ValueError(f"loop.mode: {self.cfg.mode}, but this training state was saved by a pipelined loop with "
                             "a batch generated ahead: resume it with loop.mode=pipelined")
        self.version = state.policy_version - 1
        self.push_weights()  # the engine starts from the restored policy, at the saved version

    # ---- rollout side (async mode) -----------------------------------------------------------------
    def _admission_limit(self) -> int | None:
        """How many episodes this run may have started: None when unbounded (no staleness bound, or
        `bound_admission` off). The episode started k-th goes, finishing in turn, into fresh batch k // B. While the
        trainer has finished d batches the engines hold every version those steps made, and by the time batch m
        trains at most ceil((m − d) / push_every) more versions exist; so starting k only while
        k // B ≤ d + τ·push_every keeps that episode within τ versions of the trainer (τ = 0: each batch starts
        after the previous one is trained and pushed, i.e. synchronous; a step that makes no update makes no
        version, which only lowers the lag). Episodes that finish later than their turn can still go over, and the
        trainer's bound drops those."""
        t = self.trainer.cfg
        if not self.cfg.bound_admission or t.loss != "sao" or t.staleness is None:
            return None
        return (self._batches_done + t.staleness * self.cfg.push_every + 1) * self.cfg.batch_size

    async def _admit(self) -> bool:
        """Wait until admission control lets one more episode start (False: the loop is stopping)."""
        while not self._stop.is_set():
            limit = self._admission_limit()
            if limit is None or self._admitted < limit:
                self._admitted += 1  # no await between the check and the count: the workers share one event loop
                return True
            self._gate.clear()
            await self._gate.wait()
        return False

    def _batch_done(self) -> None:
        """The trainer has finished a fresh batch (its step taken and any new version pushed): the gate moves on."""
        self._batches_done += 1
        self._open_gate()

    def _open_gate(self) -> None:
        if self._rloop is not None and self._gate is not None:
            with contextlib.suppress(RuntimeError):  # the rollout thread's loop may have closed already
                self._rloop.call_soon_threadsafe(self._gate.set)

    def _rollouts(self) -> None:
        async def worker(agent: Agent):
            while await self._admit():
                spec, visit = self._next()
                t = await agent.run(spec, self.iteration, sample=visit)
                await asyncio.to_thread(self._emit, t)

        async def main():
            self._gate = asyncio.Event()
            self._rloop = asyncio.get_running_loop()
            async with self.backend.session() as policy:
                agent = Agent(policy, self.tok, self.sandbox, self.agent_cfg)
                await asyncio.gather(*(worker(agent) for _ in range(self.cfg.in_flight)))

        asyncio.run(main())

    def _emit(self, t: Trajectory) -> None:
        self.finished += 1
        if self.on_trajectory is not None:
            self.on_trajectory(t)
        while not self._stop.is_set():
            try:
                self._q.put(t, timeout=0.2)
                return
            except queue.Full:
                continue

    # ---- driver ---------------------------------------------------------------------------------------
    def run(self, steps: int, on_step: Callable[[dict], None] | None = None, max_seconds: float | None = None) -> list[dict]:
        hist: list[dict] = []
        t0 = time.perf_counter()
        thread = None
        # pipelined mode: the next batch, being generated on the current weights (after a resume: the restored one)
        ahead, self._resumed_ahead = self._resumed_ahead, None
        if self.cfg.mode == "async" and self.backend is not None:
            thread = threading.Thread(target=self._rollouts, daemon=True, name="rollouts")
            thread.start()
        try:
            fresh = self.loop_steps == 0  # no step taken yet, an update or not (a resumed loop has taken some)
            warm = self._shared(lambda: self.warm) if fresh else []
            pretrain = self.trainer.critic is not None and self.trainer.cfg.value_pretrain_steps and fresh
            per = max(1, self.cfg.batch_size // self.cfg.group_size) * self.cfg.group_size \
                if self.cfg.mode == "sync" else self.cfg.batch_size
            batches = steps + bool(pretrain and not warm) - bool(warm and self.cfg.warm_rollouts == "train" and steps)
            self._planned = self.crashes.episodes + batches * per
            if pretrain:
                # value pre-training before any actor update: on the warm rollouts, or on the first fresh batch
                first = warm or self._counted(self._collect())
                self.trainer.value_pretrain(first, batch_size=self.cfg.batch_size)  # each update costs one batch
                if not warm:
                    self._batch_done()
                fitted = self.trainer.pretrained_ids
                self._consumed([(t, "value_pretrain") for t in first if t.trajectory_id in fitted], None)
            if self.cfg.warm_rollouts != "train":
                warm = []
            for step in range(steps):
                if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                    from .lm import TimeCapExceeded

                    raise TimeCapExceeded(f"RL loop hit its safety cap of {max_seconds:g} s at step {step} of {steps}")
                fresh = not warm
                batch, warm = (warm, []) if warm else (self._counted(self._collect(ahead)), [])
                ahead = self._ahead() if self.cfg.mode == "pipelined" and step + 1 < steps else None
                st = self.trainer.step(batch, self.version)
                self.loop_steps += 1
                self._consumed(self.trainer.outcomes, self.loop_steps)
                self._since_push += int(st.get("updated", False))
                if ahead is not None:  # all of the next batch on the weights it started with, then the push
                    ahead = self._wait(ahead)
                self._ahead_batch = ahead  # what a checkpoint taken after this step keeps
                if (step + 1) % self.cfg.push_every == 0 and self._since_push:
                    st["push"] = self.push_weights()  # a step that changed nothing does not make a new version
                    self._since_push = 0
                if fresh:
                    self._batch_done()
                st.update(elapsed=time.perf_counter() - t0, finished=self.finished, version=self.version,
                          batch_reward=sum(t.reward for t in batch) / len(batch))
                hist.append(st)
                if on_step:
                    on_step(st)
        finally:
            self._stop.set()
            self._open_gate()  # workers waiting for admission see the stop
            if self.backend is not None:
                self.backend.abort()
            if thread is not None:
                thread.join(timeout=30)
            if isinstance(ahead, threading.Thread):
                ahead.join(timeout=30)
            if self._own_backend:
                self.backend.close()
        return hist

    def _counted(self, batch: list[Trajectory]) -> list[Trajectory]:
        """A fresh batch, counted in `crashes` and checked before anything trains on it (every rank holds the same
        batch, so every rank fails together)."""
        self.crashes.add(batch)
        self.crashes.check(self.max_crashed_share, self.consumer, planned=self._planned)
        return batch

    def _collect(self, ahead: list[Trajectory] | None = None) -> list[Trajectory]:
        """The next training batch, on every rank: what pipelined mode generated ahead, else a fresh one."""
        if ahead is not None:
            self._ahead_batch = None  # being trained on now
            return self._shared(lambda: ahead)
        t0 = time.perf_counter()
        try:
            return self._collect_batch()
        finally:
            self.wait_seconds += time.perf_counter() - t0  # the trainer idles, waiting for rollouts

    # ---- rollout side (pipelined mode) -----------------------------------------------------------------
    def _ahead(self) -> threading.Thread | None:
        """Start generating the next batch (rank 0, which owns the engines) on the weights the engines hold now."""
        if self.backend is None:
            return None
        box: dict = {}

        def work():
            try:
                box["batch"] = self._pipelined_batch()
            except BaseException as e:  # handed to the trainer's thread by `_wait`
                box["error"] = e

        th = threading.Thread(target=work, daemon=True, name="rollouts-ahead")
        th.box = box  # type: ignore[attr-defined]
        th.start()
        return th

    def _wait(self, th: threading.Thread | None) -> list[Trajectory] | None:
        if th is None:
            return None
        t0 = time.perf_counter()
        th.join()
        self.wait_seconds += time.perf_counter() - t0
        if "error" in th.box:  # type: ignore[attr-defined]
            raise th.box["error"]  # type: ignore[attr-defined]
        return th.box["batch"]  # type: ignore[attr-defined]

    def _pipelined_batch(self) -> list[Trajectory]:
        """The next `batch_size` environments in order, each sampling the stream of its visit, in that order."""
        todo = [self._next() for _ in range(self.cfg.batch_size)]

        async def go():
            sem = asyncio.Semaphore(self.cfg.in_flight)
            async with self.backend.session() as policy:
                agent = Agent(policy, self.tok, self.sandbox, self.agent_cfg)

                async def one(spec, visit):
                    async with sem:
                        return await agent.run(spec, self.iteration, sample=visit)

                return list(await asyncio.gather(*(one(s, v) for s, v in todo)))

        trajs = asyncio.run(go())
        for t in trajs:
            self.finished += 1
            if self.on_trajectory is not None:
                self.on_trajectory(t)
        return trajs

    def _collect_batch(self) -> list[Trajectory]:
        return self._shared(self._generate)

    def _shared(self, make: Callable[[], list[Trajectory]]) -> list[Trajectory]:
        """Rank 0's `make()`, on every rank: each trains on its share of the same batch (one rank: just `make()`)."""
        from .backends import from_main

        return from_main(self.dp, make)

    def _generate(self) -> list[Trajectory]:
        if self.cfg.mode == "async":
            return [self._q.get() for _ in range(self.cfg.batch_size)]
        if self.cfg.mode == "pipelined":
            return self._pipelined_batch()
        g = self.cfg.group_size
        specs = [self._next_spec() for _ in range(max(1, self.cfg.batch_size // g))]
        specs = [s for s in specs for _ in range(g)]
        async def go():
            async with self.backend.session() as policy:
                agent = Agent(policy, self.tok, self.sandbox, self.agent_cfg)
                return await run_episodes(agent, specs, self.iteration, concurrency=self.cfg.in_flight)

        trajs = asyncio.run(go())
        for t in trajs:
            self.finished += 1
            if self.on_trajectory is not None:
                self.on_trajectory(t)
        return trajs
