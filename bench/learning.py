"""Learning on `tiny`: the whole chain of one iteration, held-out pass@1 per domain at each stage.

    python bench/learning.py                          # the preset's budgets (what `make run` does)
    python bench/learning.py -o train.max_seconds=720 -o loop.steps=60 --init runs/sft/checkpoint

Runs the pipeline's own stage functions (no Dagster): environments → gate → SFT warm start (or `--init`)
→ one SAO expert per domain → multi-teacher OPD → evaluation, and prints pass@1 per domain for the warm
start, each expert on its own domain, and the OPD student, with the student/teacher ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import table

from configs import load
from pipelines import stages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[])
    ap.add_argument("--init", default=None, help="a warm-start checkpoint instead of SFT")
    ap.add_argument("--out", default="runs/bench-learning")
    args = ap.parse_args()
    cfg = load(args.preset, args.override)
    out = Path(args.out)
    say = lambda m: print(m, flush=True)  # noqa: E731
    secs: dict[str, float] = {}

    def timed(name, fn, *a, **kw):
        t = time.perf_counter()
        r = fn(*a, **kw)
        secs[name] = time.perf_counter() - t
        say(f"{name}: {secs[name]:.0f} s")
        return r

    specs = timed("env_specs", stages.env_specs, cfg, out / "envs")
    envs = timed("verified_envs", stages.verified_envs, cfg, specs, out / "verified", log=say)
    ws = timed("warm_start", stages.warm_start, cfg, envs, out / "warm_start", args.init, log=say)
    experts = {}
    for dom in sorted(ws["domain"]):
        experts[dom] = timed(f"sao_{dom}", stages.sao_expert, cfg, ws["checkpoint"], envs, dom, out / "experts" / dom,
                             log=lambda m: None)
    live = {d: e["checkpoint"] for d, e in experts.items() if e["steps"] > 0}
    student = timed("opd", stages.opd_student, cfg, ws["checkpoint"], live, envs, out / "student")
    ev = timed("evaluation", stages.evaluation, cfg, student["checkpoint"], ws["checkpoint"], envs, live)
    rows = []
    for dom in sorted(ev["domain_before"]):
        b, a, t = ev["domain_before"][dom], ev["domain_after"][dom], ev["domain_teacher"].get(dom)
        rows.append([dom, b, t if t is not None else "—", a, f"{a / t:.2f}" if t else "—", f"{a - b:+.2f}"])
    rows.append(["all", ev["pass@1_before"], "", ev["pass@1_after"], "", f"{ev['pass@1_after'] - ev['pass@1_before']:+.2f}"])
    table(f"held-out pass@1 on {args.preset} ({ev['n_eval']} environments)",
          ["domain", "warm start", "SAO expert", "OPD student", "student/teacher", "Δ student"], rows)
    pat = [[p, ev["pattern_before"][p], ev["pattern_teacher"].get(p, "—"), ev["pattern_after"].get(p, 0.0)]
           for p in sorted(ev["pattern_before"])]
    table("held-out pass@1 per pattern", ["pattern", "warm start", "SAO expert", "OPD student"], pat)
    quarter = []
    for dom, e in experts.items():
        r = e.get("reward_curve") or []
        q = max(1, len(r) // 4)
        if r:
            quarter.append([dom, len(r), sum(r[:q]) / q, sum(r[-q:]) / q])
    table("SAO training reward (sampled, one rollout per prompt)", ["expert", "steps", "first quarter", "last quarter"],
          quarter)
    table("seconds per stage", ["stage", "seconds"], [[k, v] for k, v in secs.items()])
    (out / "learning.json").write_text(json.dumps({"evaluation": ev, "seconds": secs, "overrides": args.override,
                                                   "experts": {d: e.get("reward_curve") for d, e in experts.items()}},
                                                  indent=1, default=str))


if __name__ == "__main__":
    main()
