"""Where the seconds of one iteration go (issue P, item 1): one real iteration of a preset, run as `temper run` runs
it, with every stage's wall time split into categories, and the tokens each stage decoded, prefilled and trained.

    python bench/iteration_profile.py                          # the tiny preset's iteration (~10 min on 2 quiet cores)
    python bench/iteration_profile.py --smoke                  # a shrunken iteration (same stages), ~2-3 min
    python bench/iteration_profile.py --out profile.json -o loop.steps=40 --run-root /tmp/prof --keep

How it runs. As `temper run` does (pipelines/run_cli.py): the `iteration` job executed in process by
`pipelines.progress.execute_live` into a Dagster instance and MLflow store under the run root (a fresh temporary
one by default), the live stage board on stderr. One difference: `temper run` runs each long stage (env_specs,
verified_envs, warm_start, rollout_batches, each sao_expert, opd_student, evaluation) in its own
`python -m stages.step` process through Dagster Pipes (`StageRunner`, kind `subprocess`; there is no in-process
kind), and timers in this process cannot see into those. Here `StageRunner.run` is replaced, in this process only,
by a call of the same `stages.step.run_stage` with the same extras, returning what Pipes would have (the result
message, the materialisation metadata). What that leaves out is each stage process's start (interpreter, imports:
torch, Dagster Pipes, the rooms): measured once before the run and reported beside the table, times the number of
stage processes the run would have started. In-process, every stage also shares one torch thread pool and warm
module caches, as a stage process does only within itself.

How it measures. Library functions are wrapped with timers at run time (`bench/profile_timers.py`; no library file
changes): exclusive per thread (a nested category counts once, in the innermost), each thread's time charged to the
stage that was running then (stages come from Dagster's step events: STEP_START → STEP_SUCCESS / FAILURE). Three
groups of columns, only the first of which adds up:
  main     the thread running the stage's step: categories add up to the step's wall time; `other` is the rest
           (the asset body's Dagster work, Python between the timed calls, and, on this thread, any wait not named);
  engine   busy seconds of the rollout engines' threads (`engine-*`): decode, prefill, sampling, scheduling, weight
           loads. OVERLAPS main (the main thread's `agent loop` is mostly waiting for these);
  workers  busy seconds of every other thread: sandbox tool calls and verification run by `asyncio.to_thread`, the
           gate's pool, SAO's rollouts-ahead thread, teacher prefetch. OVERLAPS main and engine, and sums over threads
           that ran at once (8 gate workers: up to 8 s per second).
Categories (the hooks, `install`): engine decode (`Engine._forward` chunked=False, `Engine._speculate`), prefill
(`_forward` chunked=True, `_score`), compile (a compiled decode step's first run of a variant, `loop.compile_decode`),
sampling/emit (`_emit`), engine scheduling (the rest of `Engine.step`), weight sync (`Engine._update`, backend
pushes); sandbox tool calls (`Environment.reset/step/close` outside verification), verification
(`Environment.verify`, the gate's `validate` / `judge` with every sandbox run inside them, the miner); SAO policy
forward (`rows_logprobs` + loss) and backward, critic forward (`Critic.forward`) and backward, the SAO step's rest,
optimizer (AdamW steps, grad clipping); OPD teacher scoring (`teacher_logprobs`), student forward / backward, the OPD
step's rest; checkpoint I/O and hashing; store (DuckDB); MLflow; agent loop (`asyncio.run` on the stage thread or a
rollouts thread: agent Python and awaiting engine and sandbox); waiting on worker threads.
Tokens: decoded / prefilled by the engines (positions each forward added to its requests' caches), trained by SAO
and OPD (the loss-masked tokens of their updates).

Each stage reads the preset file when it starts: the notes flag a preset file or a git HEAD that changed while the
run went (the stages then ran on different code or configurations), and the wall seconds are only as quiet as the
machine was (the notes give the load average before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from profile_report import CATEGORIES, rates, render  # noqa: E402
from profile_timers import Profiler, innermost  # noqa: E402

ROOTS = ("model", "rollout", "trainers", "stages", "envs", "store", "assets", "pipelines")
# the same stages, every one shrunk: ~2-3 minutes on 2 cores
SMOKE = ["envs.n_rl=30", "envs.n_eval=12", "envs.n_val=12", "envs.curriculum.probe_tasks=2",
         "envs.curriculum.min_tasks=1", "loop.steps=2", "loop.batch_size=4", "loop.in_flight=4", "opd.steps=2",
         "sao.value_pretrain_steps=2"]


# ---- hooks ---------------------------------------------------------------------------------------------
def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _fwd_cat(stack, _a, _k) -> str:
    return innermost(stack, [(lambda c: c == "opd_teacher", "opd_teacher"), (lambda c: c.startswith("sao_"), "sao_policy_fwd"),
                             (lambda c: c.startswith("opd_"), "opd_student_fwd")], "fwd_other")


def _bwd_cat(stack, _a, _k) -> str:
    return innermost(stack, [(lambda c: c == "@critic", "sao_critic_bwd"), (lambda c: c.startswith("sao_"), "sao_policy_bwd"),
                             (lambda c: c.startswith("opd_"), "opd_student_bwd")], "bwd_other")


def _compile_cat(_stack, args, kwargs) -> str:
    """A compiled decode step's first run of a variant (dense / selected) on its engine is compilation (as
    `EngineStats.compile_seconds` counts it); every later one is decode."""
    try:
        self, n_keys = args[0], _arg(args, kwargs, 3, "n_keys", 0)
        cfg = self.model.config
        return "compile" if bool(cfg.use_dsa and n_keys > cfg.index_topk) not in self.seen else "decode"
    except (AttributeError, IndexError, TypeError):
        return "decode"


def _env_cat(stack, _a, _k) -> str:
    return "verify" if "verify" in stack else "sandbox"


def _forward_tokens(args, kwargs, _cat=None):
    reqs, chunked = list(_arg(args, kwargs, 1, "reqs", [])), bool(_arg(args, kwargs, 2, "chunked", False))
    before = [r.cached for r in reqs]
    return lambda _res: {"prefill_tokens" if chunked else "decode_tokens": sum(r.cached - b for r, b in zip(reqs, before))}


def _speculate_tokens(args, kwargs, _cat=None):
    reqs = list(_arg(args, kwargs, 1, "reqs", []))
    before = [len(r.output_ids) for r in reqs]
    return lambda _res: {"decode_tokens": sum(len(r.output_ids) - b for r, b in zip(reqs, before))}


def _counted(name: str, how_many):
    """A `measure` that counts `how_many(args, kwargs)` (taken before the call) under `name`."""
    def measure(args, kwargs, _cat=None):
        n = how_many(args, kwargs)
        return lambda _res: {name: n}
    return measure


def _rows_tokens(args, kwargs, cat):
    """The positions a `rows_logprobs` call forwards (its rows at their true lengths when exact, else padded), counted
    under its category (`<category>_tokens`)."""
    ids, lengths, exact = _arg(args, kwargs, 1, "ids"), _arg(args, kwargs, 2, "lengths"), _arg(args, kwargs, 3, "exact", True)
    n = int(sum(lengths)) if exact and lengths is not None else int(ids.numel())
    return lambda _res: {f"{cat}_tokens": n}


def _trained(prefix: str):
    def measure(_args, _kwargs, _cat=None):
        return lambda st: ({f"{prefix}_tokens": float(st.get("tokens", 0) or 0), f"{prefix}_steps": 1.0}
                           if isinstance(st, dict) and st.get("tokens") else {})
    return measure


def _hook_engine(prof: Profiler) -> None:
    from rollout import backend as rb
    from rollout.engine import Engine

    prof.patch(Engine, "_forward", lambda _s, a, k: "prefill" if _arg(a, k, 2, "chunked", False) else "decode",
               measure=_forward_tokens)
    prof.patch(Engine, "_speculate", "decode", measure=_speculate_tokens)
    prof.patch(Engine, "_emit", "emit", measure=_counted("sampled_tokens", lambda a, k: len(_arg(a, k, 1, "pending", []))))
    prof.patch(Engine, "_score", "prefill", measure=_counted("prefill_tokens", lambda a, k: len(_arg(a, k, 1, "r").input_ids)))
    prof.patch(Engine, "step", "engine_sched")
    prof.patch(Engine, "_update", "weight_sync")
    for cls, names in ((rb.InProcessBackend, ("push",)), (rb.ServerBackend, ("push", "load"))):
        for n in names:
            prof.patch(cls, n, "weight_sync")
    try:  # the compiled decode step (loop.compile_decode), where this checkout has it
        from rollout.compiled import CompiledDecode
    except ImportError:
        prof.missing.append("rollout.compiled.CompiledDecode")
    else:
        prof.patch(CompiledDecode, "run", _compile_cat)


def _hook_envs(prof: Profiler) -> None:
    import envs.gate as gate
    import envs.generator as gen
    from envs.environment import Environment

    for n in ("reset", "step", "close"):
        prof.patch(Environment, n, _env_cat)
    prof.patch(Environment, "verify", "verify")
    for fn in (gate.validate, gate.judge, gate.mine):
        prof.patch_everywhere(fn, "verify", ROOTS)
    for fn in (gen.generate, gen.generate_disjoint):
        prof.patch_everywhere(fn, "taskgen", ROOTS)


def _hook_trainers(prof: Profiler) -> None:
    import torch

    import model
    import trainers.rl_losses as rl
    from model.losses import next_token_kl
    from trainers.backends import TrainBackend
    from trainers.loop import RLLoop
    from trainers.opd import OPDTrainer
    from trainers.optim import ShardedAdamW
    from trainers.sao import Critic, SAOTrainer

    prof.patch(SAOTrainer, "step", "sao_other", measure=_trained("sao"))
    prof.patch(SAOTrainer, "value_pretrain", "sao_other")
    prof.patch(SAOTrainer, "_critic_update", "@critic")
    prof.patch(Critic, "forward", "sao_critic_fwd",
               measure=_counted("sao_critic_fwd_tokens", lambda a, k: int(_arg(a, k, 1, "ids").numel())))
    prof.patch(OPDTrainer, "step", "opd_other", measure=_trained("opd"))
    prof.patch(OPDTrainer, "teacher_logprobs", "opd_teacher")
    prof.patch_everywhere(model.rows_logprobs, _fwd_cat, ROOTS, measure=_rows_tokens)
    for fn in (rl.policy_loss, rl.opd_advantage, rl.kl_penalty, next_token_kl):
        prof.patch_everywhere(fn, _fwd_cat, ROOTS)
    prof.patch(torch.Tensor, "backward", _bwd_cat)
    prof.patch(torch.optim.AdamW, "step", "optimizer")
    prof.patch(ShardedAdamW, "step", "optimizer")
    prof.patch(TrainBackend, "clip_grad_norm", "optimizer")
    prof.patch(RLLoop, "_wait", "wait_threads", when=prof.on_stage_thread)
    prof.patch(RLLoop, "push_weights", "weight_sync")


def _hook_io(prof: Profiler) -> None:
    import model
    import trainers.base as tb
    import trainers.checkpoint as tc
    from store.queries import _Queries
    from store.tracking import Tracker
    from store.trajectories import TrajectoryStore

    for fn in (model.load_checkpoint, model.save_checkpoint, tc.save_training_state, tc.load_training_state,
               tb.weights_sha256):
        prof.patch_everywhere(fn, "checkpoint", ROOTS)
    for n in ("__init__", "write", "write_arrow", "consumption", "drop_consumption_after", "export_parquet", "close",
              "iterations"):
        prof.patch(TrajectoryStore, n, "store")
    for n in ("read", "read_arrow", "count", "stats", "domain_rewards"):
        prof.patch(_Queries, n, "store")
    clients: set = set()
    init = Tracker.__init__

    def tracker_init(self, *a, **k):  # the MlflowClient's class, once it is known (store/ alone imports mlflow)
        init(self, *a, **k)
        cls = type(self.client)
        if cls not in clients:
            clients.add(cls)
            for n, f in list(vars(cls).items()):
                if isinstance(f, types.FunctionType) and not n.startswith("_"):
                    prof.patch(cls, n, "mlflow")

    prof.replace(Tracker, "__init__", tracker_init)
    for n, f in list(vars(Tracker).items()):
        if isinstance(f, types.FunctionType) and (n == "__init__" or not n.startswith("_")):
            prof.patch(Tracker, n, "mlflow")


def _hook_waits(prof: Profiler) -> None:
    from concurrent.futures import ThreadPoolExecutor

    prof.patch(asyncio, "run", "agent_loop",
               when=lambda: prof.on_stage_thread() or threading.current_thread().name.startswith("rollouts"))
    pool_map = ThreadPoolExecutor.map

    def timed_map(self, fn, *iterables, **kw):  # the caller waits while it takes the results
        it = pool_map(self, fn, *iterables, **kw)
        if not (prof.active and prof.on_stage_thread()):
            return it

        def results():
            while True:
                with prof.timer("wait_threads"):
                    try:
                        x = next(it)
                    except StopIteration:
                        return
                yield x
        return results()

    prof.replace(ThreadPoolExecutor, "map", timed_map)


def install(prof: Profiler) -> None:
    """Every hook (this process only; `prof.restore()` takes them off). A target the library renamed is listed in
    `prof.missing`, not fatal."""
    import pipelines.definitions  # noqa: F401 - every room the iteration loads, before their names are patched
    import rollout.agent  # noqa: F401
    import stages  # noqa: F401
    import trainers.sft  # noqa: F401
    import trainers.teachers  # noqa: F401

    for hook in (_hook_engine, _hook_envs, _hook_trainers, _hook_io, _hook_waits):
        hook(prof)


# ---- the stages in this process, the step events ---------------------------------------------------------
class _Completed:
    """What `PipesClientCompletedInvocation` gives the asset: the stage's result message and its materialisation."""

    def __init__(self, stage: str, out: dict, materialize: bool):
        self.stage, self.out, self.materialize = stage, out, materialize

    def get_custom_messages(self) -> list:
        return [{"stage": self.stage, "result": self.out}]

    def get_materialize_result(self):
        import dagster as dg

        from assets.iteration import _raw
        from stages.step import materialization_metadata

        return dg.MaterializeResult(metadata={k: _raw(v) for k, v in materialization_metadata(self.out).items()})


