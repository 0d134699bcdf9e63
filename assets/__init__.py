"""Dagster assets and checks of the iteration (the only room below `pipelines/` that imports dagster)."""

from .iteration import ALL_ASSETS, ALL_CHECKS, ITERATIONS, TemperResource

__all__ = ["ALL_ASSETS", "ALL_CHECKS", "ITERATIONS", "TemperResource"]
