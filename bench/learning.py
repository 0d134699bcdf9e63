"""Learning on `tiny`: whole iterations from the shipped base, several seeds, paired held-out statistics.

    python bench/learning.py                                  # 3 seeds × 1 iteration, the preset's budgets
    python bench/learning.py --seeds 0 --iterations 2         # iteration 2 starts from iteration 1's student
    python bench/learning.py --seeds 0 1 2 -o loop.steps=40   # any override

Runs the pipeline's own stage functions (no Dagster; the same code `make run` runs): environments → gate →
warm start (the base, or the previous iteration's student) → rollouts on embedded servers → one SAO expert per
domain (skipped, with its reason, when the domain's rollout reward leaves the band) → multi-teacher OPD →
evaluation. A seed moves the RL and held-out environments and the training RNG, so seeds are independent
replicates. Each iteration's student is compared with its warm start on the same held-out tasks: pass@1 with
95% Wilson intervals, the tasks that flipped each way, and the exact McNemar p-value.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import progress, table

import stages
from configs import load
from trainers.stats import binom_two_sided, moves_champion, paired_delta_ci

SEED_STRIDE = 104_729


def one_iteration(cfg, out: Path, iteration: int, parent: str | None, say, stage=lambda name: None) -> dict:
    """`stage(name)` is called as each stage starts (the progress bar's note)."""
    from rollout.backend import embedded_servers

    secs: dict[str, float] = {}

    def timed(name, fn, *a, **kw):
        stage(name)
        t = time.perf_counter()
        r = fn(*a, **kw)
        secs[name] = round(time.perf_counter() - t, 1)
        say(f"  {name}: {secs[name]:.0f} s")
        return r

    specs = timed("env_specs", stages.env_specs, cfg, out / "envs", iteration)
    envs = timed("verified_envs", stages.verified_envs, cfg, specs, out / "verified")
    ws = timed("warm_start", stages.warm_start, cfg, envs, out / "warm_start", parent)
    with embedded_servers(cfg.model, n=1, n_slots=cfg.loop.n_slots, max_len=cfg.agent.max_context + 8,
                          seed=cfg.seed) as urls:
        ro = timed("rollout_batches", stages.rollout_batches, cfg, ws["checkpoint"], envs, out / "store.duckdb",
                   iteration, urls)
    scored = timed("rewards", stages.rewards, out / "store.duckdb", iteration, ro["trajectory_ids"])["domains"]
    experts = {}
    for dom in envs["domains"]:
        experts[dom] = timed(f"sao_{dom}", stages.sao_expert, cfg, ws["checkpoint"], envs, dom, out / "experts" / dom,
                             domain_reward=scored.get(dom, {}).get("mean_reward"), iteration=iteration,
                             store_path=out / "store.duckdb", warm_rollouts=scored.get(dom, {}).get("ids"),
                             replay_rollouts=stages.replay_ids(scored, dom))
    live = {d: e["checkpoint"] for d, e in experts.items() if e["steps"] > 0}
    student = timed("opd", stages.opd_student, cfg, ws["checkpoint"], live, envs, out / "student", iteration=iteration)
    ev = timed("evaluation", stages.evaluation, cfg, student["checkpoint"], ws["checkpoint"], envs, live,
               iteration=iteration, taught=stages.taught_domains(student))
    return {"evaluation": ev, "seconds": secs, "student": student["checkpoint"], "warm_start": ws["checkpoint"],
            "opd": {"untaught": cfg.opd.untaught, "anchored": student.get("anchored", []),
                    "teachers": sorted(student.get("teachers", {})), "gate": student.get("gate", {})},
            "rollout_reward": {d: v["mean_reward"] for d, v in scored.items()},
            "experts": {d: {k: e.get(k) for k in ("steps", "skipped", "updates", "reward_curve")} for d, e in experts.items()}}


def ci(x: dict) -> str:
    return f"{x['pass@1']:.3f} [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}]"


def seed_config(preset: str, overrides: list[str], seed: int):
    """The preset moved to replicate `seed`: its training seed and its RL and held-out environments."""
    base = load(preset, overrides)
    return load(preset, [*overrides, f"seed={base.seed + seed}", f"envs.rl_seed={base.envs.rl_seed + SEED_STRIDE * seed}",
                         f"envs.eval_seed={base.envs.eval_seed + SEED_STRIDE * seed}"])


def run_seed(seed: int, args, bar=None) -> list[dict]:
    """Every iteration of one seed (a child process when --jobs > 1: the numbers do not depend on it). `bar`: a
    progress counter moved on per iteration, its note the stage running."""
    import torch

    if args.jobs > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // args.jobs))
    say = lambda m: print(f"[seed {seed}] {m}", flush=True)  # noqa: E731
    cfg = seed_config(args.preset, args.override, seed)
    parent, out, best = None, [], None
    for it in range(1, args.iterations + 1):
        say(f"iteration {it}")
        stage = (lambda name, it=it: bar.note(f"seed {seed} iteration {it}: {name}")) if bar else (lambda name: None)
        r = one_iteration(cfg, Path(args.out) / f"seed-{seed}" / f"iteration-{it}", it, parent, say, stage)
        if bar:
            bar.advance()
        ev = r["evaluation"]
        dec = ev["decision"]  # on the validation set, as the pipeline decides: never the held-out figures
        score = dec["pass@1_after"] if dec["set"] else ev["pass@1_after"]
        moved = moves_champion(dec["significant"], score, best)
        best = score if moved else best
        parent, why = stages.hand_off(cfg.hand_off, r["student"], r["warm_start"], moved, bool(dec.get("better")))
        r.update(champion_moved=moved, hand_off=why)
        say(f"  hands off {why}")
        out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes (results do not change)")
    ap.add_argument("--out", default="runs/bench-learning")
    args = ap.parse_args()
    results: dict[int, list[dict]] = {}
    if args.jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as ex:
            futs = {seed: ex.submit(run_seed, seed, args) for seed in args.seeds}
            results = {seed: f.result() for seed, f in futs.items()}
    else:
        with progress("iterations", len(args.seeds) * args.iterations) as bar:
            results = {seed: run_seed(seed, args, bar) for seed in args.seeds}
    for seed in args.seeds:
        for it, r in enumerate(results[seed], 1):
            st = r["evaluation"]["stats"]
            rows = [[g, v["test"]["n"], ci(v["before"]), ci(v["after"]), f"{v['test']['delta']:+.3f}",
                     f"{v['test']['gained']} / {v['test']['lost']}", f"{v['test']['p_value']:.4f}",
                     stages.teacher_cell(r["evaluation"], g, r["opd"]["anchored"], digits=3)]
                    for g, v in st.items()]
            table(f"seed {seed} · iteration {it} · held-out pass@1, student vs warm start (paired)",
                  ["group", "n", "warm start", "student", "Δ", "gained / lost", "p (McNemar)", "expert"], rows)
            table(f"seed {seed} · iteration {it} · experts", ["domain", "rollout reward", "SAO steps", "updates", "skipped"],
                  [[d, f"{r['rollout_reward'].get(d, float('nan')):.3f}", e["steps"], e.get("updates") or 0,
                    e.get("skipped") or ""] for d, e in r["experts"].items()])
            table("seconds per stage", ["stage", "seconds"], [[k, v] for k, v in r["seconds"].items()])
    for it in range(args.iterations):
        groups = sorted(results[args.seeds[0]][it]["evaluation"]["stats"])
        rows = []
        for g in groups:
            d = [results[s][it]["evaluation"]["stats"][g]["test"]["delta"] for s in args.seeds]
            p = [results[s][it]["evaluation"]["stats"][g]["test"]["p_value"] for s in args.seeds]
            b = [results[s][it]["evaluation"]["stats"][g]["before"]["pass@1"] for s in args.seeds]
            a = [results[s][it]["evaluation"]["stats"][g]["after"]["pass@1"] for s in args.seeds]
            sd = statistics.stdev(d) if len(d) > 1 else 0.0
            rows.append([g, f"{statistics.mean(b):.3f}", f"{statistics.mean(a):.3f}", f"{statistics.mean(d):+.3f} ± {sd:.3f}",
                         " ".join(f"{x:+.3f}" for x in d), " ".join(f"{x:.3f}" for x in p)])
        table(f"iteration {it + 1} over seeds {args.seeds}: mean Δ ± sd (per-seed Δ and McNemar p)",
              ["group", "warm start", "student", "Δ", "Δ per seed", "p per seed"], rows)
        pooled = []
        for g in groups:  # every seed's held-out tasks are distinct: pool the paired flips
            ts = [results[s][it]["evaluation"]["stats"][g]["test"] for s in args.seeds]
            n, gained, lost = sum(t["n"] for t in ts), sum(t["gained"] for t in ts), sum(t["lost"] for t in ts)
            lo, hi = paired_delta_ci(gained, lost, n)
            pooled.append([g, n, f"{(gained - lost) / n:+.3f} [{lo:+.3f}, {hi:+.3f}]", f"{gained} / {lost}",
                           f"{binom_two_sided(min(gained, lost), gained + lost):.4f}"])
        table(f"iteration {it + 1}, seeds {args.seeds} pooled: Δ pass@1 with 95% interval, exact McNemar",
              ["group", "paired tasks", "Δ [95% CI]", "gained / lost", "p"], pooled)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.json").write_text(json.dumps({"overrides": args.override, "seeds": args.seeds,
                                                   "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
