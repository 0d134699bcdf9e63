"""`temper run`: one post-training iteration as a Dagster run, then a summary table.

    temper run --preset tiny                 # the next iteration of the run root (1 on a fresh one)
    temper run --preset tiny --iteration 3   # a given iteration (its parent must exist)

The run goes into the same Dagster instance (`runs/dagster_home`), run root (`runs/pipeline`) and MLflow
store that `make ui` serves, so the run, its lineage and its curves are there to inspect afterwards.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STAGES = ["env_specs", "verified_envs", "warm_start", "rollout_batches", "rewards", "sao_experts", "opd_student",
          "evaluation"]


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


def summary(run_dir: Path, seconds: dict[str, float], wall: float, console) -> dict:
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
        s.add_row(st, f"{seconds.get(st, 0.0):.0f}", what.get(st, ""))
    s.add_row("total (wall)", f"{wall:.0f}", "", style="bold")
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
    return {"resources": res, "loggers": {"console": {"config": {"log_level": args.log_level}}}}


def again(args) -> str:
    """The command that runs the next iteration (or repairs this one) on the same preset, overrides and run root."""
    import shlex
    import sys

    prog = sys.argv[0] if Path(sys.argv[0]).name == "temper" else "temper"
    cmd = [prog, "run", "--preset", args.preset, *(x for o in args.override for x in ("-o", o)),
           "--run-root", str(args.run_root), *(["--servers", str(args.servers)] if args.servers else [])]
    return shlex.join(cmd)


def cmd_run(args) -> int:
    import warnings

    from rich.console import Console
    from rich.markup import escape

    warnings.filterwarnings("ignore", message=".*is currently in (preview|beta).*")

    con = Console(soft_wrap=True)  # a path or the hint command is not broken across lines (they are copied)
    import configs
    from assets.launch import LaunchRefused, check_parent, check_run_config, iteration_number

    run_config = _run_config(args)
    try:  # every configuration error fails here, before any partition or run exists
        configs.load(args.preset, args.override)
        check_run_config(run_config)
        if args.iteration is not None:
            iteration_number(str(args.iteration))
    except (configs.ConfigError, LaunchRefused) as e:
        con.print(f"[red]error:[/red] {escape(str(e))}")
        return 2
    root = Path.cwd()
    instance = _instance(root)

    from assets import ITERATIONS
    from pipelines.definitions import defs

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
        return 2
    if it not in keys:
        instance.add_dynamic_partitions(ITERATIONS.name, [it])
    con.print(f"[bold]temper[/] iteration {it} on [bold]{escape(args.preset)}[/] → {run_root / f'iteration-{int(it):04d}'}")
    t0 = time.perf_counter()
    res = defs.resolve_job_def("iteration").execute_in_process(
        run_config=run_config, instance=instance, partition_key=it, raise_on_error=False)
    wall = time.perf_counter() - t0
    run_dir = run_root / f"iteration-{int(it):04d}"
    out = summary(run_dir, _step_seconds(res), wall, con)
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
        _, why = stages.hand_off(rule, ev["student"], ws, bool(ev.get("registered", {}).get("champion_moved")))
        hint = f"again: {cmd} (iteration {int(it) + 1} starts from what iteration {it} hands off: {why.split(':')[0]})"
    else:
        hint = f"again: {cmd} reruns iteration {it} from its last finished step"
    from .ui import ui_urls

    dagster_ui, mlflow_ui = ui_urls()[0], run_config["resources"]["temper"]["config"]["mlflow_ui"]  # from config
    con.print(f"Dagster run {res.run_id} {'succeeded' if res.success else '[red]failed[/]'}.\n"
              f"Next: [bold]make ui[/] → Dagster {dagster_ui} (assets, lineage, this run) · "
              f"MLflow {mlflow_ui} (curves, the `temper-student` model and its champion alias).\n"
              f"Files: {run_dir} · trajectories: {run_root / 'trajectories.duckdb'} · {hint}")
    return 0 if res.success else 1


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
    """A failed iteration's MLflow runs say FAILED, not RUNNING forever."""
    db = run_root / "mlflow.db"
    if not db.exists():
        return
    from store.tracking import Tracker

    Tracker(f"sqlite:///{db.resolve()}").fail_iteration(iteration)


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="one post-training iteration as a Dagster run, with a summary table")
    r.add_argument("--preset", default="tiny")
    r.add_argument("--iteration", type=int, default=None, help="default: the next one")
    r.add_argument("--run-root", default="runs/pipeline")
    r.add_argument("--log-level", default="INFO")
    r.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    r.add_argument("--servers", type=int, default=0, metavar="N",
                   help="disaggregated: every generating stage (rollouts, SAO, OPD, evaluation) drives N embedded engine "
                        "servers by URL behind the router (default 0: one server for rollout_batches, in-process engines "
                        "for the training stages)")
    r.set_defaults(fn=cmd_run)
