"""Dagster Definitions: the iteration job, a (stopped) schedule and an (off) sensor, the resources.

    dagster dev -w workspace.yaml      # or: dg dev
"""

from __future__ import annotations

import dagster as dg

from assets import ALL_ASSETS, ALL_CHECKS, ITERATIONS, RolloutBackend, SandboxResource, TemperResource, TrainerBackend


def make_resources(temper: TemperResource | None = None, rollout: RolloutBackend | None = None,
                   sandbox: SandboxResource | None = None, trainer: TrainerBackend | None = None) -> dict:
    """The iteration's resources (defaults: `tiny`, embedded servers, the preset's sandbox, torch)."""
    return {"temper": temper or TemperResource(mlflow_ui="http://127.0.0.1:5000"), "pipes": dg.PipesSubprocessClient(),
            "rollout": rollout or RolloutBackend(), "sandbox": sandbox or SandboxResource(),
            "trainer": trainer or TrainerBackend()}


iteration_job = dg.define_asset_job("iteration", selection=dg.AssetSelection.all())


def _next_iteration(instance) -> str:
    keys = [int(k) for k in instance.get_dynamic_partitions(ITERATIONS.name)]
    return str(max(keys, default=0) + 1)


@dg.schedule(job=iteration_job, cron_schedule="0 */6 * * *", default_status=dg.DefaultScheduleStatus.STOPPED)
def recurring_iterations(context: dg.ScheduleEvaluationContext):
    """Start the next iteration every six hours (stopped by default)."""
    nxt = _next_iteration(context.instance)
    context.instance.add_dynamic_partitions(ITERATIONS.name, [nxt])
    return dg.RunRequest(partition_key=nxt, run_key=f"iteration-{nxt}")


@dg.sensor(job=iteration_job, default_status=dg.DefaultSensorStatus.STOPPED, minimum_interval_seconds=30)
def next_iteration_on_evaluation(context: dg.SensorEvaluationContext):
    """When iteration N's evaluation lands, add partition N+1 and request its run (off by default)."""
    rec = context.instance.get_latest_materialization_event(dg.AssetKey("evaluation"))
    if rec is None or rec.asset_materialization is None:
        return dg.SkipReason("no evaluation materialised yet")
    done = int(rec.asset_materialization.partition)
    nxt = str(done + 1)
    if context.cursor == nxt:
        return dg.SkipReason(f"iteration {nxt} already requested")
    context.update_cursor(nxt)
    return dg.SensorResult(run_requests=[dg.RunRequest(partition_key=nxt, run_key=f"iteration-{nxt}")],
                           dynamic_partitions_requests=[ITERATIONS.build_add_request([nxt])])


defs = dg.Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[iteration_job],
    schedules=[recurring_iterations],
    sensors=[next_iteration_on_evaluation],
    resources=make_resources(),
)
