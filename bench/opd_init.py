"""Where the OPD student starts: the warm start, or the experts merged by task arithmetic (`opd.init=merged`).

    python bench/opd_init.py runs/bench-learning/seed-0/iteration-1 runs/bench-learning/seed-1/iteration-1 ...

Each argument is an iteration directory written by `bench/learning.py` (its seed is read from the `seed-N` above
it): its verified RL set, held-out set and domain experts are reused, so every arm distils the very same experts
and is scored on the very same held-out tasks. Per directory, in one process:

* `warm start + OPD`: the pipeline's default (`opd.init=warm_start`, the preset's `opd.steps`);
* `merged, no OPD`: the warm start + Σ (expert − warm start), nothing distilled (`opd.steps=0`);
* `merged + OPD`: that merge, then the same OPD steps.

Greedy pass@1 per domain for the warm start, each expert on its own domain and each arm; each arm's paired
comparison (tasks gained / lost, exact McNemar) with the warm start, and `merged + OPD` against `warm start + OPD`.
The directories' tasks are distinct, so the flips pool across them.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

from common import progress, table
from learning import seed_config

import stages
from envs.dataset import read_dataset
from envs.sandbox import make_sandbox
from model import ByteTokenizer, load_checkpoint
from trainers.sft import evaluate
from trainers.stats import binom_two_sided, paired_delta_ci

ARMS = {"warm start + OPD": ["opd.init=warm_start"], "merged, no OPD": ["opd.init=merged", "opd.steps=0"],
        "merged + OPD": ["opd.init=merged"]}
DOMAINS = ("code", "math", "reasoning")


def one_dir(run: Path, args, say, bar) -> dict:
    m = re.search(r"seed-(\d+)", str(run))
    if not m:
        raise SystemExit(f"{run}: expected a bench/learning.py iteration directory under seed-N")
    seed = int(m.group(1))
    envs = {"train": None, "rl": str(run / "verified" / "rl"), "eval": str(run / "envs" / "eval")}
    experts = {d: str(run / "experts" / d / "checkpoint") for d in DOMAINS
               if (run / "experts" / d / "checkpoint").exists()}
    cfg0 = seed_config(args.preset, args.override, seed)
    warm = args.warm_start
    if not warm and run.name == "iteration-1" and cfg0.base.checkpoint:
        warm = str(stages.resolve_base(cfg0.base.checkpoint))
    if not warm:
        raise SystemExit(f"{run}: pass --warm-start (past iteration 1: the previous iteration's student)")
    held, tok, sb = read_dataset(envs["eval"]), ByteTokenizer(), make_sandbox(cfg0.envs.sandbox)

    def score(ckpt: str, specs) -> list[float]:
        ev = evaluate(load_checkpoint(ckpt), specs, tok, sb, cfg0.agent, n_slots=cfg0.loop.n_slots,
                      concurrency=cfg0.loop.batch_in_flight)
        return [t.reward for t in ev["trajectories"]]

    out = {"seed": seed, "dir": str(run), "domains": [s.domain for s in held], "warm": score(warm, held),
           "experts": {}, "arms": {}, "seconds": {}, "anchored": {}}
    for d, ck in experts.items():
        out["experts"][d] = sum(score(ck, [s for s in held if s.domain == d])) / sum(s.domain == d for s in held)
    for arm, ov in ARMS.items():
        bar.note(f"{run.name}: {arm}")
        cfg = seed_config(args.preset, [*args.override, *ov], seed)
        where = Path(args.out) / f"seed-{seed}" / re.sub(r"\W+", "_", arm)
        shutil.rmtree(where, ignore_errors=True)  # a fresh student: never resume an earlier run's OPD state
        t = time.perf_counter()
        st = stages.opd_student(cfg, warm, experts, envs, where, iteration=1)
        out["seconds"][arm] = round(time.perf_counter() - t, 1)
        out["anchored"][arm] = st.get("anchored", [])  # domains the warm start taught (opd.untaught)
        out["arms"][arm] = score(st["checkpoint"], held)
        say(f"{arm}: pass@1 {sum(out['arms'][arm]) / len(held):.3f} ({out['seconds'][arm]:.0f} s of OPD)")
        bar.advance()
    return out


def _pass(xs, doms, d):
    sel = [x for x, dd in zip(xs, doms) if d in ("all", dd)]
    return sum(sel) / len(sel) if sel else float("nan")


def _flips(a, b, doms, d):
    pairs = [(x, y) for x, y, dd in zip(a, b, doms) if d in ("all", dd)]
    return sum(x < y for x, y in pairs), sum(x > y for x, y in pairs), len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--warm-start", default=None, help="the warm start of a directory past iteration 1")
    ap.add_argument("--out", default="runs/bench-opd-init")
    args = ap.parse_args()
    res = []
    with progress("OPD arms", len(args.runs) * len(ARMS)) as bar:
        for run in args.runs:
            res.append(one_dir(run, args, lambda m, run=run: print(f"[{run}] {m}", flush=True), bar))
    for r in res:
        rows = []
        for d in (*sorted(set(r["domains"])), "all"):
            expert = f"{r['experts'].get(d, float('nan')):.3f}" if d != "all" else ""
            row = [d, f"{_pass(r['warm'], r['domains'], d):.3f}", expert]
            for arm in ARMS:
                g, lo, n = _flips(r["warm"], r["arms"][arm], r["domains"], d)
                row.append(f"{_pass(r['arms'][arm], r['domains'], d):.3f} ({g}/{lo})")
            rows.append(row)
        table(f"seed {r['seed']}: held-out pass@1 (gained / lost vs the warm start)",
              ["domain", "warm start", "expert (own)", *ARMS], rows)
    groups = (*sorted({d for r in res for d in r["domains"]}), "all")
    pooled = defaultdict(list)
    for d in groups:
        for arm in ARMS:
            g = lo = n = 0
            for r in res:
                a, b, c = _flips(r["warm"], r["arms"][arm], r["domains"], d)
                g, lo, n = g + a, lo + b, n + c
            ci = paired_delta_ci(g, lo, n)
            p = binom_two_sided(min(g, lo), g + lo)
            pooled[d].append(f"{(g - lo) / n:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}] {g}/{lo} p={p:.4f}")
    table(f"pooled over {len(res)} seed(s): Δ vs the warm start [95% CI], gained/lost, exact McNemar", ["group", *ARMS],
          [[d, *v] for d, v in pooled.items()])
    rows = []
    for d in groups:
        g = lo = n = 0
        for r in res:
            a, b, c = _flips(r["arms"]["warm start + OPD"], r["arms"]["merged + OPD"], r["domains"], d)
            g, lo, n = g + a, lo + b, n + c
        ci = paired_delta_ci(g, lo, n)
        ratio = [_pass(r["arms"]["merged + OPD"], r["domains"], d) / r["experts"][d] for r in res
                 if d in r["experts"] and r["experts"][d] > 0]
        rows.append([d, n, f"{(g - lo) / n:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]", f"{g} / {lo}",
                     f"{binom_two_sided(min(g, lo), g + lo):.4f}", " ".join(f"{x:.2f}" for x in ratio)])
    table("merged + OPD vs warm start + OPD (paired), and merged + OPD ÷ expert per seed",
          ["group", "paired tasks", "Δ [95% CI]", "gained / lost", "p", "student ÷ expert"], rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "opd_init.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