def in_process_stages(prof: Profiler) -> None:
    """`StageRunner.run` (Pipes: a `python -m stages.step` process per stage) replaced by `stages.step.run_stage` in
    this process, with the extras as JSON round-trips them and the result as the child would report it."""
    from assets.resources import StageRunner

    def run(self, context, stage, command, env, extras, run_root):
        from stages.step import live_metrics, run_stage

        ex = json.loads(json.dumps(extras))
        if env.get("OMP_NUM_THREADS"):  # the trainer resource's thread count, as the child's environment sets it
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        prof.count("stage_processes", 1)
        t0 = time.perf_counter()
        context.log.info(f"stage {ex['stage']} started in process (bench/iteration_profile.py)")
        out = run_stage(ex["stage"], ex["preset"], list(ex["overrides"]), ex["kwargs"], context.log.info,
                        live_metrics(ex.get("mlflow")))
        out["seconds"] = round(time.perf_counter() - t0, 2)
        return _Completed(ex["stage"], json.loads(json.dumps(out, default=str)), bool(ex.get("materialize")))

    prof.replace(StageRunner, "run", run)


def step_events(prof: Profiler) -> None:
    """Stages start and end with Dagster's step events, heard where the live board hears them (on the step's thread)."""
    from pipelines.progress import Board

    event = Board.event

    def heard(self, kind, step, t, **kw):
        if kind in ("STEP_START", "STEP_RESTARTED") and step:
            prof.stage_start(step)
        elif kind in ("STEP_SUCCESS", "STEP_FAILURE", "STEP_UP_FOR_RETRY") and step:
            prof.stage_end(step)
        return event(self, kind, step, t, **kw)

    prof.replace(Board, "event", heard)


