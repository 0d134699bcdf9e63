"""Environment throughput: tool steps/s in the bubblewrap sandbox vs an unsandboxed subprocess (the
overhead ratio), and validation throughput (generate + judge + triad + hack probes, environments/s).
Run: .venv/bin/python bench/envs_throughput.py
"""

from __future__ import annotations

import argparse
import time

from common import table

from envs import FAMILIES, Environment, make_sandbox
from envs.gate import validate
from envs.generator import generate

STEPS = {
    "read": "<tool_call>read settings.py</tool_call>",
    "replace": "<tool_call>replace settings.py X Y</tool_call>",
    "calc": "<tool_call>calc (17*23)+4</tool_call>",
    "python": "<tool_call>python\nprint(sum(range(1000)))</tool_call>",
}


def steps_per_second(sb, call: str, n: int) -> float:
    spec = FAMILIES["set-const"].make(0)
    spec = spec.model_copy(update={"tools": ["read", "replace", "calc", "python"], "max_turns": 10_000})
    with Environment(spec, sb) as env:
        env.reset()
        env.step(call)
        t = time.perf_counter()
        for _ in range(n):
            env.step(call)
        return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--envs", type=int, default=14)
    args = ap.parse_args()
    bwrap = make_sandbox("bwrap")
    raw = make_sandbox("unsafe-subprocess", allow_unsafe=True)
    rows = []
    for name, call in STEPS.items():
        s, u = steps_per_second(bwrap, call, args.steps), steps_per_second(raw, call, args.steps)
        rows.append([name, f"{u:.1f}", f"{s:.1f}", u / s])
    table("tool steps/s: unsandboxed subprocess vs bubblewrap", ["tool", "subprocess steps/s", "bwrap steps/s",
                                                                  "overhead ×"], rows)
    rows = []
    for probes in (False, True):
        t = time.perf_counter()
        specs = generate(None, args.envs, seed=11)
        reports = [validate(s, bwrap, probes=probes) for s in specs]
        dt = time.perf_counter() - t
        rows.append(["judge + triad" + (" + probes" if probes else ""), len(specs),
                     sum(r.accepted for r in reports), f"{dt:.1f}", f"{len(specs) / dt:.2f}"])
    table("validation throughput (bwrap, all families)", ["gate", "envs", "accepted", "seconds", "envs/s"], rows)


if __name__ == "__main__":
    main()
