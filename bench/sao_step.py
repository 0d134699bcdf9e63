"""An SAO step, rollout and update of the same batch, as it ran before P and as it runs now, in one process.

    python bench/sao_step.py                 # tiny's shipped base, 8 episodes a step, 3 steps a side
    python bench/sao_step.py --batch 16 --repeat 5

Rollout: `batch` seeded episodes of the ladder's rungs (AgentConfig.seed: the same weights sample the same tokens)
on one in-process engine, rescored as SAO's rollouts are. Before: a sandboxed tool runner started per built-in tool
call, each sandbox run forked from this process, prefill budgeted in real tokens, the sparse-MLA twin masking every
call (bench/eval_levers.py's "before"); now: one tool session per episode (envs/tool_session.py), sandbox runs by
vfork through the exec shim, the prefill plan, the sparse gather. The two sides' trajectories are checked equal.
Update: `SAOTrainer.step` on that batch, each side from the same copy of the trainer (value pre-trained on the
batch first). Before: the critic scored the batch in a pass of its own, then ran its updates over consecutive rows
padded to the batch's longest; now: the advantages read the first update's forward, and the critic's micro-batches
go by length, each cut to its longest row. The before side is the current code with those two costs put back (the
scoring pass: `SAOTrainer.advantages` before the step; the old micro-batches: `_micro_batches` as lockstep ranks
still run them). Seconds are medians over `repeat` alternating runs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import time

import torch
from common import table
from eval_levers import OLD, levers

import configs
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, load_checkpoint
from rollout.agent import Agent, run_episodes
from rollout.backend import InProcessBackend
from trainers.sao import SAOTrainer


def rollout(model, specs, tok, sb, agent_cfg, sessions: bool):
    sb.supports_sessions = sessions
    backend = InProcessBackend(model, tok, n_slots=len(specs), max_len=agent_cfg.max_context + 8)

    async def go():
        async with backend.session() as policy:
            return await run_episodes(Agent(policy, tok, sb, agent_cfg), specs, concurrency=len(specs))

    try:
        t = time.perf_counter()
        trajs = asyncio.run(go())
        return time.perf_counter() - t, trajs
    finally:
        backend.close()


def old_micro_batches(tr):
    """The critic's micro-batches before P: consecutive rows at the batch's full width."""
    def batches(rows):
        n, k = len(rows.owner), tr.cfg.micro_rows
        return [(torch.arange(i, min(i + k, n)), rows.ids.shape[1]) for i in range(0, n, k)]
    return batches


def update(trainer, trajs, before: bool) -> float:
    tr = copy.deepcopy(trainer)
    if before:
        tr._micro_batches = old_micro_batches(tr)
    t = time.perf_counter()
    if before:  # the scoring pass the step made before the advantages read the first update's forward
        rows = tr._rows(tr.select(trajs, 1))
        tr.advantages(trajs, rows)
    tr.step(trajs, current_version=1)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    cfg = configs.load(a.preset)
    model = load_checkpoint(cfg.base.checkpoint)
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    specs = generate(cfg.envs.rl_patterns, a.batch, seed=5, purpose="rl")
    agent_cfg = cfg.agent.model_copy(update={"seed": 0})
    trainer = SAOTrainer(copy.deepcopy(model), cfg.sao)
    times = {"rollout": {True: [], False: []}, "update": {True: [], False: []}}
    batch = None
    for _ in range(a.repeat):
        for before in (True, False):
            with levers(() if before else tuple(OLD)):
                dt, trajs = rollout(model, specs, tok, sb, agent_cfg, sessions=not before)
            if batch is None:
                batch = trajs
                trainer.value_pretrain(batch, steps=2)
            assert [[s.tokens for s in t.segments] for t in trajs] == [[s.tokens for s in t.segments] for t in batch]
            times["rollout"][before].append(dt)
            times["update"][before].append(update(trainer, batch, before))
    med = {k: {b: statistics.median(v[b]) for b in v} for k, v in times.items()}
    rows = [[k, f"{med[k][True]:.2f}", f"{med[k][False]:.2f}", med[k][True] / med[k][False]] for k in med]
    both = {b: med["rollout"][b] + med["update"][b] for b in (True, False)}
    rows.append(["step", f"{both[True]:.2f}", f"{both[False]:.2f}", both[True] / both[False]])
    tokens = sum(t.n_trainable for t in batch)
    table(f"SAO step, {a.batch} episodes ({tokens} trainable tokens), median of {a.repeat}, seconds",
          ["", "before", "now", "×"], rows)


if __name__ == "__main__":
    main()
