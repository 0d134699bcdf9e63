"""Built-in tool calls through a tool session (one sandboxed runner per episode) vs a sandboxed runner per call,
one process, the same bubblewrap sandbox: steps/s and machine CPU per step for each tool, then the gate (triad +
hack probes) on the tiny families. CPU is read from /proc/stat (every process: the sandbox's included).
Run: .venv/bin/python bench/tool_sessions.py
"""

from __future__ import annotations

import argparse
import os
import time

from common import table

from envs import FAMILIES, Environment, make_sandbox
from envs.gate import validate

STEPS = {
    "read": "<tool_call>read settings.py</tool_call>",
    "replace": "<tool_call>replace settings.py X Y</tool_call>",
    "calc": "<tool_call>calc (17*23)+4</tool_call>",
    "ls": "<tool_call>ls</tool_call>",
}


def cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (user + nice + system + irq + softirq)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iow, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def steps(sb, call: str, n: int) -> tuple[float, float]:
    """(steps/s, machine CPU ms per step) of `n` calls of `call` in one episode."""
    spec = FAMILIES["set-const"].make(0)
    spec = spec.model_copy(update={"tools": ["ls", "read", "replace", "calc"], "max_turns": 100_000})
    with Environment(spec, sb) as env:
        env.reset()
        env.step(call)
        c, t = cpu_seconds(), time.perf_counter()
        for _ in range(n):
            env.step(call)
        dt, dc = time.perf_counter() - t, cpu_seconds() - c
    return n / dt, 1e3 * dc / n


def gate(sb, n: int) -> tuple[float, float, int]:
    """(seconds, machine CPU seconds, accepted) of the gate on `n` environments of each tiny family."""
    specs = [FAMILIES[f].make(seed) for f in sorted(FAMILIES) if FAMILIES[f].tiny for seed in range(n)]
    c, t = cpu_seconds(), time.perf_counter()
    accepted = sum(validate(s, sb).accepted for s in specs)
    return time.perf_counter() - t, cpu_seconds() - c, accepted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--envs", type=int, default=4, help="environments per tiny family in the gate's run")
    args = ap.parse_args()
    sb = make_sandbox("bwrap")
    rows = []
    for name, call in STEPS.items():
        sb.supports_sessions = False
        one = steps(sb, call, max(10, args.steps // 5))
        sb.supports_sessions = True
        ses = steps(sb, call, args.steps)
        rows.append([name, f"{one[0]:.1f}", f"{ses[0]:.1f}", ses[0] / one[0], f"{one[1]:.1f}", f"{ses[1]:.2f}"])
    table("built-in tool steps: a sandboxed runner per call vs a tool session (bwrap)",
          ["tool", "per call steps/s", "session steps/s", "×", "per call CPU ms/step", "session CPU ms/step"], rows)
    sb.supports_sessions = False
    one = gate(sb, args.envs)
    sb.supports_sessions = True
    ses = gate(sb, args.envs)
    table(f"the gate (triad + hack probes), {args.envs} environments per tiny family",
          ["", "per call", "session", "×"],
          [["seconds", f"{one[0]:.1f}", f"{ses[0]:.1f}", one[0] / ses[0]],
           ["machine CPU seconds", f"{one[1]:.1f}", f"{ses[1]:.1f}", one[1] / ses[1]],
           ["accepted", one[2], ses[2], ""]])


if __name__ == "__main__":
    main()