def fingerprint(preset: str) -> dict:
    """What the run's stages read as they start: the preset file's hash and the checkout's HEAD; and the load."""
    import hashlib

    f = ROOT / "configs" / "presets" / f"{preset}.yaml"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"preset_sha256": hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.is_file() else None, "head": head,
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def process_start_seconds() -> float:
    """Wall seconds of a fresh interpreter importing what a `python -m stages.step` process imports."""
    code = ("import torch, dagster_pipes, configs, stages, stages.step, model, rollout.engine, rollout.agent, "
            "trainers.sao, trainers.opd, trainers.loop, envs.gate, store")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    return time.perf_counter() - t0


# ---- one iteration ---------------------------------------------------------------------------------------
def run_iteration(preset: str, overrides: list[str], run_root: Path, prof: Profiler):
    """`temper run --preset P -o … --run-root R` (its next iteration), under `prof`. Returns (the Dagster result, the
    iteration's directory)."""
    import logging

    from rich.console import Console

    import configs
    from assets import ITERATIONS
    from assets.launch import check_parent
    from envs.sandbox import make_sandbox
    from pipelines.definitions import defs
    from pipelines.progress import execute_live
    from pipelines.run_cli import STAGES, _instance, _run_config, next_iteration
    from pipelines.stale_runs import run_tags

    cfg = configs.load(preset, overrides)  # a bad key fails here, naming it
    make_sandbox(cfg.envs.sandbox)  # no bubblewrap (or Docker): fails now
    instance = _instance(run_root)  # <run_root>/runs/dagster_home
    n, repair = next_iteration(run_root)
    if repair:
        print(f"note: iteration {n} in {run_root} did not finish: its finished steps are reused, not profiled",
              file=sys.stderr)
    check_parent(instance, n, run_root)
    if str(n) not in instance.get_dynamic_partitions(ITERATIONS.name):
        instance.add_dynamic_partitions(ITERATIONS.name, [str(n)])
    run_config = _run_config(argparse.Namespace(preset=preset, override=overrides, run_root=str(run_root), servers=0))
    run_dir = run_root / f"iteration-{n:04d}"
    prof.begin()
    try:
        res, board = execute_live(defs.resolve_job_def("iteration"), run_config, instance, str(n),
                                   log_path=run_dir / "dagster.log", console=Console(stderr=True, soft_wrap=True),
                                   stages=STAGES, title=f"profile · iteration {n}", echo_level=logging.WARNING,
                                   tags=run_tags(), run_id=str(uuid.uuid4()))
    finally:
        prof.end()
    for r in (board.rows[k] for k in board.order):
        if r.state == "failed":
            print(f"{r.name} failed: {(r.error or '').strip()[:1500]}", file=sys.stderr)
    return res, run_dir


