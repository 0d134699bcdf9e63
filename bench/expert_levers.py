"""One domain's SAO expert from a warm start (the shipped base by default) under a list of override sets, each against
the warm start on the same held-out tasks, greedy, paired.

    python bench/expert_levers.py --domain reasoning --lever default --lever "loop.steps=20" \
        --lever "sao.lr=4e-4 loop.steps=20" --n-eval 240

The environments (`tiny`'s RL set of `--iteration`, gated) and the warm start's rollouts of them are made once under
`--work` and reused by every lever, as the pipeline's `rollout_batches` makes them: each lever's expert pre-trains its
critic on them, then runs `loop.steps` SAO steps on its in-process engine (`stages.sao_expert`, the pipeline's own
stage function). The held-out tasks are fresh instances of the domain's `eval_patterns` (seed `--eval-seed`,
`--n-eval` of them); with `--all-domains`, the pipeline's own held-out set instead (`envs.n_eval`, every domain), so
a lever's cost on the domains the expert does not train on shows too. Greedy pass@1 with a 95% Wilson interval, the
tasks that flipped each way and the exact McNemar p-value against the warm start.

Iteration 2 of `make run` (its warm start is iteration 1's student), every domain measured:

    python bench/expert_levers.py --domain reasoning --warm runs/pipeline/iteration-0001/student/checkpoint \
        --iteration 2 --all-domains --work runs/levers-it2 --lever default --lever "sao.kl_coef=0.2"

`--interpolate 0.3,0.5,0.7` also scores each lever's expert pulled back toward its warm start in weight space,
warm + a·(expert − warm) (WiSE-FT), on the same tasks.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path

from common import table

import stages
from configs import load
from trainers.stats import compare, wilson

BASE = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-base"


def prepare(work: Path, say, warm: Path = BASE, iteration: int = 1, overrides: list[str] | None = None
            ) -> tuple[dict, dict]:
    """(envs, {trajectory id: domain}) of the warm start's rollouts on the gated RL set of `iteration`, made once
    under `work`; the curriculum, when on, probes the warm start (the pipeline's probes what iteration N−1 handed
    off). `overrides` change the environments themselves (`envs.rl_patterns=[...]`: a curriculum)."""
    from rollout.backend import embedded_servers

    cfg = load("tiny", overrides or [])
    done = work / "prepared.json"
    key = {"warm": str(warm.resolve()), "iteration": iteration, **({"prepare": overrides} if overrides else {})}
    if done.exists():
        d = json.loads(done.read_text())
        if d.get("key", {"warm": str(BASE.resolve()), "iteration": 1}) != key:
            raise SystemExit(f"{work} was prepared for another warm start or iteration ({d.get('key')}): "
                             "give another --work")
        return d["envs"], d["rollouts"]
    t = time.perf_counter()
    specs = stages.env_specs(cfg, work / "envs", iteration, parent_checkpoint=str(warm))
    envs = stages.verified_envs(cfg, specs, work / "verified")
    with embedded_servers(cfg.model, n=1, n_slots=cfg.loop.n_slots, max_len=cfg.agent.max_context + 8,
                          seed=cfg.seed) as urls:
        ro = stages.rollout_batches(cfg, str(warm), envs, work / "store.duckdb", iteration, urls)
    scored = stages.rewards(work / "store.duckdb", iteration, ro["trajectory_ids"])
    rollouts = {i: d for d, v in scored["domains"].items() for i in v["ids"]}
    done.write_text(json.dumps({"envs": envs, "rollouts": rollouts,
                                "key": key}, default=str))
    say(f"prepared {envs['accepted']} environments and their warm start's rollouts in {time.perf_counter() - t:.0f} s: "
        + ", ".join(f"{d} {v['mean_reward']:.3f}" for d, v in scored["domains"].items()))
    return envs, rollouts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", required=True, choices=["code", "math", "reasoning"])
    ap.add_argument("--lever", action="append", required=True,
                    help='space-separated overrides, or "default" (repeat the flag for each lever)')
    ap.add_argument("--warm", default=str(BASE), help="the checkpoint the expert starts from (default: the base)")
    ap.add_argument("--iteration", type=int, default=1, help="whose RL set (fresh per iteration) to train on")
    ap.add_argument("--all-domains", action="store_true",
                    help="score on the pipeline's held-out set, every domain, instead of fresh tasks of --domain")
    ap.add_argument("--prepare", action="append", default=[],
                    help="an override of the RL set (envs.rl_patterns=[...]); the held-out set is unchanged")
    ap.add_argument("--n-eval", type=int, default=240)
    ap.add_argument("--eval-seed", type=int, default=777)
    ap.add_argument("--work", default="runs/expert_levers")
    ap.add_argument("--interpolate", default="",
                    help="comma-separated a in (0, 1): also score warm + a·(expert − warm) of each lever (WiSE-FT)")
    a = ap.parse_args()
    import torch

    from envs.dataset import read_dataset
    from envs.generator import generate
    from envs.sandbox import make_sandbox
    from model import ByteTokenizer, load_checkpoint
    from trainers.opd import merge_experts
    from trainers.sft import evaluate

    work, warm = Path(a.work), Path(a.warm)
    work.mkdir(parents=True, exist_ok=True)
    envs, rollouts = prepare(work, print, warm, a.iteration, a.prepare)
    cfg0 = load("tiny")
    if a.all_domains:
        held = read_dataset(envs["eval"])
    else:
        fams = {"code": ("set-const",), "math": ("calc-chain",), "reasoning": ("kv-lookup",)}[a.domain]
        held = generate([p for p in cfg0.envs.eval_patterns if p.split("?")[0] in fams], a.n_eval, a.eval_seed)
    domains = sorted({s.domain for s in held}, key=lambda d: (d != a.domain, d))  # the trained domain first
    tok, sb = ByteTokenizer(), make_sandbox(cfg0.envs.sandbox)

    def by_domain(ckpt) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {d: [] for d in domains}
        model = ckpt if isinstance(ckpt, torch.nn.Module) else load_checkpoint(ckpt)
        for s, t in zip(held, evaluate(model, held, tok, sb, cfg0.agent)["trajectories"]):
            out[s.domain].append(t.reward)
        return out

    def cell(xs) -> str:
        lo, hi = wilson(int(sum(xs)), len(xs))
        return f"{sum(xs) / len(xs):.3f} [{lo:.2f}, {hi:.2f}]"

    base = by_domain(warm)
    rows = [["warm start", "", *(cell(base[d]) for d in domains), "", "", ""]]
    ids = [i for i, d in rollouts.items() if d == a.domain]
    for lever in a.lever:
        ov = [] if lever == "default" else lever.split()
        cfg = load("tiny", ov)
        out = work / "levers" / f"{a.domain}-{abs(hash(lever)) % 10**8}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copy(work / "store.duckdb", out / "store.duckdb")  # each lever writes its own copy of the store
        t = time.perf_counter()
        r = stages.sao_expert(cfg, str(warm), envs, a.domain, out / "expert", domain_reward=None,
                              iteration=a.iteration, store_path=out / "store.duckdb", warm_rollouts=ids,
                              replay_rollouts=[i for i, d in rollouts.items() if d != a.domain])
        secs = time.perf_counter() - t
        variants = [(lever, r["checkpoint"], f"{secs:.0f}")]
        if a.interpolate:  # weight-space interpolation toward the warm start (WiSE-FT): no training, one evaluation
            w, e = load_checkpoint(warm), load_checkpoint(r["checkpoint"])
            ws = {k: v.clone() for k, v in w.state_dict().items()}  # a copy: loading below writes into w's own
            es = e.state_dict()
            for x in (float(v) for v in a.interpolate.split(",")):
                w.load_state_dict(merge_experts(ws, [es], x))
                variants.append((f"{lever} @ {x:g}", copy.deepcopy(w), ""))
        for name, ckpt, secs_ in variants:
            after = by_domain(ckpt)
            tests = compare(base, after)
            cells = [f"{cell(after[d])} {tests[d]['test']['gained']} / {tests[d]['test']['lost']}" for d in domains]
            key = "all" if len(domains) > 1 else a.domain
            test = tests[key]["test"]
            rows.append([name, str(r["steps"]), *cells,
                         f"{test['delta']:+.3f} [{test['delta_ci95'][0]:+.3f}, {test['delta_ci95'][1]:+.3f}]",
                         f"{test['p_value']:.3f}", secs_])
            print(json.dumps({"domain": a.domain, "lever": name, "steps": r["steps"], "skipped": r.get("skipped"),
                              "after": after, "base": base, "tests": {d: v["test"] for d, v in tests.items()}}),
                  flush=True)
    overall = "every domain" if len(domains) > 1 else a.domain
    table(f"{a.domain} expert vs its warm start, {len(held)} paired held-out tasks (greedy); per domain: pass@1 "
          f"[95% CI] gained / lost",
          ["lever", "SAO steps", *domains, f"Δ {overall} [95% CI]", "p (exact McNemar)", "SAO s"], rows)


if __name__ == "__main__":
    main()
