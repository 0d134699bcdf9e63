"""Dagster assets, checks and resources of the iteration (the only room below `pipelines/` that imports dagster)."""

from .iteration import ALL_ASSETS, ALL_CHECKS, ITERATIONS
from .resources import RolloutBackend, SandboxResource, StageRunner, TemperResource, TrainerBackend
from .scaling import scaling

ALL_ASSETS = [*ALL_ASSETS, scaling]

__all__ = ["ALL_ASSETS", "ALL_CHECKS", "ITERATIONS", "RolloutBackend", "SandboxResource", "StageRunner",
           "TemperResource", "TrainerBackend"]
