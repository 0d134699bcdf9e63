"""Why math does not learn: where a policy's calculator chains fail, and whether attention's sparsity is the cause.

    python bench/math_levers.py checkpoints/tiny-base --n 30

For each rung of `calc-chain` (1–4 operations), `--n` fresh tasks (purpose "math-levers": no held-out task) are played
greedily by the checkpoint twice in this process: as trained (DSA: each query attends to the indexer's top
`index_topk` keys) and with attention made dense at inference (`index_topk` above any context). Every failure is
classified from its tool calls:

- **copy**: a calc expression does not start from the value the chain is at (the start, or the last result);
- **operand**: it starts right but applies another operation or number than the instruction's next one;
- **early**: it submits the value it has before the last operation (the careless demonstrator's way);
- **submit**: the calls are right, the submitted number is not the last result;
- **other**: no call parses, or the episode ends without a submission.

The table gives pass@1 per rung for both variants, paired (the tasks that flipped each way, exact McNemar p), and
the failure classes: a large `copy` or `submit` share that dense attention removes names the indexer.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

from common import progress, table

from configs import load
from trainers.stats import mcnemar_exact

OPS = {"add": "+", "sub": "-", "mul": "*"}


def classify(hidden: dict, acts: list) -> str:
    """The failure class of a failed calc-chain episode (see the module docstring)."""
    calcs = [a.args.get("expr", "") for a in acts if a.tool == "calc"]
    subs = [a.args.get("answer", "") for a in acts if a.tool == "submit"]
    if not subs:
        return "other"
    v = hidden["start"]
    for i, expr in enumerate(calcs):
        m = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", expr)
        if not m:
            return "other"
        if int(m.group(1)) != v:
            return "copy"
        if i >= len(hidden["steps"]):
            return "operand"
        op, n = hidden["steps"][i]
        if m.group(2) != OPS[op] or int(m.group(3)) != n:
            return "operand"
        v = v + n if op == "add" else v - n if op == "sub" else v * n
    if len(calcs) < len(hidden["steps"]):
        return "early"
    return "submit"


def play(model, specs, cfg, tok, sb, on_done=None) -> list:
    from trainers.sft import evaluate

    return evaluate(model, specs, tok, sb, cfg.agent, concurrency=cfg.loop.batch_in_flight,
                    on_done=on_done)["trajectories"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--n", type=int, default=30, help="tasks per rung")
    ap.add_argument("-o", "--override", action="append", default=[])
    a = ap.parse_args()

    from envs.generator import generate_disjoint, task_content
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from stages.env_sets import held_out
    from stages.rollouts import trajectory_actions

    cfg = load(a.preset, a.override)
    held = {task_content(s) for s in held_out(cfg.envs, cfg.base)[0]}
    rungs = [f"calc-chain?horizon={h}" for h in (1, 2, 3, 4)]
    specs = {r: generate_disjoint([r], a.n, 0, "math-levers", held)[0] for r in rungs}
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    model = load_checkpoint(a.checkpoint)
    trained_k = model.config.index_topk
    every = [s for r in rungs for s in specs[r]]
    with progress("calc-chain episodes", 2 * len(every)) as bar:
        bar.note("as trained")
        out = {"as trained": play(model, every, cfg, tok, sb, bar)}
        model.config.index_topk = 1 << 20  # dense: every query keeps every key (the layers read the same config)
        bar.note("dense")
        out["dense"] = play(model, every, cfg, tok, sb, bar)
    rows = []
    for r in rungs:
        idx = [i for i, s in enumerate(every) if s.id in {x.id for x in specs[r]}]
        res = {}
        for name, trajs in out.items():
            fails = Counter(classify(every[i].hidden, trajectory_actions(trajs[i])) for i in idx
                            if trajs[i].reward < 0.5)
            res[name] = ([trajs[i].reward for i in idx], fails)
        t = mcnemar_exact(res["as trained"][0], res["dense"][0])
        rows.append([r, len(idx)] + [f"{sum(x >= 0.5 for x in res[n][0]) / len(idx):.2f}" for n in out]
                    + [f"{t['gained']} / {t['lost']}", f"{t['p_value']:.3f}"]
                    + [", ".join(f"{k} {v}" for k, v in sorted(res[n][1].items())) or "–" for n in out])
    table(f"calc-chain failures of {a.checkpoint} (index_topk {trained_k} as trained vs dense attention)",
          ["rung", "n", "pass@1 as trained", "pass@1 dense", "dense gains / loses", "p (McNemar)",
           "failures as trained", "failures dense"], rows)


if __name__ == "__main__":
    main()
