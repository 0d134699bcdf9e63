"""Storage room: the DuckDB trajectory store (single writer), its writer thread and Parquet exports.

Only this package imports duckdb and pyarrow. See `store.trajectories` for the schema and the
single-writer rule.
"""

from store.trajectories import (
    SCHEMA_VERSION,
    DuplicateTrajectoryError,
    ParquetReader,
    StoreLockedError,
    TrajectoryStore,
    from_arrow,
    to_arrow,
)
from store.writer import StoreWriteError, StoreWriter

__all__ = [
    "SCHEMA_VERSION",
    "DuplicateTrajectoryError",
    "ParquetReader",
    "StoreLockedError",
    "StoreWriteError",
    "StoreWriter",
    "TrajectoryStore",
    "from_arrow",
    "to_arrow",
]
