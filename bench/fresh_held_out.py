"""Held-out sets the project never generated: does a gain measured on the fixed held-out set hold on them?

    python bench/fresh_held_out.py checkpoints/tiny-base runs/chain/iteration-0001/student/checkpoint --seeds 1 2

For each `--seeds` value, a fresh set of the held-out patterns (`envs.held_out_patterns`, `envs.n_eval` tasks) is
drawn under its own purpose ("fresh-held-out"), so no project set shares its seeds, and it excludes by content every
task of the pipeline's held-out set and of the base recipe: these tasks were never trained on, evaluated or used in a
decision. Both checkpoints play every set greedily in this process; the table compares them paired per domain and
overall (Wilson intervals, the paired difference with its 95% interval, exact McNemar), per seed and pooled. A gain
on the fixed held-out set is general if these agree with it within their intervals.
"""

from __future__ import annotations

import argparse

from common import progress, table

from configs import load
from trainers.stats import compare


def fresh_sets(cfg, seeds: list[int]) -> dict[int, list]:
    """Per seed, `n_eval` tasks of the held-out patterns, disjoint by content from the held-out set and the base
    recipe's data (and from each other's earlier seeds)."""
    from envs.generator import generate_disjoint, task_content
    from stages.env_sets import base_recipe_contents, held_out

    seen = {task_content(s) for s in held_out(cfg.envs, cfg.base)[0]} | set(base_recipe_contents(cfg.base))
    out = {}
    for seed in seeds:
        out[seed] = generate_disjoint(cfg.envs.held_out_patterns, cfg.envs.n_eval, seed, "fresh-held-out", seen)[0]
        seen |= {task_content(s) for s in out[seed]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="checkpoint of the policy an iteration started from")
    ap.add_argument("after", help="checkpoint it produced")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[])
    a = ap.parse_args()

    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from trainers.sft import evaluate

    cfg = load(a.preset, a.override)
    sets = fresh_sets(cfg, a.seeds)
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    every = [s for seed in a.seeds for s in sets[seed]]
    rewards = {}
    with progress("fresh held-out episodes", 2 * len(every)) as bar:
        for side, ckpt in (("before", a.before), ("after", a.after)):
            bar.note(side)
            ev = evaluate(load_checkpoint(ckpt), every, tok, sb, cfg.agent, concurrency=cfg.loop.batch_in_flight,
                          on_done=bar)
            rewards[side] = [t.reward for t in ev["trajectories"]]
    rows = []
    groups, start = [], 0
    for seed in a.seeds:  # `every` is the sets in seed order
        groups.append((f"seed {seed}", list(range(start, start + len(sets[seed])))))
        start += len(sets[seed])
    for label, idx in [*groups, ("pooled", list(range(len(every))))]:
        by = {side: {} for side in rewards}
        for i in idx:
            for side in rewards:
                by[side].setdefault(every[i].domain, []).append(rewards[side][i])
        for g, v in compare(by["before"], by["after"]).items():
            t = v["test"]
            rows.append([label, g, t["n"], f"{v['before']['pass@1']:.3f}", f"{v['after']['pass@1']:.3f}",
                         f"{t['delta']:+.3f} [{t['delta_ci95'][0]:+.3f}, {t['delta_ci95'][1]:+.3f}]",
                         f"{t['gained']} / {t['lost']}", f"{t['p_value']:.4f}"])
    table(f"fresh held-out sets (seeds {a.seeds}): {a.after} against {a.before}",
          ["set", "group", "n", "before", "after", "Δ [95% CI]", "gained / lost", "p (McNemar)"], rows)


if __name__ == "__main__":
    main()
