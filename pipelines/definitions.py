"""Dagster Definitions: what `pipelines/defs/` holds (the iteration's assets and checks, the job, two stopped
sensors that start the next iteration), loaded with `dg.load_from_defs_folder`, plus the resources.

    dagster dev -w workspace.yaml      # or: dg dev
    dg scaffold defs dagster.asset my_asset.py    # adds pipelines/defs/my_asset.py, loaded on the next reload
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from assets import RolloutBackend, SandboxResource, StageRunner, TemperResource, TrainerBackend
from assets.launch import launch_checked
from pipelines.defs.automation import (
    iteration_job,
    mark_failed_iterations,
    next_iteration_on_evaluation,
    recurring_iterations,
)

__all__ = ["defs", "iteration_job", "make_resources", "mark_failed_iterations", "next_iteration_on_evaluation",
           "recurring_iterations"]


def make_resources(temper: TemperResource | None = None, rollout: RolloutBackend | None = None,
                   sandbox: SandboxResource | None = None, trainer: TrainerBackend | None = None,
                   pipes: StageRunner | None = None) -> dict:
    """The iteration's resources (defaults: `tiny`, embedded servers, the preset's sandbox, torch)."""
    from pipelines.ui import ui_urls

    return {"temper": temper or TemperResource(mlflow_ui=ui_urls()[1]), "pipes": pipes or StageRunner(),
            "rollout": rollout or RolloutBackend(), "sandbox": sandbox or SandboxResource(),
            "trainer": trainer or TrainerBackend()}


defs = dg.Definitions.merge(
    dg.load_from_defs_folder(project_root=Path(__file__).resolve().parents[1]),  # pipelines/defs/
    dg.Definitions(resources=launch_checked(make_resources())),  # checked when a run is planned: before it exists
)
