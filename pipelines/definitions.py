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


def _defs_folder() -> dg.Definitions:
    """`pipelines/defs/`: in the checkout through pyproject.toml's [tool.dg] (as `dg` loads it); where temper is
    installed from a wheel there is no pyproject.toml beside the packages (and dg's search upwards from site-packages
    would find nothing, or another project's), so the component tree is rooted at the installed `pipelines.defs`."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        return dg.load_from_defs_folder(project_root=root)
    import pipelines.defs

    return dg.ComponentTree(defs_module=pipelines.defs, project_root=root, code_location_name="temper").build_defs()


defs = dg.Definitions.merge(
    _defs_folder(),  # pipelines/defs/
    dg.Definitions(resources=launch_checked(make_resources())),  # checked when a run is planned: before it exists
)
