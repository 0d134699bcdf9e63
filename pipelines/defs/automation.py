"""Automation of the iteration: the job, and two sensors (stopped by default) that start the next iteration."""

from __future__ import annotations

import dagster as dg

from assets import ITERATIONS, TemperResource

iteration_job = dg.define_asset_job("iteration", selection=dg.AssetSelection.all())


def _next_iteration(instance) -> str:
    keys = [int(k) for k in instance.get_dynamic_partitions(ITERATIONS.name)]
    return str(max(keys, default=0) + 1)


def _carried_config(instance, run_id: str | None) -> dict:
    """The run config of `run_id` (the run that finished the previous iteration), so the next iteration runs on
    the same preset, overrides and backends; re-validated, since presets can change between the two."""
    run = instance.get_run_by_id(run_id) if run_id else None
    cfg = dict(run.run_config) if run is not None and run.run_config else {}
    temper = (cfg.get("resources") or {}).get("temper", {}).get("config") or {}
    TemperResource(**temper)  # a ValueError naming the key if the carried overrides no longer resolve
    return cfg


def _next_request(instance, source: str) -> dg.SensorResult | dg.SkipReason:
    """Add partition N+1 and request its run with iteration N's config, once N has been evaluated."""
    nxt = _next_iteration(instance)
    last = str(int(nxt) - 1)
    run_id = None
    if int(last) >= 1:
        res = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("evaluation"), asset_partitions=[last]), limit=1)
        if not res.records:
            return dg.SkipReason(f"iteration {last} has not been evaluated yet")
        run_id = res.records[0].run_id
    try:
        cfg = _carried_config(instance, run_id)
    except ValueError as e:
        return dg.SkipReason(f"iteration {last}'s config no longer resolves: {e}")
    return dg.SensorResult(run_requests=[dg.RunRequest(partition_key=nxt, run_key=f"iteration-{nxt}", run_config=cfg,
                                                       tags={"temper/trigger": source,
                                                             "temper/config_from": run_id or "defaults"})],
                           dynamic_partitions_requests=[ITERATIONS.build_add_request([nxt])])


@dg.sensor(job=iteration_job, default_status=dg.DefaultSensorStatus.STOPPED, minimum_interval_seconds=6 * 3600)
def recurring_iterations(context: dg.SensorEvaluationContext):
    """Every six hours (stopped by default), start the next iteration with the previous one's run config. A
    sensor rather than a schedule: only sensors may add dynamic partitions. It waits while the latest iteration
    has not been evaluated."""
    return _next_request(context.instance, "recurring")


@dg.sensor(job=iteration_job, default_status=dg.DefaultSensorStatus.STOPPED, minimum_interval_seconds=30)
def next_iteration_on_evaluation(context: dg.SensorEvaluationContext):
    """When iteration N's evaluation lands, add partition N+1 and request its run with N's run config (off by
    default)."""
    rec = context.instance.get_latest_materialization_event(dg.AssetKey("evaluation"))
    if rec is None or rec.asset_materialization is None:
        return dg.SkipReason("no evaluation materialised yet")
    nxt = str(int(rec.asset_materialization.partition) + 1)
    if context.cursor == nxt or nxt in context.instance.get_dynamic_partitions(ITERATIONS.name):
        return dg.SkipReason(f"iteration {nxt} already requested")
    out = _next_request(context.instance, "evaluation")
    if isinstance(out, dg.SensorResult):
        context.update_cursor(nxt)
    return out


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
