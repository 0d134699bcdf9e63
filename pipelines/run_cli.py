"""`temper run`: one post-training iteration as a Dagster run, then a summary table.

    temper run --preset tiny                 # the next iteration of the run root (1 on a fresh one)
    temper run --preset tiny --iteration 3   # a given iteration (its parent must exist)
    temper run --preset tiny --iterations 3  # the next three, each from what the one before hands off

The terminal shows one line per stage while the run goes (state, step k of N where the stage reports steps, elapsed
time, an estimate of the time left: pipelines/progress.py); the full Dagster log, with the stage processes' own
output, goes to the iteration's `dagster.log`.

The run goes into the same Dagster instance (`runs/dagster_home`), run root (`runs/pipeline`) and MLflow
store that `make ui` serves, so the run, its lineage and its curves are there to inspect afterwards. With
$TEMPER_DAGSTER_PG_URL the instance keeps its runs, events and schedules in PostgreSQL, and with
$TEMPER_MLFLOW_URI MLflow tracks into that database (docs/pipeline.md, Deployment).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

STAGES = ["env_specs", "verified_envs", "warm_start", "rollout_batches", "rewards", "sao_experts", "opd_student",
          "evaluation", "scaling"]


def _instance(root: Path):
    from .ui import dagster_home

    os.environ["DAGSTER_HOME"] = str(dagster_home(root))
    from dagster import DagsterInstance

    return DagsterInstance.get()


def _step_seconds(result) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in result.all_events:
        if e.event_type_value == "STEP_SUCCESS":
            out[e.step_key] = e.event_specific_data.duration_ms / 1000
    return out


def summary(run_dir: Path, seconds: dict[str, float], wall: float, console, states: dict[str, str] | None = None
            ) -> dict:
    """The iteration's tables (held-out results, stages) from the stage results in `run_dir`; with `states` (stage →
    done / reused / failed / skipped / waiting, from the live board), the stages table says each one's state."""
    from rich.table import Table

    from stages import teacher_cell

    def load(name):
        p = run_dir / f"{name}.json"
        return json.loads(p.read_text()) if p.exists() else {}

    ev, ro, ver, ws = load("evaluation"), load("rollout_batches"), load("verified_envs"), load("warm_start")
    sao, opd = load("sao_experts"), load("opd_student")
    t = Table(title=f"temper · {run_dir.name} · held-out pass@1 (95% Wilson CI), paired exact McNemar", show_lines=False)
    for c in ("domain", "n", "warm start", "student", "Δ", "gained / lost", "p", "expert (teacher)"):
        t.add_column(c, justify="right" if c != "domain" else "left")
    before, after, teach = ev.get("domain_before", {}), ev.get("domain_after", {}), ev.get("domain_teacher", {})
    st = ev.get("stats", {})
    anchored = opd.get("anchored") or []

    def cell(x):
        return f"{x['pass@1']:.2f} [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}]"

    for dom in [*sorted(d for d in st if d != "all"), "all"] if st else []:
        v = st[dom]
        test = v["test"]
        t.add_row(dom, str(test["n"]), cell(v["before"]), cell(v["after"]), f"{test['delta']:+.2f}",
                  f"{test['gained']} / {test['lost']}", f"{test['p_value']:.3f}",
                  teacher_cell(ev, dom, anchored), style="bold" if dom == "all" else None)
    console.print(t)
    s = Table(title="stages")
    s.add_column("stage")
    if states is not None:
        s.add_column("state")
    s.add_column("seconds", justify="right")
    s.add_column("what", justify="left")
    what = {
        "env_specs": "",
        "verified_envs": f"{ver.get('accepted', 0)}/{ver.get('total', 0)} environments admitted",
        "warm_start": {"base": f"the shipped base {ws.get('checkpoint')}", "sft": f"{ws.get('sft_steps', 0)} SFT steps",
                       "previous iteration": f"handed off: {ws.get('parent')}"}.get(ws.get("source", ""), ""),
        "rollout_batches": f"{ro.get('trajectories', 0)} trajectories, {ro.get('tokens', 0):,} tokens, "
                           f"mean reward {ro.get('mean_reward', 0):.2f}",
        "sao_experts": ", ".join(f"{d}: skipped" if v.get("skipped") else f"{d}: {v.get('steps', 0)} steps"
                                 for d, v in sao.items()),
        "opd_student": f"{opd.get('steps', 0)} OPD steps" + "".join(
            f"; {d} expert left out ({g['expert']:.2f} vs {g['warm_start']:.2f} on validation)"
            for d, g in (opd.get('gate') or {}).items() if not g["teaches"]) + "".join(
            f"; the warm start teaches {d}" for d in opd.get('anchored', [])),
        "evaluation": f"{ev.get('n_eval', 0)} held-out environments",
    }
    for st in STAGES:
        state = [states.get(st, "")] if states is not None else []
        s.add_row(st, *state, f"{seconds.get(st, 0.0):.0f}", what.get(st, ""),
                  style="red" if state == ["failed"] else "dim" if state and state[0] in ("skipped", "waiting") else None)
    s.add_row("total (wall)", *([""] if states is not None else []), f"{wall:.0f}", "", style="bold")
    console.print(s)
    for d, v in sao.items():
        if v.get("skipped"):
            console.print(f"[yellow]no {d} expert:[/] {v['skipped']}")
    if ev:
        console.print(f"student vs warm start: {ev.get('gained', 0)} tasks gained, {ev.get('lost', 0)} lost, "
                      f"p = {ev.get('p_value', 1.0):.4f} ({'significant' if ev.get('significant') else 'not significant'}"
                      f" at 0.05); champion {'moved' if ev.get('registered', {}).get('champion_moved') else 'kept'}")
    return {"domain_before": before, "domain_after": after, "domain_teacher": teach, "seconds": seconds, "wall": wall,
            "stats": st, "p_value": ev.get("p_value"), "significant": ev.get("significant"),
            "trajectories": ro.get("trajectories"), "tokens": ro.get("tokens")}


