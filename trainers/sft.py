"""SFT warm start on oracle trajectories of verified environments, and pass@1 evaluation.

`oracle_trajectories` replays each spec's reference solution through the real environment with the
agent loop, so the SFT data has exactly the token layout RL will see (chat template, observations,
end markers); the loss is on the policy's own tokens only. `evaluate` runs greedy episodes with the
in-process engine and reports pass@1 per family and per domain.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Iterator

import torch

from envs import TaskSpec
from envs.sandbox import Sandbox
from model import Transformer
from model.tokenizer import Tokenizer
from rollout.agent import Agent, AgentConfig, ScriptedPolicy, run_episodes
from rollout.backend import InProcessBackend
from rollout.types import Trajectory


def replay_trajectories(specs: list[TaskSpec], actions: list[list[str]], tok: Tokenizer, sandbox: Sandbox,
                        cfg: AgentConfig, concurrency: int = 4) -> list[Trajectory]:
    """Each spec's episode with the given rendered tool calls, through the real environment and agent loop."""
    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one(spec, acts):
            async with sem:
                return await Agent(ScriptedPolicy(tok, acts), tok, sandbox, cfg).run(spec)

        return await asyncio.gather(*(one(s, a) for s, a in zip(specs, actions, strict=True)))

    return asyncio.run(main())


def oracle_trajectories(specs: list[TaskSpec], tok: Tokenizer, sandbox: Sandbox, cfg: AgentConfig,
                        concurrency: int = 4) -> list[Trajectory]:
    trajs = replay_trajectories(specs, [s.reference for s in specs], tok, sandbox, cfg, concurrency)
    return [t for t in trajs if t.reward == 1.0]


def sloppy_trajectories(specs: list[TaskSpec], tok: Tokenizer, sandbox: Sandbox, cfg: AgentConfig,
                        concurrency: int = 4) -> list[Trajectory]:
    """Each spec's episode by its family's careless demonstrator (`Family.sloppy`). Every one must complete and
    earn nothing: a sloppy demonstration that earns the reward is not a mistake (ValueError, naming the task)."""
    from envs.families import get_family

    acts = []
    for s in specs:
        fam = get_family(s.family)
        got = fam.sloppy(s.public(), s.hidden)
        if got is None:
            raise ValueError(f"base.curriculum: sloppy:{s.family}: the family has no careless demonstrator "
                             "(Family.sloppy)")
        acts.append([a.render() for a in got])
    trajs = replay_trajectories(specs, acts, tok, sandbox, cfg, concurrency)
    for s, t in zip(specs, trajs):
        if t.status != "completed" or t.reward != 0.0:
            raise ValueError(f"base.curriculum: the careless demonstration of {s.id} ({s.family}) ended "
                             f"{t.status} with reward {t.reward}: it must complete and earn nothing (with a one-hop "
                             "chain or no step to skip it is the oracle's own solution)")
    return trajs


def pad_segments(segs: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T], target mask [B, T]) of segments, right-padded to the longest."""
    width = max(len(s.tokens) for s in segs)
    ids = torch.full((len(segs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(segs), width, dtype=torch.bool)
    for i, s in enumerate(segs):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[i, : len(s.tokens)] = torch.tensor(s.loss_mask)
    return ids, mask


def pattern_key(spec: TaskSpec) -> str:
    """The pattern a spec was generated from, in `family?k=v&…` form (knobs sorted)."""
    return spec.family + "?" + "&".join(f"{k}={v}" for k, v in sorted(spec.knobs.items()))


def sft_batches(trajs: list[Trajectory], batch_size: int, pad_id: int, seed: int = 0
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled batches of segments: (ids [B, T], target mask [B, T]) right-padded."""
    segs = [s for t in trajs for s in t.segments if any(s.loss_mask)]
    if not segs:
        raise ValueError("no trainable segments in the SFT data")
    rng = random.Random(seed)
    while True:
        yield pad_segments([segs[rng.randrange(len(segs))] for _ in range(batch_size)], pad_id)


def evaluate(model: Transformer | None, specs: list[TaskSpec], tok: Tokenizer, sandbox: Sandbox, cfg: AgentConfig,
             n_slots: int = 8, concurrency: int = 8, backend=None, on_done=None, compile_decode: bool = False) -> dict:
    """Greedy pass@1 per family and per domain (plus the trajectories, for inspection). The episodes run on
    `backend` (a RolloutBackend already serving the policy: servers by URL), else on an in-process engine
    over `model`. `on_done(trajectory)` is called as each episode finishes (a progress bar). Segments are not
    rescored (`AgentConfig.rescore`): no trainer reads an evaluation's log-probs, and the scoring forward was about
    half of an evaluation's engine time (bench/iteration_profile.py). `compile_decode`: the in-process engine's decode
    step compiled (rollout/compiled.py; it decodes eagerly until the compile, in its own thread, is ready)."""
    own = backend is None
    if own:
        backend = InProcessBackend(model, tok, n_slots=n_slots, max_len=cfg.max_context + 8,
                                   compile_decode=compile_decode)

    async def go():
        async with backend.session() as policy:
            agent = Agent(policy, tok, sandbox, cfg.model_copy(update={"temperature": 0.0, "rescore": False}))
            return await run_episodes(agent, specs, concurrency=concurrency, on_done=on_done)

    try:
        trajs = asyncio.run(go())
    finally:
        if own:
            backend.close()
    fam, dom, pat = defaultdict(list), defaultdict(list), defaultdict(list)
    for s, t in zip(specs, trajs):
        fam[s.family].append(t.reward)
        dom[s.domain].append(t.reward)
        pat[pattern_key(s)].append(t.reward)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"pass@1": mean([t.reward for t in trajs]), "family": {k: mean(v) for k, v in fam.items()},
            "domain": {k: mean(v) for k, v in dom.items()}, "pattern": {k: mean(v) for k, v in pat.items()},
            "trajectories": trajs}
