"""Automation of the iteration: the job, and two sensors (stopped by default) that start the next iteration.

The next iteration of a run root is the one after its last *evaluated* iteration (its newest `policy` record: what
the next warm start reads), never the largest partition key: partitions left by failed or abandoned launches, and
keys that are not iteration numbers, are skipped with a log line, so no sequence of failed launches stalls the
schedule. An iteration whose earlier runs failed is launched again (its finished steps with unchanged inputs are
reused). Every request passes the launch check (`assets/launch.py`) first: a refused one creates neither a partition
nor a run.
"""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import dagster as dg

from assets import ITERATIONS, TemperResource
from assets.launch import LaunchRefused, check_parent, check_run_config, evaluated, iteration_number

iteration_job = dg.define_asset_job("iteration", selection=dg.AssetSelection.all())
ACTIVE = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
          dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING)


def _temper(run_config: dict | None) -> dict:
    return ((run_config or {}).get("resources") or {}).get("temper", {}).get("config") or {}


def _root_of(run_config: dict | None) -> Path:
    """The run root a run config runs in."""
    root = _temper(run_config).get("run_root") or TemperResource.model_fields["run_root"].default
    return Path(root).expanduser().resolve()


def _carried_config(instance, run_id: str | None, root: Path) -> dict:
    """The run config of `run_id` (the run that evaluated the previous iteration), so the next iteration runs on the
    same preset, overrides and backends, in the same run root."""
    run = instance.get_run_by_id(run_id) if run_id else None
    cfg = copy.deepcopy(dict(run.run_config)) if run is not None and run.run_config else {}
    if _root_of(cfg) != root:  # evaluated outside a launched run config (e.g. resources given in code): say where
        cfg.setdefault("resources", {}).setdefault("temper", {}).setdefault("config", {})["run_root"] = str(root)
    return cfg


def _is_iteration(key: str) -> bool:
    try:
        iteration_number(key)
        return True
    except LaunchRefused:
        return False


def _log_skipped(context, nxt: int, root: Path, last) -> None:
    keys = context.instance.get_dynamic_partitions(ITERATIONS.name)
    bad = [k for k in keys if not _is_iteration(k)]
    if bad:
        context.log.warning(f"partition key(s) {bad} are not iteration numbers (1, 2, …): ignored")
    above = sorted(int(k) for k in keys if _is_iteration(k) and int(k) > nxt)
    if above:
        after = f"after iteration {last.iteration}" if last else "(none evaluated there)"
        context.log.info(f"iteration partition(s) {above} were never evaluated in run root {root} {after} (failed or "
                         f"abandoned launches, or another run root's): skipped; the next iteration there is {nxt}")


def _next_request(context, source: str, root: Path | None = None) -> dg.SensorResult | dg.SkipReason:
    """Request the iteration after the last one evaluated in `root` (default: the run root evaluated most recently),
    on that iteration's run config, unless a run of it is in flight; add its partition if it has none."""
    instance = context.instance
    done = evaluated(instance)
    if root is None:
        root = done[0].root if done else _root_of({})
    mine = [e for e in done if e.root == root]
    last = max(mine, key=lambda e: (e.iteration, e.storage_id), default=None)
    nxt = (last.iteration if last else 0) + 1
    _log_skipped(context, nxt, root, last)
    runs = [r for r in instance.get_runs(dg.RunsFilter(tags={"dagster/partition": str(nxt)}))  # any job: backfills too
            if _root_of(r.run_config) == root]
    if active := [r for r in runs if r.status in ACTIVE]:
        return dg.SkipReason(f"iteration {nxt} of run root {root} is in flight (run {active[0].run_id})")
    cfg = _carried_config(instance, last.run_id if last else None, root)
    try:  # the checks `temper run` and the Launchpad make: nothing is created for a refused launch
        check_run_config(cfg)
        check_parent(instance, nxt, root)
    except LaunchRefused as e:
        context.log.warning(f"iteration {nxt} of run root {root} not launched: {e}")
        return dg.SkipReason(f"iteration {nxt} of run root {root} not launched: {e}")
    if runs:
        context.log.info(f"iteration {nxt} of run root {root} did not finish ({len(runs)} earlier run(s), the last "
                         f"{runs[0].status.value}): launching it again; its finished steps are reused")
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:8]
    keys = instance.get_dynamic_partitions(ITERATIONS.name)
    return dg.SensorResult(
        run_requests=[dg.RunRequest(partition_key=str(nxt), run_key=f"iteration-{nxt}-{tag}-try-{len(runs) + 1}",
                                    run_config=cfg, tags={"temper/trigger": source, "temper/run_root": str(root),
                                                          "temper/config_from": (last.run_id if last else "")
                                                          or "defaults"})],
        dynamic_partitions_requests=[] if str(nxt) in keys else [ITERATIONS.build_add_request([str(nxt)])])


@dg.sensor(job=iteration_job, default_status=dg.DefaultSensorStatus.STOPPED, minimum_interval_seconds=6 * 3600)
def recurring_iterations(context: dg.SensorEvaluationContext):
    """Every six hours (stopped by default), start the next iteration of the run root evaluated most recently, with
    its last evaluated iteration's run config; an iteration whose launches failed is launched again. A sensor rather
    than a schedule: only sensors may add dynamic partitions. It waits while that iteration is in flight."""
    return _next_request(context, "recurring")


@dg.sensor(job=iteration_job, default_status=dg.DefaultSensorStatus.STOPPED, minimum_interval_seconds=30)
def next_iteration_on_evaluation(context: dg.SensorEvaluationContext):
    """When an iteration's evaluation hands off (a new `policy` record), start the next iteration of its run root
    with its run config (off by default)."""
    done = evaluated(context.instance, limit=1)
    if not done:
        return dg.SkipReason("no iteration evaluated yet")
    new = done[0]
    if context.cursor and int(context.cursor) >= new.storage_id:
        return dg.SkipReason(f"nothing evaluated since iteration {new.iteration} of run root {new.root}")
    context.update_cursor(str(new.storage_id))
    return _next_request(context, "evaluation", new.root)


@dg.run_failure_sensor(default_status=dg.DefaultSensorStatus.RUNNING)  # every job of this code location
def mark_failed_iterations(context: dg.RunFailureSensorContext):
    """A failed iteration run (from the UI, a sensor or `temper run`) leaves no MLflow run RUNNING: its iteration's
    runs are marked FAILED."""
    run = context.dagster_run
    it = run.tags.get("dagster/partition")
    if not it:
        return dg.SkipReason("not an iteration partition run")
    uri = run.tags.get("temper/mlflow_uri")  # set by the assets when they open the iteration's MLflow run
    if not uri:
        return dg.SkipReason(f"iteration {it}'s run opened no MLflow run")
    from store.tracking import Tracker

    n = Tracker(uri).fail_iteration(it)
    context.log.info(f"iteration {it}: {n} MLflow run(s) marked FAILED")