def _run_config(args) -> dict:
    """The run config `temper run` launches with (the same check as the Launchpad's applies to it)."""
    from .ui import ui_urls

    cfg = {"preset": args.preset, "overrides": args.override, "run_root": str(Path(args.run_root)),
           "mlflow_ui": ui_urls()[1]}
    res = {"temper": {"config": cfg}}
    if args.servers:
        res["rollout"] = {"config": {"kind": "embedded", "embedded_servers": args.servers, "all_stages": True}}
    return {"resources": res}  # loggers: `progress.execute_live` adds the board's and the log file's


def again(args) -> str:
    """The command that runs the next iteration (or repairs this one) on the same preset, overrides and run root."""
    import shlex
    import sys

    prog = sys.argv[0] if Path(sys.argv[0]).name == "temper" else "temper"
    cmd = [prog, "run", "--preset", args.preset, *(x for o in args.override for x in ("-o", o)),
           "--run-root", str(args.run_root), *(["--servers", str(args.servers)] if args.servers else [])]
    return shlex.join(cmd)


def cmd_run(args) -> int:
    """`temper run`: one iteration (the next one, or `--iteration N`), or `--iterations K` in a row, each starting from
    what the one before it handed off; stops at the first that fails."""
    import logging
    import warnings

    from rich.console import Console
    from rich.markup import escape

    warnings.filterwarnings("ignore", message=".*is currently in (preview|beta).*")

    con = Console(soft_wrap=True)  # a path or the hint command is not broken across lines (they are copied)
    import configs
    from assets.launch import LaunchRefused, check_run_config, iteration_number

    run_config = _run_config(args)
    try:  # every configuration error fails here, before any partition or run exists
        if not isinstance(logging.getLevelName(str(args.log_level).upper()), int):
            raise LaunchRefused(f"--log-level {args.log_level!r} is not a level (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
        cfg = configs.load(args.preset, args.override)
        check_run_config(run_config)
        if args.iteration is not None:
            iteration_number(str(args.iteration))
    except (configs.ConfigError, LaunchRefused) as e:
        con.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    from envs.sandbox import SandboxUnavailable, make_sandbox

    try:  # the stages run agent code in a sandbox on this machine: without bubblewrap (or Docker) say so now, not as
        # a stage that fails its retries with the reason only in the log
        make_sandbox(cfg.envs.sandbox)
    except SandboxUnavailable as e:
        con.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    root = Path.cwd()
    try:
        instance = _instance(root)
    except ValueError as e:  # $TEMPER_DAGSTER_PG_URL names a database SQLAlchemy cannot open
        con.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    from .stale_runs import reap

    reap(instance, lambda s: con.print(f"[yellow]note:[/] {escape(s)}"))  # a killed run would hold its pool slot
    k = getattr(args, "iterations", None) or 1
    ran: list[str] = []
    for i in range(k):
        if k > 1:
            con.rule(f"iteration {i + 1} of {k}")
        rc, it = run_iteration(args, con, instance, run_config)
        if rc != 0:
            if k > 1:
                con.print(f"[red]stopped:[/] iteration {it} {'failed' if rc == 1 else 'was refused'}, so the "
                          f"{k - i - 1} iteration(s) after it did not run ({len(ran)} of {k} finished"
                          f"{': ' + ', '.join(ran) if ran else ''})")
            return rc
        ran.append(it)
    if k > 1:
        con.print(f"{k} iterations finished in {args.run_root}: {', '.join(ran)}")
    return 0


def run_iteration(args, con, instance, run_config: dict) -> tuple[int, str]:
    """One iteration as a Dagster run, shown live (a line per stage; the full log in the iteration's dagster.log),
    then its summary. Returns (exit code: 0 done, 1 failed, 2 refused; the iteration)."""
    import logging

    from rich.markup import escape

    import configs
    from assets import ITERATIONS
    from assets.launch import LaunchRefused, check_parent
    from pipelines.definitions import defs

    from .progress import execute_live
    from .stale_runs import cancel, run_interruptibly, run_tags

    keys = instance.get_dynamic_partitions(ITERATIONS.name)
    run_root = Path(args.run_root)
    if args.iteration:
        it = str(args.iteration)
    else:
        n, repair = next_iteration(run_root)
        it = str(n)
        if repair:  # the last iteration failed: repair it instead of burning a new number
            con.print(f"iteration {n} did not finish: running it again (finished steps are kept)")
    try:  # iteration N starts from what N−1 of this run root handed off
        check_parent(instance, int(it), run_root)
    except LaunchRefused as e:
        con.print(f"[red]error:[/red] {escape(str(e))}")
        return 2, it
    if it not in keys:
        instance.add_dynamic_partitions(ITERATIONS.name, [it])
    run_dir = run_root / f"iteration-{int(it):04d}"
    log_path = run_dir / "dagster.log"
    con.print(f"[bold]temper[/] iteration {it} on [bold]{escape(args.preset)}[/] → {run_dir} · log: {log_path}")
    t0 = time.perf_counter()
    run_id = str(uuid.uuid4())

    def interrupted() -> None:  # Ctrl-C or SIGTERM: the run ends canceled, resumable, and says so
        cancel(instance, run_id, "interrupted (Ctrl-C or SIGTERM to temper run)")
        _mark_failed(run_root, it)
        con.print(f"[red]interrupted:[/] iteration {it} stopped (Dagster run {run_id} canceled); "
                  f"[bold]{escape(again(args))}[/] resumes it from its last finished step")

    res, board = run_interruptibly(lambda: execute_live(
        defs.resolve_job_def("iteration"), run_config, instance, it, log_path=log_path, console=con, stages=STAGES,
        title=f"iteration {it}", echo_level=logging.getLevelName(str(args.log_level).upper()), tags=run_tags(),
        run_id=run_id), interrupted)
    wall = time.perf_counter() - t0
    for r in (board.rows[n] for n in board.order):
        if r.state == "failed":
            con.print(f"[red]{r.name} failed:[/] {escape(_short(r.error))}")
    if not res.success and board.run_error and not any(r.state == "failed" for r in board.rows.values()):
        con.print(f"[red]the run failed:[/] {escape(_short(board.run_error))}")
    out = summary(run_dir, _step_seconds(res), wall, con, states={n: r.state for n, r in board.rows.items()})
    (run_dir / "summary.json").write_text(json.dumps({**out, "iteration": it, "success": res.success,
                                                      "run_id": res.run_id}, indent=1))
    if not res.success:
        _mark_failed(run_root, it)
    cmd = f"[bold]{escape(again(args))}[/]"
    if res.success:
        import stages

        ev = json.loads((run_dir / "evaluation.json").read_text())
        ws = json.loads((run_dir / "warm_start.json").read_text())["checkpoint"]
        rule = configs.load(args.preset, args.override).hand_off
        _, why = stages.hand_off_of(rule, ev, ws)
        hint = f"again: {cmd} (iteration {int(it) + 1} starts from what iteration {it} hands off: {why.split(':')[0]})"
        _print_curve(run_dir, con)
    else:
        hint = f"again: {cmd} reruns iteration {it} from its last finished step"
    from .ui import ui_urls

    dagster_ui, mlflow_ui = ui_urls()[0], run_config["resources"]["temper"]["config"]["mlflow_ui"]  # from config
    con.print(f"Dagster run {res.run_id} {'succeeded' if res.success else '[red]failed[/]'} · full log: {log_path}\n"
              f"Next: [bold]make ui[/] → Dagster {dagster_ui} (assets, lineage, this run) · "
              f"MLflow {mlflow_ui} (curves, the `temper-student` model and its champion alias).\n"
              f"Files: {run_dir} · trajectories: {run_root / 'trajectories.duckdb'} · {hint}")
    return (0 if res.success else 1), it


def _short(error: str, lines: int = 3) -> str:
    """The first lines of an error (the traceback is in the log)."""
    out = [x for x in error.strip().splitlines() if x.strip()][:lines]
    return "\n".join(out)[:600]


def _print_curve(run_dir: Path, con) -> None:
    """The scaling curve so far (the `scaling` asset's table: the policy each iteration hands off, its held-out pass@1
    and the compute spent; the fit and its forecast once there are enough iterations)."""
    path = run_dir / "scaling.json"
    if not path.exists():
        return
    from rich.markup import escape

    from stages.scaling import curve_table

    con.print("[bold]the curve so far[/] (held-out pass@1 of each iteration's hand-off):\n"
              + escape(curve_table(json.loads(path.read_text()))))


def next_iteration(run_root: Path) -> tuple[int, bool]:
    """The iteration `temper run` runs next in `run_root`, and whether it repairs an unfinished one: each run root
    numbers its own iterations (the Dagster instance's partitions are shared by every run root, and a fresh run root
    starts at 1 whatever other roots ran). An iteration is finished when its `evaluation.json` is written."""
    ran = sorted(int(p.name.removeprefix("iteration-")) for p in Path(run_root).glob("iteration-*")
                 if p.is_dir() and p.name.removeprefix("iteration-").isdigit())
    if not ran:
        return 1, False
    last = ran[-1]
    if not (Path(run_root) / f"iteration-{last:04d}" / "evaluation.json").exists():
        return last, True
    return last + 1, False


def _mark_failed(run_root: Path, iteration: str) -> None:
    """A failed iteration's MLflow runs say FAILED, not RUNNING forever (in the store the run used: the sqlite file
    under the run root, or $TEMPER_MLFLOW_URI's database)."""
    from store.tracking import Tracker, tracking_uri

    uri = tracking_uri(run_root)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return
    Tracker(uri, artifacts=(Path(run_root).resolve() / "mlartifacts").as_uri()).fail_iteration(iteration)


def _positive(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of iterations")
    return n


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="one post-training iteration as a Dagster run, with a summary table")
    r.add_argument("--preset", default="tiny")
    which = r.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, default=None, help="this iteration (default: the next one)")
    which.add_argument("--iterations", type=_positive, default=None, metavar="K",
                       help="K iterations in a row, each from what the one before it hands off; stops at the first "
                            "that fails")
    r.add_argument("--run-root", default="runs/pipeline")
    r.add_argument("--log-level", default="WARNING",
                   help="the run's log messages at or above this level are printed above the live stage table "
                        "(default WARNING; INFO: the stages' messages; DEBUG: every Dagster event); the iteration's "
                        "dagster.log has them all")
    r.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--servers", type=int, default=0, metavar="N",
                   help="disaggregated: every generating stage (rollouts, SAO, OPD, evaluation) drives N embedded engine "
                        "servers by URL behind the router (default 0: one server for rollout_batches, in-process engines "
                        "for the training stages)")
    r.set_defaults(fn=cmd_run)
