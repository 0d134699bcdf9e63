"""The trajectory store: rollout trajectories in one DuckDB file, read back by trainers.

Schema (`SCHEMA_VERSION` 1)
---------------------------
``trajectories`` — one row per `rollout.types.Trajectory`:

    trajectory_id VARCHAR PRIMARY KEY  env_id, family, domain VARCHAR
    env_spec_hash, verifier_hash VARCHAR (provenance: which env spec and verifier)
    iteration INTEGER                  reward DOUBLE
    status VARCHAR (completed | truncated | crashed | aborted)
    verifier JSON (reward details)     engine VARCHAR (which engine/backend produced it)
    timings JSON (seconds)             created DOUBLE (unix time)       error VARCHAR (NULL unless crashed)
    n_tokens BIGINT, n_trainable BIGINT, n_segments INTEGER
    min_version, max_version INTEGER   policy versions over generated (loss_mask) tokens; -1 when none

``segments`` — one row per context window; ``(trajectory_id, seg_index)`` is unique (the write path
guarantees it, no index is kept, which keeps ingest cheap):

    tokens INTEGER[]  loss_mask BOOLEAN[]  logprobs FLOAT[]  versions INTEGER[]
    start_turn, end_turn INTEGER  summary BOOLEAN

``consumption`` — what a stage did with a trajectory it generated (several rows per trajectory are allowed):

    trajectory_id VARCHAR  stage VARCHAR (sao | grpo | opd | eval)  consumer VARCHAR (e.g. `sao:math`, `eval:student`)
    step INTEGER (the trainer step that consumed it; NULL for evaluation)
    policy_version INTEGER (the trainer's version then)   staleness INTEGER (that minus the first token's version)
    outcome VARCHAR (trained | value_pretrain | dropped_stale | dropped_crashed | dropped_empty | evaluated)

``rewards`` — a view over ``trajectories``: ids, provenance, reward, status and verifier details.
``store_meta`` — key/value; holds ``schema_version``.

The derived columns (``n_tokens``, ``n_trainable``, ``min_version``, ``max_version``, ``n_segments``) are
computed on write so that filters and statistics never touch the token lists.

Precision: ``logprobs`` are stored as FLOAT (float32); they read back as the float32 value nearest the
written one (relative error <= 6e-8 for normal floats). Everything else round-trips exactly: token ids must fit in int32;
``verifier`` and ``timings`` round-trip through JSON (so tuples come back as lists and dict keys as
strings; NaN and infinities are kept).

The single-writer rule
----------------------
DuckDB lets one process open a file read-write, and while it does no other process can open it at all,
not even read-only. So:

* exactly one process owns a `TrajectoryStore` on a file; in it, rollout workers hand finished
  trajectories to a `store.writer.StoreWriter` (a background thread that owns the writes);
* threads of that process may read concurrently: every read method runs on a per-thread DuckDB cursor
  and sees only committed batches (each `write` is one transaction, all or nothing);
* other processes read per-iteration Parquet exports (`TrajectoryStore.export_parquet`) with
  `ParquetReader`, which takes no lock on the database file.

Writes are append-only: writing a trajectory id that is already stored raises `DuplicateTrajectoryError`
(a ValueError naming the ids) and writes nothing of that batch. A committed batch survives a kill of the
writer process (DuckDB replays its WAL when the file is next opened); a batch cut off before its COMMIT
leaves no trace. A write the disk refuses (full, an I/O error) raises `StoreIOError` (an OSError) and writes nothing
of that batch: the same batch can be written again once the cause is gone (the Recorder and the StoreWriter do).

Reading: `read` returns `Trajectory` objects; `read_arrow` returns the two Arrow tables (about ten times
faster, for trainers that collate into tensors anyway). Parquet exports live in
``<out_dir>/iteration-NNNNNN/{trajectories,segments}.parquet`` with the columns above. (The Arrow form is in
store/arrow.py, the queries shared with `ParquetReader` in store/queries.py.)
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from rollout.types import STATUSES, Trajectory
from store.arrow import SEGMENT_SCHEMA, TRAJECTORY_SCHEMA, from_arrow, to_arrow  # noqa: F401 - re-exported
from store.queries import _ORDER, ParquetReader, _Cursors, _Queries, _quote  # noqa: F401 - ParquetReader re-exported

SCHEMA_VERSION = 1
OUTCOMES = ("trained", "value_pretrain", "dropped_stale", "dropped_crashed", "dropped_empty", "evaluated")
CONSUMPTION_COLUMNS = ("trajectory_id", "stage", "consumer", "step", "policy_version", "staleness", "outcome")

_DDL = f"""
CREATE TABLE IF NOT EXISTS store_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS trajectories (
    trajectory_id VARCHAR PRIMARY KEY,
    env_id VARCHAR NOT NULL,
    family VARCHAR NOT NULL,
    domain VARCHAR NOT NULL,
    env_spec_hash VARCHAR NOT NULL,
    verifier_hash VARCHAR NOT NULL,
    iteration INTEGER NOT NULL,
    reward DOUBLE NOT NULL,
    status VARCHAR NOT NULL CHECK (status IN ({", ".join(repr(s) for s in STATUSES)})),
    verifier JSON NOT NULL,
    engine VARCHAR NOT NULL,
    timings JSON NOT NULL,
    created DOUBLE NOT NULL,
    error VARCHAR,
    n_tokens BIGINT NOT NULL,
    n_trainable BIGINT NOT NULL,
    min_version INTEGER NOT NULL,
    max_version INTEGER NOT NULL,
    n_segments INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS segments (
    trajectory_id VARCHAR NOT NULL,
    seg_index INTEGER NOT NULL,
    tokens INTEGER[] NOT NULL,
    loss_mask BOOLEAN[] NOT NULL,
    logprobs FLOAT[] NOT NULL,
    versions INTEGER[] NOT NULL,
    start_turn INTEGER NOT NULL,
    end_turn INTEGER NOT NULL,
    summary BOOLEAN NOT NULL
);
CREATE TABLE IF NOT EXISTS consumption (
    trajectory_id VARCHAR NOT NULL,
    stage VARCHAR NOT NULL,
    consumer VARCHAR NOT NULL,
    step INTEGER,
    policy_version INTEGER NOT NULL,
    staleness INTEGER NOT NULL,
    outcome VARCHAR NOT NULL CHECK (outcome IN ({", ".join(repr(s) for s in OUTCOMES)}))
);
CREATE VIEW IF NOT EXISTS rewards AS
    SELECT trajectory_id, iteration, env_id, family, domain, env_spec_hash, verifier_hash, engine,
           min_version, max_version, status, reward, verifier
    FROM trajectories;
"""


class DuplicateTrajectoryError(ValueError):
    """A batch repeats trajectory ids: `existing` are already stored, `repeated` occur twice in the batch."""

    def __init__(self, existing: Iterable[str] = (), repeated: Iterable[str] = ()):
        self.existing = sorted(set(existing))
        self.repeated = sorted(set(repeated))
        parts = []
        if self.existing:
            parts.append(f"already stored: {_show(self.existing)}")
        if self.repeated:
            parts.append(f"repeated within the batch: {_show(self.repeated)}")
        super().__init__("duplicate trajectory ids, nothing of this batch was written (" + "; ".join(parts) + ")")

    @property
    def ids(self) -> list[str]:
        return sorted(set(self.existing) | set(self.repeated))


class StoreIOError(OSError):
    """The store could not write for a reason outside the batch (the disk is full, an I/O error): nothing of the
    batch was written, and the same batch can be written again once the cause is gone (see `RETRY_DELAYS`)."""


RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)  # seconds between a writer's attempts at one batch (~30 s in all)


class StoreLockedError(RuntimeError):
    """Another process holds the DuckDB file (one read-write process per file)."""


def _show(ids: Sequence[str], n: int = 10) -> str:
    head = ", ".join(repr(i) for i in ids[:n])
    return head + (f" and {len(ids) - n} more" if len(ids) > n else "")


def _consumption_rows(rows: Sequence[dict]) -> list[tuple]:
    out = []
    for r in rows:
        missing = [c for c in CONSUMPTION_COLUMNS if c not in r and c != "step"]
        if missing:
            raise ValueError(f"consumption row for {r.get('trajectory_id')!r} lacks {missing}")
        if r["outcome"] not in OUTCOMES:
            raise ValueError(f"consumption outcome {r['outcome']!r} is not one of {', '.join(OUTCOMES)}")
        out.append((str(r["trajectory_id"]), str(r["stage"]), str(r["consumer"]),
                    None if r.get("step") is None else int(r["step"]), int(r["policy_version"]),
                    int(r["staleness"]), r["outcome"]))
    return out


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    """Roll back the open transaction, if any (a failed COMMIT may already have ended it)."""
    with suppress(duckdb.TransactionException):
        con.rollback()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------- store


class TrajectoryStore(_Queries):
    """The trajectory tables in one DuckDB file; the process that opens it read-write is the single writer.

    `write` appends a batch as one transaction. The read methods (`read`, `count`, `stats`,
    `export_parquet`) may be called from any thread of this process while another thread writes: each
    thread reads through its own cursor and sees whole committed batches only. `cursor()` hands out a
    raw cursor for ad-hoc SQL. Other processes cannot open the file while this one holds it; they read
    `export_parquet` output with `ParquetReader`.

    path: the database file (created with the schema when missing). read_only: open an existing store
    without writing (only when no process holds it read-write). config: DuckDB settings (e.g.
    {"threads": 2, "memory_limit": "2GB"}).
    """

    def __init__(self, path: str | os.PathLike, *, read_only: bool = False, config: dict | None = None):
        self.path = Path(path)
        self.read_only = read_only
        if read_only and not self.path.exists():
            raise FileNotFoundError(f"no trajectory store at {self.path}")
        try:
            self._con = duckdb.connect(str(self.path), read_only=read_only, config=config or {})
        except duckdb.IOException as e:
            if "lock" in str(e).lower():
                raise StoreLockedError(
                    f"{self.path} is held by another process. DuckDB allows one read-write process per file and "
                    f"then no other process may open it: hand trajectories to that process's StoreWriter, or read "
                    f"its Parquet exports with store.ParquetReader. DuckDB said: {e}"
                ) from e
            raise StoreIOError(f"{self.path}: could not open the store: {e}") from e
        self._wlock = threading.Lock()
        try:
            if not read_only:
                self._con.execute(_DDL)
                self._con.execute(
                    "INSERT INTO store_meta VALUES ('schema_version', ?) ON CONFLICT DO NOTHING", [str(SCHEMA_VERSION)]
                )
            self._check_schema()
        except (duckdb.OperationalError, duckdb.FatalException) as e:  # e.g. no room for the schema on a full disk
            self._con.close()
            raise StoreIOError(f"{self.path}: could not open the store: {type(e).__name__}: {e}") from e
        except BaseException:
            self._con.close()
            raise
        self._wcon = self._con.cursor()
        self._cursors = _Cursors(self._con)

    def _check_schema(self) -> None:
        try:
            rows = self._con.execute("SELECT value FROM store_meta WHERE key = 'schema_version'").fetchall()
        except duckdb.CatalogException:
            rows = []
        row = rows[0] if rows else None
        if row is None:
            raise RuntimeError(f"{self.path} is not a trajectory store (no store_meta.schema_version)")
        if int(row[0]) != SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} has store schema version {row[0]}; this code reads version {SCHEMA_VERSION}")

    # -- writing

    def write(self, trajs: Sequence[Trajectory], consumption: Sequence[dict] = ()) -> int:
        """Append `trajs` (and their `consumption` rows, dicts with CONSUMPTION_COLUMNS) in one transaction
        (all or nothing); returns how many trajectories were written.

        Raises DuplicateTrajectoryError (a ValueError) naming ids that are already stored or repeated in
        the batch, and ValueError/TypeError for malformed trajectories or consumption rows; in every case
        nothing is written.
        """
        trajs = list(trajs)
        if not trajs and not consumption:
            return 0
        if not trajs:
            self.write_arrow(*to_arrow([]), consumption=consumption)
            return 0
        return self.write_arrow(*to_arrow(trajs), consumption=consumption)

    def consumption(self, stage: str | None = None) -> list[dict]:
        """Consumption rows (optionally of one stage), in insertion order."""
        with self._snapshot() as cur:
            q = "SELECT * FROM consumption" + (" WHERE stage = ?" if stage else "")
            rows = cur.execute(q, [stage] if stage else []).fetchall()
        return [dict(zip(CONSUMPTION_COLUMNS, r)) for r in rows]

    def drop_consumption_after(self, consumer: str, step: int) -> int:
        """Delete `consumer`'s consumption rows of steps after `step`; returns how many. A stage resumed from its
        checkpoint at `step` redoes those steps, so rows a killed attempt wrote for them would count twice. (The
        trajectories stay: they were generated; only what the lost steps did with them is undone.)"""
        if self.read_only:
            raise RuntimeError(f"{self.path} was opened read-only")
        with self._wlock:
            con = self._wcon
            n = con.execute("SELECT count(*) FROM consumption WHERE consumer = ? AND step > ?", [consumer, step]).fetchone()[0]
            if n:
                con.execute("DELETE FROM consumption WHERE consumer = ? AND step > ?", [consumer, step])
        return int(n)

    def write_arrow(self, traj_tbl: pa.Table, seg_tbl: pa.Table, consumption: Sequence[dict] = ()) -> int:
        """Append pre-built tables (see `to_arrow`) in one transaction; same rules as `write`."""
        if self.read_only:
            raise RuntimeError(f"{self.path} was opened read-only")
        try:
            traj_tbl = traj_tbl.select(TRAJECTORY_SCHEMA.names).cast(TRAJECTORY_SCHEMA)
            seg_tbl = seg_tbl.select(SEGMENT_SCHEMA.names).cast(SEGMENT_SCHEMA)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(f"tables do not match the store schema: {e}") from e
        ids = traj_tbl.column("trajectory_id").to_pylist()
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            raise DuplicateTrajectoryError(repeated=[i for i in ids if i in seen or seen.add(i)])
        want = {i: n for i, n in zip(ids, traj_tbl.column("n_segments").to_pylist()) if n}
        have = {}
        if seg_tbl.num_rows:
            vc = pc.value_counts(seg_tbl.column("trajectory_id").combine_chunks())
            have = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
        if have != want:
            bad = sorted(i for i in set(have) | set(want) if have.get(i) != want.get(i))
            raise ValueError(f"segments table does not match n_segments of the trajectories table for {_show(bad)}")
        crow = _consumption_rows(consumption)
        with self._wlock:
            if self._cursors.closed:
                raise RuntimeError("the store is closed")
            con = self._wcon
            con.register("_temper_traj_batch", traj_tbl)
            con.register("_temper_seg_batch", seg_tbl)
            try:
                con.begin()
                try:
                    con.execute("INSERT INTO trajectories BY NAME SELECT * FROM _temper_traj_batch")
                    con.execute("INSERT INTO segments BY NAME SELECT * FROM _temper_seg_batch")
                    if crow:
                        con.executemany("INSERT INTO consumption VALUES (?, ?, ?, ?, ?, ?, ?)", crow)
                    con.commit()
                except duckdb.ConstraintException as e:
                    _rollback(con)
                    # the primary key refused the batch: name the ids (checked only now, to keep writes cheap)
                    dup = con.execute(
                        "SELECT trajectory_id FROM trajectories "
                        "WHERE trajectory_id IN (SELECT trajectory_id FROM _temper_traj_batch)"
                    ).fetchall()
                    if dup:
                        raise DuplicateTrajectoryError(existing=[d[0] for d in dup]) from None
                    raise ValueError(f"the batch breaks a store constraint, nothing was written: {e}") from e
                except (duckdb.OperationalError, duckdb.FatalException) as e:  # disk full ("Failed to commit: Could
                    _rollback(con)  # not write file …: No space left on device"), I/O: the batch may be written again
                    raise StoreIOError(f"{self.path}: nothing of the batch of {traj_tbl.num_rows} trajectories was "
                                       f"written: {type(e).__name__}: {e}") from e
                except BaseException:
                    _rollback(con)
                    raise
            finally:
                con.unregister("_temper_traj_batch")
                con.unregister("_temper_seg_batch")
        return traj_tbl.num_rows

    # -- reading

    def _sources(self, iteration: int | Iterable[int] | None) -> tuple[str, str]:
        return "trajectories", "segments"

    @contextmanager
    def _snapshot(self) -> Iterator[duckdb.DuckDBPyConnection]:
        cur = self._cursors.get()
        cur.begin()
        try:
            yield cur
        finally:
            cur.rollback()  # read-only transaction: nothing to keep

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new DuckDB cursor on this store for ad-hoc SQL from the calling thread; close it when done."""
        if self._cursors.closed:
            raise RuntimeError("the store is closed")
        return self._con.cursor()

    def iterations(self) -> list[int]:
        """The iterations that have trajectories, ascending."""
        with self._snapshot() as cur:
            return [r[0] for r in cur.execute("SELECT DISTINCT iteration FROM trajectories ORDER BY 1").fetchall()]

    def export_parquet(self, iteration: int, out_dir: str | os.PathLike) -> Path:
        """Write iteration `iteration` to `out_dir/iteration-NNNNNN/{segments,trajectories}.parquet`; returns that folder.

        Both files come from one snapshot and each replaces its predecessor atomically (temporary file,
        fsync, rename). Segments are renamed into place first: since the store is append-only, a reader that
        reads trajectories.parquet before segments.parquet (as `ParquetReader` does) always finds every
        segment of every trajectory it read, even while an export of the same iteration is replacing them.
        Exports what is committed now: flush a StoreWriter first to include what it still holds.
        """
        if not isinstance(iteration, int):
            raise ValueError(f"iteration must be an int, got {iteration!r}")
        folder = Path(out_dir) / f"iteration-{iteration:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        final = {n: folder / f"{n}.parquet" for n in ("segments", "trajectories")}
        tmp = {n: p.with_name(p.name + tag) for n, p in final.items()}
        opts = "(FORMAT parquet, COMPRESSION zstd)"
        try:
            with self._snapshot() as cur:
                cur.execute(
                    f"COPY (SELECT s.* FROM segments s JOIN trajectories t USING (trajectory_id) "
                    f"WHERE t.iteration = {iteration} ORDER BY s.trajectory_id, s.seg_index) "
                    f"TO {_quote(tmp['segments'])} {opts}"
                )
                cur.execute(
                    f"COPY (SELECT * FROM trajectories WHERE iteration = {iteration} ORDER BY {_ORDER}) "
                    f"TO {_quote(tmp['trajectories'])} {opts}"
                )
            for n in ("segments", "trajectories"):
                _fsync(tmp[n])
                os.replace(tmp[n], final[n])
            _fsync(folder)
        finally:
            for p in tmp.values():
                p.unlink(missing_ok=True)
        return folder

    # -- lifetime

    def close(self) -> None:
        """Close every cursor and the database (DuckDB checkpoints its WAL into the file)."""
        if self._cursors.closed:
            return
        with self._wlock:
            self._cursors.close()
            self._wcon.close()
            self._con.close()

    def __enter__(self) -> TrajectoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TrajectoryStore({str(self.path)!r}{', read_only=True' if self.read_only else ''})"