def _notes(rep: dict, meta: dict) -> list[str]:
    notes = [f"{meta['preset']} preset{' --smoke' if meta['smoke'] else ''}, overrides {meta['overrides'] or 'none'}; "
             f"stages in this process (temper run starts a Pipes process per stage); wall {rep['wall']:.1f} s"]
    n = sum(r["counts"].get("stage_processes", 0) for r in rep["stages"].values())
    if meta.get("process_start_s") is not None:
        notes.append(f"not in the tables: a stage process's start (interpreter + imports) took "
                     f"{meta['process_start_s']:.1f} s; temper run would start {n:.0f} of them "
                     f"(~{n * meta['process_start_s']:.0f} s more)")
    dag = meta.get("dagster_step_seconds") or {}
    off = {s: (rep["stages"][s]["wall"], d) for s, d in dag.items() if s in rep["stages"]
           and abs(rep["stages"][s]["wall"] - d) > max(1.0, 0.05 * d)}
    if off:
        notes.append(f"step walls differ from Dagster's own step durations (profile, Dagster): {off}")
    neg = {s: round(r["main"]["other"], 3) for s, r in rep["stages"].items() if r["main"]["other"] < -1e-6}
    if neg:
        notes.append(f"NEGATIVE remainder (a timer outlived its step): {neg}")
    before, after = meta["before"], meta["after"]
    if before["preset_sha256"] != after["preset_sha256"]:
        notes.append("WARNING: the preset file changed during the run: stages that started after the change ran on "
                     "another configuration")
    if before["head"] != after["head"]:
        notes.append(f"WARNING: HEAD moved during the run ({before['head'][:10]} -> {after['head'][:10]}): this process "
                     "kept the code it imported, but the preset may differ")
    notes.append(f"load average (1, 5, 15 min) before {before['loadavg']}, after {after['loadavg']} on "
                 f"{meta['cpus']} CPUs")
    if meta.get("missing_hooks"):
        notes.append(f"hooks not installed (renamed in the library?): {', '.join(meta['missing_hooks'])}")
    return notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="as `temper run -o` (after --smoke's own)")
    ap.add_argument("--smoke", action="store_true", help="a shrunken iteration: " + " ".join(SMOKE))
    ap.add_argument("--run-root", default=None, help="default: a fresh temporary directory, removed afterwards")
    ap.add_argument("--keep", action="store_true", help="keep the temporary run root")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--no-process-start", action="store_true", help="skip timing a stage process's start")
    args = ap.parse_args(argv)
    overrides = [*(SMOKE if args.smoke else []), *args.override]
    temp = args.run_root is None
    run_root = Path(args.run_root or tempfile.mkdtemp(prefix="temper-profile-")).resolve()
    meta = {"command": " ".join(["python", "bench/iteration_profile.py", *(argv if argv is not None else sys.argv[1:])]),
            "preset": args.preset, "smoke": args.smoke, "overrides": overrides, "run_root": str(run_root),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0]}
    meta["process_start_s"] = None if args.no_process_start else round(process_start_seconds(), 2)
    meta["before"] = fingerprint(args.preset)
    prof = Profiler()
    try:
        install(prof)
        in_process_stages(prof)
        step_events(prof)
        res, run_dir = run_iteration(args.preset, overrides, run_root, prof)
    finally:
        prof.restore()
    import torch

    from pipelines.run_cli import _step_seconds
    from store.tracking import git_commit

    meta["after"], meta["cpus"] = fingerprint(args.preset), os.cpu_count()
    rep = prof.report()
    for row in rep["stages"].values():
        row["rates"] = rates(row)
    meta.update(success=res.success, run_id=res.run_id, iteration_dir=str(run_dir), commit=git_commit(ROOT),
                torch_threads=torch.get_num_threads(), dagster_step_seconds=_step_seconds(res),
                missing_hooks=sorted(set(prof.missing)), categories={k: {"label": v[0], "timed": v[1]}
                                                                       for k, v in CATEGORIES.items()})
    meta["notes"] = _notes(rep, meta)
    render(rep, meta)
    if args.out:
        Path(args.out).write_text(json.dumps({**meta, **rep}, indent=1))
    if temp and not args.keep and res.success:
        shutil.rmtree(run_root, ignore_errors=True)
    elif temp:
        print(f"run root kept: {run_root}", file=sys.stderr)
    if not res.success:
        print("the iteration FAILED: the figures cover what ran (the log: " + str(run_dir / "dagster.log") + ")",
              file=sys.stderr)
    return 0 if res.success else 1


if __name__ == "__main__":
    sys.exit(main())
