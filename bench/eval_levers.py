"""Three levers on a stage's wall time, each against the code before it: greedy evaluation of one policy on `n`
held-out-ladder tasks (96 in flight on 96 engine slots, as `tiny` runs it), every variant run `repeat` times,
alternating, in one process; the episodes are checked equal across variants.

- shim: sandbox runs start by vfork + exec through prlimit / cgroup join / setpriv (envs/launch.py) — before, a
  preexec_fn made Python fork this process (with the model and a 96-slot cache mapped) for every run;
- plan: a chunked-prefill forward's budget bounds its padded positions, rows of like length together
  (rollout/requests.py:prefill_plan) — before, it bounded real tokens and padded every row to the widest;
- gather: the sparse-MLA twin gathers by index_select and skips the masks when every pick is usable
  (temper_kernels/mla.py) — before, advanced indexing and three masks on every call.
Run: .venv/bin/python bench/eval_levers.py [--tasks 240] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import time

import torch
from common import table

import configs
import envs.sandbox as sandbox_mod
import rollout.engine as engine_mod
import temper_kernels.mla as mla_mod
from envs import make_sandbox
from envs.generator import generate
from model import ByteTokenizer, load_checkpoint
from trainers.sft import evaluate


def token_budget_plan(reqs, remaining, budget, overhead=0):
    """The plan before: rows in order, each taking what is left of a budget of real tokens (at least one)."""
    rows, n_new = [], []
    for r, n in zip(reqs, remaining):
        n = min(n, max(1, budget))
        budget -= n
        rows.append(r)
        n_new.append(n)
        if budget <= 0:
            break
    return rows, n_new


def masked_gather_twin(q, kv, idx, qpos, scale, dv, slots=None):
    """The sparse-MLA twin before: advanced indexing, and every mask applied on every call."""
    rows = slots if slots is not None else torch.arange(q.shape[0], device=q.device)
    valid = (idx >= 0) & (idx <= qpos[..., None])
    g = torch.where(valid[..., None], kv[rows[:, None, None], idx.clamp_min(0)], 0.0)
    s = torch.einsum("bthd,btkd->bthk", q, g).float() * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    p = torch.softmax(s, -1).masked_fill(~valid.any(-1)[:, :, None, None], 0.0)
    return torch.einsum("bthk,btkv->bthv", p.to(q.dtype), g[..., :dv])


OLD = {"shim": (sandbox_mod, "exec_shim", lambda *a: None), "plan": (engine_mod, "prefill_plan", token_budget_plan),
       "gather": (mla_mod, "sparse_mla_reference", masked_gather_twin)}
VARIANTS = {"before": (), "+ shim": ("shim",), "+ plan": ("plan",), "+ gather": ("gather",),
            "all three": ("shim", "plan", "gather")}


@contextlib.contextmanager
def levers(on: tuple[str, ...]):
    saved = []
    for name, (mod, attr, old) in OLD.items():
        if name not in on:
            saved.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, old)
    try:
        yield
    finally:
        for mod, attr, new in saved:
            setattr(mod, attr, new)


def cpu() -> tuple[float, float]:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tasks", type=int, default=240)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    cfg = configs.load(a.preset)
    model = load_checkpoint(cfg.base.checkpoint)
    specs = generate(cfg.envs.eval_patterns, a.tasks, seed=9, purpose="bench")
    tok, sb = ByteTokenizer(), make_sandbox(cfg.envs.sandbox)
    n = cfg.loop.batch_in_flight
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpus: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    episodes = None
    for _ in range(a.repeat):
        for v, on in VARIANTS.items():
            with levers(on):
                c0, t = cpu(), time.perf_counter()
                ev = evaluate(model, specs, tok, sb, cfg.agent, n_slots=n, concurrency=n)
                wall[v].append(time.perf_counter() - t)
                c1 = cpu()
                cpus[v].append((c1[0] - c0[0], c1[1] - c0[1]))
            got = [[list(s.tokens) for s in tr.segments] for tr in ev["trajectories"]]
            episodes = episodes or got
            assert got == episodes, f"{v} changed a greedy episode"
    base = statistics.median(wall["before"])
    table(f"greedy evaluation, {a.tasks} tasks, {n} in flight: seconds (median of {a.repeat}, alternated)",
          ["variant", "median s", "runs", "CPU s: this process", "CPU s: sandboxes", "× before"],
          [[v, f"{statistics.median(s):.1f}", " ".join(f"{x:.1f}" for x in s),
            f"{statistics.median(c[0] for c in cpus[v]):.1f}", f"{statistics.median(c[1] for c in cpus[v]):.1f}",
            base / statistics.median(s)] for v, s in wall.items()])


if __name__ == "__main__":
    main()
