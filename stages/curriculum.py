"""The frontier curriculum: which patterns iteration N's RL set draws, chosen from what the policy it trains can do.

SAO trains on one rollout per task and learns where its samples disagree: a pattern the policy always solves, or
never does, gives no signal (bench/headroom.py measures it). So before the RL set is drawn, the policy iteration N
starts from (what iteration N−1 handed off; the shipped base for iteration 1) samples `probe_samples` episodes on
each of `probe_tasks` fresh probe tasks of every pattern of the ladder (`envs.rl_patterns`). Per pattern:

* sampled success s, the share of tasks whose samples both succeed and fail (mixed), and the expected signal: the
  mean over tasks of the unbiased estimate of the task's reward variance, c(k − c) / (k(k − 1)) for c successes in k
  samples (what one rollout per task can learn from, before the critic's baseline);
* **saturated** (s ≥ `saturated`): it gives way to the next rung, keeping `retain_tasks` tasks (default 0), which an
  expert whose warm rollouts of them all succeed leaves out of its SAO steps (`constant_patterns`) and, with
  `sao.replay_coef` > 0, anchors on;
* **signal**: its share of the RL set is proportional to its signal;
* **constant per task** (0 < s, no task mixed): `frontier_share`, as the critic can still tell tasks apart;
* **frontier** (s = 0, the lowest such rung of its family above a rung the policy solves at all): `frontier_share`,
  so a rung within reach is tried before the one below saturates;
* **out of reach** (s = 0 and not the frontier): left out.

The probe tasks are training-side data (purpose "curriculum-probe"): none is a held-out or validation task. The
choice, with every pattern's figures and the reason, is the `env_specs` asset's metadata.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from .common import _quiet


def sample_rewards(model, specs: list, k: int, cfg, tok, sb, n_slots: int = 16, on_done=None) -> list[list[float]]:
    """Each task's k rewards, the agent sampling at its configured temperature (the k-th rollout of a task samples
    its own stream, as GRPO groups do). `on_done(trajectory)`: called as each episode finishes."""
    from rollout.agent import Agent, run_episodes
    from rollout.backend import InProcessBackend

    backend = InProcessBackend(model, tok, n_slots=n_slots, max_len=cfg.agent.max_context + 8,
                               compile_decode=cfg.loop.compile_decode)

    async def go():
        async with backend.session() as policy:
            agent = Agent(policy, tok, sb, cfg.agent.model_copy(update={"rescore": False}))  # only rewards are read
            return await run_episodes(agent, [s for s in specs for _ in range(k)], concurrency=n_slots,
                                      on_done=on_done)

    try:
        trajs = asyncio.run(go())
    finally:
        backend.close()
    return [[t.reward for t in trajs[i * k:(i + 1) * k]] for i in range(len(specs))]


def pattern_figures(rewards: list[list[float]]) -> dict:
    """A pattern's probe figures from its tasks' k rewards each (reward ≥ 0.5 solves)."""
    k = len(rewards[0])
    c = [sum(r >= 0.5 for r in rs) for rs in rewards]
    n = len(c)
    return {"tasks": n, "samples": k, "sampled": sum(c) / (n * k), "mixed": sum(0 < x < k for x in c) / n,
            "signal": sum(x * (k - x) for x in c) / (n * k * (k - 1)), "solved_any": sum(x > 0 for x in c) / n}


def _family(pattern: str) -> str:
    return pattern.partition("?")[0]


def choose_mix(figures: dict[str, dict], ladder: list[str], n_rl: int, cc) -> tuple[dict[str, int], dict[str, dict]]:
    """The RL set's tasks per pattern, and why each pattern got its share (`figures`: pattern -> `pattern_figures`;
    `ladder`: the patterns in rung order within each family; `cc`: `envs.curriculum`)."""
    why: dict[str, dict] = {}
    reached: dict[str, bool] = defaultdict(bool)  # a lower rung of the family has any success
    frontier_taken: set[str] = set()
    for p in ladder:
        f, fam = figures[p], _family(p)
        if f["sampled"] >= cc.saturated:
            why[p] = {"choice": "saturated", "weight": 0.0,
                      "why": f"its samples succeed {f['sampled']:.2f} ≥ {cc.saturated}: gives way to the next rung"}
        elif f["signal"] > 0:
            why[p] = {"choice": "signal", "weight": f["signal"],
                      "why": f"{f['mixed']:.2f} of its tasks have samples that succeed and fail"}
        elif f["sampled"] > 0:
            why[p] = {"choice": "constant per task", "weight": None,
                      "why": f"succeeds on {f['solved_any']:.2f} of tasks, every task's samples agree"}
        elif reached[fam] and fam not in frontier_taken:
            frontier_taken.add(fam)
            why[p] = {"choice": "frontier", "weight": None,
                      "why": "no sample succeeds yet; the first unsolved rung above one the policy reaches"}
        else:
            why[p] = {"choice": "out of reach", "weight": 0.0,
                      "why": "no sample succeeds, and a lower rung of its family is not reached yet"}
        reached[fam] = reached[fam] or f["sampled"] > 0
    fixed = [p for p in ladder if why[p]["weight"] is None]
    weighted = {p: why[p]["weight"] for p in ladder if why[p]["weight"]}
    retained: dict[str, int] = {}
    if not fixed and not weighted:  # nothing has signal: an even mix of what is not saturated, said so
        rest = [p for p in ladder if why[p]["choice"] != "saturated"] or list(ladder)
        for p in rest:
            why[p].update(choice="fallback", why=why[p]["why"] + "; no pattern has signal: an even mix")
        weighted = dict.fromkeys(rest, 1.0)
    elif cc.retain_tasks:  # saturated rungs keep a few tasks: the experts' replay anchor against forgetting them
        retained = {p: cc.retain_tasks for p in ladder if why[p]["choice"] == "saturated"}
        for p in retained:
            why[p]["why"] += f"; keeps {cc.retain_tasks} tasks (retain_tasks) for the experts to replay"
    n_fixed = max(cc.min_tasks, int(cc.frontier_share * n_rl)) if fixed else 0  # (fits: EnvConfig's check)
    if fixed and not weighted:  # only frontier or constant rungs: they share what retention leaves
        n_fixed = (n_rl - sum(retained.values())) // len(fixed)
    budget = n_rl - n_fixed * len(fixed) - sum(retained.values())
    if budget < cc.min_tasks * len(weighted):
        raise ValueError(f"envs.n_rl = {n_rl} is too small for the curriculum's {len(fixed)} fixed-share and "
                         f"{len(weighted)} signal patterns (envs.curriculum.min_tasks = {cc.min_tasks})")
    counts = dict.fromkeys(fixed, n_fixed) | retained
    if not weighted:
        for p in fixed[:budget]:  # what an even split leaves
            counts[p] += 1
        weighted, budget = {}, 0
    total = sum(weighted.values()) or 1.0
    raw = {p: cc.min_tasks + (budget - cc.min_tasks * len(weighted)) * w / total for p, w in weighted.items()}
    base = {p: int(v) for p, v in raw.items()}
    left = budget - sum(base.values())
    for p in sorted(raw, key=lambda q: (raw[q] - base[q], q), reverse=True)[:left]:  # largest remainder
        base[p] += 1
    counts.update(base)
    for p in ladder:
        why[p]["tasks"] = counts.get(p, 0)
        why[p]["expected_signal"] = figures[p]["signal"]
    return {p: counts[p] for p in ladder if counts.get(p)}, why


def interleave(per: dict[str, list]) -> list:
    """The patterns' tasks in one list, each pattern spread evenly through it (so every batch is a mix)."""
    keyed = [((i + 0.5) / len(v), j, s) for j, v in enumerate(per.values()) for i, s in enumerate(v)]
    return [s for _, _, s in sorted(keyed, key=lambda x: (x[0], x[1]))]


def probe(cfg, checkpoint: str, ladder: list[str], seed: int, exclude: set[str], log=_quiet) -> tuple[dict, list]:
    """The policy at `checkpoint` sampled on `cfg.envs.curriculum.probe_tasks` fresh tasks of each ladder pattern
    (none of them in `exclude`, by content). Returns ({pattern: figures}, the probe tasks)."""
    from envs.generator import generate_disjoint
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint

    cc = cfg.envs.curriculum
    specs: list = []
    per: dict[str, list] = {}
    for p in ladder:
        got, _ = generate_disjoint([p], cc.probe_tasks, seed, "curriculum-probe", exclude)
        per[p] = got
        specs += got
    rewards = sample_rewards(load_checkpoint(checkpoint), specs, cc.probe_samples, cfg, ByteTokenizer(),
                             make_sandbox(cfg.envs.sandbox), n_slots=cfg.loop.batch_in_flight)
    out, i = {}, 0
    for p in ladder:
        out[p] = pattern_figures(rewards[i:i + len(per[p])])
        i += len(per[p])
        log(f"curriculum probe {p}: sampled {out[p]['sampled']:.2f}, mixed {out[p]['mixed']:.2f}")
    return out, specs
