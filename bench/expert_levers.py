"""One domain's SAO expert from the shipped base under a list of override sets, each against the base on the same
fresh held-out tasks of that domain (more of them than the pipeline's 80 per domain, for power).

    python bench/expert_levers.py --domain reasoning --lever default --lever "loop.steps=20" \
        --lever "sao.lr=4e-4 loop.steps=20" --n-eval 240

The environments (`tiny`'s RL set, gated) and the base's rollouts of them are made once under `--work` and reused by
every lever, as the pipeline's `rollout_batches` makes them: each lever's expert pre-trains its critic on them, then
runs `loop.steps` SAO steps on its in-process engine (`stages.sao_expert`, the pipeline's own stage function). The
held-out tasks are fresh instances of the domain's `eval_patterns` (seed `--eval-seed`); greedy pass@1 with a 95%
Wilson interval, the tasks that flipped each way and the exact McNemar p-value against the base.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from common import table

import stages
from configs import load
from trainers.stats import compare, wilson

BASE = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-base"


def prepare(work: Path, say) -> tuple[dict, dict]:
    """(envs, {trajectory id: domain}) of the base's rollouts on the gated RL set, made once under `work`."""
    from rollout.backend import embedded_servers

    cfg = load("tiny")
    done = work / "prepared.json"
    if done.exists():
        d = json.loads(done.read_text())
        return d["envs"], d["rollouts"]
    t = time.perf_counter()
    envs = stages.verified_envs(cfg, stages.env_specs(cfg, work / "envs", 1), work / "verified")
    with embedded_servers(cfg.model, n=1, n_slots=cfg.loop.n_slots, max_len=cfg.agent.max_context + 8,
                          seed=cfg.seed) as urls:
        ro = stages.rollout_batches(cfg, str(BASE), envs, work / "store.duckdb", 1, urls)
    scored = stages.rewards(work / "store.duckdb", 1, ro["trajectory_ids"])
    rollouts = {i: d for d, v in scored["domains"].items() for i in v["ids"]}
    done.write_text(json.dumps({"envs": envs, "rollouts": rollouts}, default=str))
    say(f"prepared {envs['accepted']} environments and their base rollouts in {time.perf_counter() - t:.0f} s: "
        + ", ".join(f"{d} {v['mean_reward']:.3f}" for d, v in scored["domains"].items()))
    return envs, rollouts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", required=True, choices=["code", "math", "reasoning"])
    ap.add_argument("--lever", action="append", required=True,
                    help='space-separated overrides, or "default" (repeat the flag for each lever)')
    ap.add_argument("--n-eval", type=int, default=240)
    ap.add_argument("--eval-seed", type=int, default=777)
    ap.add_argument("--work", default="runs/expert_levers")
    a = ap.parse_args()
    from envs.generator import generate
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from trainers.sft import evaluate

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    envs, rollouts = prepare(work, print)
    cfg0 = load("tiny")
    fams = {"code": ("set-const",), "math": ("calc-chain",), "reasoning": ("kv-lookup",)}[a.domain]
    held = generate([p for p in cfg0.envs.eval_patterns if p.split("?")[0] in fams], a.n_eval, a.eval_seed)
    tok, sb = ByteTokenizer(), make_sandbox(cfg0.envs.sandbox)
    base = [t.reward for t in evaluate(load_checkpoint(BASE), held, tok, sb, cfg0.agent)["trajectories"]]
    lo, hi = wilson(int(sum(base)), len(base))
    rows = [["base", "", f"{sum(base) / len(base):.3f} [{lo:.2f}, {hi:.2f}]", "", "", "", ""]]
    ids = [i for i, d in rollouts.items() if d == a.domain]
    for lever in a.lever:
        ov = [] if lever == "default" else lever.split()
        cfg = load("tiny", ov)
        out = work / "levers" / f"{a.domain}-{abs(hash(lever)) % 10**8}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copy(work / "store.duckdb", out / "store.duckdb")  # each lever writes its own copy of the store
        t = time.perf_counter()
        r = stages.sao_expert(cfg, str(BASE), envs, a.domain, out / "expert", domain_reward=None, iteration=1,
                              store_path=out / "store.duckdb", warm_rollouts=ids)
        secs = time.perf_counter() - t
        after = [t.reward for t in evaluate(load_checkpoint(r["checkpoint"]), held, tok, sb, cfg.agent)["trajectories"]]
        test = compare({a.domain: base}, {a.domain: after})[a.domain]["test"]
        lo, hi = wilson(int(sum(after)), len(after))
        rows.append([lever, str(r["steps"]), f"{sum(after) / len(after):.3f} [{lo:.2f}, {hi:.2f}]",
                     f"{test['delta']:+.3f} [{test['delta_ci95'][0]:+.3f}, {test['delta_ci95'][1]:+.3f}]",
                     f"{test['gained']} / {test['lost']}", f"{test['p_value']:.3f}", f"{secs:.0f}"])
        print(json.dumps({"domain": a.domain, "lever": lever, "steps": r["steps"], "skipped": r.get("skipped"),
                          "after": after, "base": base, "test": test}), flush=True)
    table(f"{a.domain} expert vs the base, {len(held)} paired held-out tasks (greedy)",
          ["lever", "SAO steps", "pass@1 [95% CI]", "Δ [95% CI]", "gained / lost", "p (exact McNemar)", "SAO s"], rows)


if __name__ == "__main__":
    main()
