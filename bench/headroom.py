"""Where RL can still gain: per held-out pattern, a policy's greedy pass@1 beside what its own samples find.

    python bench/headroom.py checkpoints/tiny-base runs/pipeline/iteration-0001/student/checkpoint --k 8

SAO trains on one rollout per task, sampled at the agent's temperature (`agent.temperature`), and learns only where
those samples disagree: a pattern whose samples never succeed gives every advantage the same sign, one whose
samples always succeed leaves nothing to gain. For each checkpoint and each pattern of the pipeline's held-out set
(`envs.n_eval` tasks, `envs.eval_seed`: the tasks the pipeline evaluates on), the table gives

- greedy pass@1 with its 95% Wilson interval (what the pipeline's evaluation measures);
- sampled pass@1: the mean success of `--k` samples per task (what SAO's rollouts earn);
- pass@k: the share of tasks that at least one of the k samples solves, with its 95% Wilson interval;
- mixed: the share of tasks whose k samples both succeed and fail, where a single rollout carries signal.

A pattern with pass@k near 0 is out of reach of RL at this sampling budget (its samples never find a success); one
with greedy pass@1 near pass@k has little left that sampling finds. Both sides run in this process, on the same
tasks and the same sampling seeds (`agent.seed`).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from common import progress, table

from configs import load
from trainers.stats import wilson

BASE = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-base"


def sampled(model, specs: list, k: int, cfg, tok, sb, n_slots: int = 16, on_done=None) -> list[list[float]]:
    """Each task's k rewards (the curriculum's probe: `stages.curriculum.sample_rewards`)."""
    from stages.curriculum import sample_rewards

    return sample_rewards(model, specs, k, cfg, tok, sb, n_slots, on_done=on_done)


def headroom(greedy: list[float], samples: list[list[float]]) -> dict:
    """One group's figures from its tasks' greedy rewards and k sampled rewards each (reward ≥ 0.5 solves)."""
    n, k = len(greedy), len(samples[0])
    solved = [sum(r >= 0.5 for r in rs) for rs in samples]
    g = sum(r >= 0.5 for r in greedy)
    anyk = sum(c > 0 for c in solved)
    return {"n": n, "greedy": g / n, "greedy_ci": wilson(g, n), "sampled": sum(solved) / (n * k),
            "pass_at_k": anyk / n, "pass_at_k_ci": wilson(anyk, n),
            "mixed": sum(0 < c < k for c in solved) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="*", default=[str(BASE)])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--k", type=int, default=8, help="samples per task")
    ap.add_argument("--n", type=int, default=None, help="held-out tasks (default: the preset's envs.n_eval)")
    ap.add_argument("-o", "--override", action="append", default=[], help="a config override (key=value)")
    a = ap.parse_args()
    if a.k < 1:
        raise SystemExit(f"--k must be at least 1, got {a.k}")

    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from stages.env_sets import held_out
    from trainers.sft import evaluate

    cfg = load(a.preset, a.override)
    specs = held_out(cfg.envs.model_copy(update={"n_eval": a.n or cfg.envs.n_eval}), cfg.base)[0]  # the pipeline's
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    rows = []
    with progress("headroom episodes", len(a.checkpoints) * len(specs) * (1 + a.k)) as bar:
        for ck in a.checkpoints:
            bar.note(Path(ck).name)
            model = load_checkpoint(ck)
            greedy = [t.reward for t in evaluate(model, specs, tok, sb, cfg.agent, on_done=bar)["trajectories"]]
            samples = sampled(model, specs, a.k, cfg, tok, sb, on_done=bar)
            rows += _rows(ck, a, specs, greedy, samples)
    table(f"headroom: greedy pass@1 vs {a.k} samples per task at temperature {cfg.agent.temperature}",
          ["checkpoint", "pattern / domain", "n", "greedy pass@1 [95% CI]", "sampled pass@1",
           f"pass@{a.k} [95% CI]", "mixed"], rows)


def _rows(ck: str, a, specs: list, greedy: list[float], samples: list[list[float]]) -> list[list]:
    """One checkpoint's table rows: every pattern, every domain and all."""
    from trainers.sft import pattern_key

    rows = []
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(specs):
        groups[pattern_key(s)].append(i)
    for i, s in enumerate(specs):
        groups[s.domain].append(i)
    groups["all"] = list(range(len(specs)))
    for name, idx in groups.items():
        h = headroom([greedy[i] for i in idx], [samples[i] for i in idx])
        rows.append([Path(ck).name if len(a.checkpoints) == 1 else ck, name, h["n"],
                     f"{h['greedy']:.3f} [{h['greedy_ci'][0]:.2f}, {h['greedy_ci'][1]:.2f}]", h["sampled"],
                     f"{h['pass_at_k']:.3f} [{h['pass_at_k_ci'][0]:.2f}, {h['pass_at_k_ci'][1]:.2f}]",
                     h["mixed"]])
    return rows


if __name__ == "__main__":
    main()
