"""The RL loop in slime's shape, in one process on a CPU.

Async mode: a rollout thread keeps `in_flight` episodes running against the embedded engine (agent
loop + sandboxed environments); every finished trajectory goes into a queue at once. The trainer takes
`batch_size` trajectories as they arrive (one rollout per prompt), runs one SAO step, and every
`push_every` steps pushes its weights to the engine (versioned and checksummed). The engine swaps them
between decoding steps; in-flight requests keep going and their later tokens carry the new version —
which is what the staleness bound τ measures.

Sync mode: generate a batch with the current weights, wait for all of it, train, push (GRPO's shape:
`group_size` rollouts per prompt).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import queue
import threading
import time
from collections.abc import Callable

import torch

from envs import TaskSpec
from envs.sandbox import Sandbox
from model import Transformer
from model.tokenizer import Tokenizer
from rollout.agent import Agent, AgentConfig, EnginePolicy, run_episodes
from rollout.engine import Engine
from rollout.types import Trajectory

from .config import LoopConfig
from .sao import SAOConfig, SAOTrainer


def weights_checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:32]


class RLLoop:
    def __init__(self, actor: Transformer, specs: list[TaskSpec], tok: Tokenizer, sandbox: Sandbox,
                 agent_cfg: AgentConfig, sao_cfg: SAOConfig, cfg: LoopConfig | None = None, version: int = 0,
                 on_trajectory: Callable[[Trajectory], None] | None = None, iteration: int = 0):
        self.actor, self.specs, self.tok, self.sandbox = actor, specs, tok, sandbox
        self.agent_cfg, self.cfg = agent_cfg, cfg or LoopConfig()
        self.trainer = SAOTrainer(actor, sao_cfg)
        self.version, self.iteration = version, iteration
        self.engine = Engine(copy.deepcopy(actor).eval(), tok, n_slots=self.cfg.n_slots,
                             max_len=agent_cfg.max_context + 8, policy_version=version)
        self.on_trajectory = on_trajectory
        self.pushes: list[dict] = []
        self.finished = 0
        # bounded: when the trainer falls behind, rollouts wait instead of piling up trajectories that the
        # staleness bound would later drop
        self._q: queue.Queue[Trajectory] = queue.Queue(maxsize=self.cfg.batch_size)
        self._stop = threading.Event()
        self._cursor = 0
        self._since_push = 0  # actor updates not yet pushed to the engine

    def _next_spec(self) -> TaskSpec:
        s = self.specs[self._cursor % len(self.specs)]
        self._cursor += 1
        return s

    def push_weights(self) -> dict:
        self.version += 1
        t0 = time.perf_counter()
        sd = {k: v.detach().clone() for k, v in self.actor.state_dict().items()}
        res = self.engine.update_weights(state_dict=sd, version=self.version)
        rec = {"version": self.version, "checksum": weights_checksum(self.actor), "seconds": time.perf_counter() - t0,
               "in_flight": res["num_paused_requests"]}
        if weights_checksum(self.engine.model) != rec["checksum"]:
            raise RuntimeError(f"weight push v{self.version}: engine checksum differs from the trainer's")
        self.pushes.append(rec)
        return rec

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_state(self, dir, step: int, extra: dict | None = None, keep: int = 3):
        """Atomic training checkpoint: actor, critic, both optimisers, RNG, step, data cursor, policy version."""
        from .checkpoint import save_training_state

        t = self.trainer
        return save_training_state(dir, policy=self.actor, optimizer=t.opt, step=step, policy_version=self.version,
                                   data_cursor=self._cursor, critic=t.critic, critic_optimizer=getattr(t, "copt", None),
                                   extra=extra, keep=keep)

    def resume(self, state) -> None:
        """Continue from a `load_training_state` result: weights, optimisers, RNG, data cursor and policy version
        restored, the engine given the restored policy, and no second value pre-training."""
        from .checkpoint import restore

        t = self.trainer
        restore(state, self.actor, t.opt, t.critic, getattr(t, "copt", None))
        t.steps = state.step
        self._cursor = int(state.data_cursor)
        self.version = state.policy_version - 1
        self.push_weights()  # the engine starts from the restored policy, at the saved version

    # ---- rollout side (async mode) -----------------------------------------------------------------
    def _rollouts(self) -> None:
        async def worker(agent: Agent):
            while not self._stop.is_set():
                t = await agent.run(self._next_spec(), self.iteration)
                await asyncio.to_thread(self._emit, t)

        async def main():
            agent = Agent(EnginePolicy(self.engine), self.tok, self.sandbox, self.agent_cfg)
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
        if self.cfg.mode == "async":
            thread = threading.Thread(target=self._rollouts, daemon=True, name="rollouts")
            thread.start()
        try:
            if self.trainer.critic is not None and self.trainer.cfg.value_pretrain_steps and self.trainer.steps == 0:
                first = self._collect()  # value pre-training on the first batch, before any actor update
                self.trainer.value_pretrain(first)
            for step in range(steps):
                if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                    from .lm import TimeCapExceeded

                    raise TimeCapExceeded(f"RL loop hit its safety cap of {max_seconds:g} s at step {step} of {steps}")
                batch = self._collect()
                st = self.trainer.step(batch, self.version)
                self._since_push += int(st.get("updated", False))
                if (step + 1) % self.cfg.push_every == 0 and self._since_push:
                    st["push"] = self.push_weights()  # a step that changed nothing does not make a new version
                    self._since_push = 0
                st.update(elapsed=time.perf_counter() - t0, finished=self.finished, version=self.version,
                          batch_reward=sum(t.reward for t in batch) / len(batch))
                hist.append(st)
                if on_step:
                    on_step(st)
        finally:
            self._stop.set()
            self.engine.abort()
            if thread is not None:
                thread.join(timeout=30)
            self.engine.shutdown()
        return hist

    def _collect(self) -> list[Trajectory]:
        if self.cfg.mode == "async":
            return [self._q.get() for _ in range(self.cfg.batch_size)]
        g = self.cfg.group_size
        specs = [self._next_spec() for _ in range(max(1, self.cfg.batch_size // g))]
        specs = [s for s in specs for _ in range(g)]
        agent = Agent(EnginePolicy(self.engine), self.tok, self.sandbox, self.agent_cfg)
        trajs = asyncio.run(run_episodes(agent, specs, self.iteration, concurrency=self.cfg.in_flight))
        for t in trajs:
            self.finished += 1
            if self.on_trajectory is not None:
                self.on_trajectory(t)
        return trajs
