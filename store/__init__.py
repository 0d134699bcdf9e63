"""Storage room: the DuckDB trajectory store (single writer), its writer thread and Parquet exports.

Only this package imports duckdb and pyarrow. See `store.trajectories` for the schema and the
single-writer rule.
"""

from store.trajectories import (
    RETRY_DELAYS,
    SCHEMA_VERSION,
    DuplicateTrajectoryError,
    ParquetReader,
    StoreIOError,
    StoreLockedError,
    TrajectoryStore,
    from_arrow,
    to_arrow,
)
from store.writer import StoreWriteError, StoreWriter

__all__ = [
    "RETRY_DELAYS",
    "SCHEMA_VERSION",
    "DuplicateTrajectoryError",
    "ParquetReader",
    "StoreIOError",
    "StoreLockedError",
    "StoreWriteError",
    "StoreWriter",
    "TrajectoryStore",
    "from_arrow",
    "to_arrow",
]
