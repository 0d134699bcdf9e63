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
leaves no trace.

Reading: `read` returns `Trajectory` objects; `read_arrow` returns the two Arrow tables (about ten times
faster, for trainers that collate into tensors anyway). Parquet exports live in
``<out_dir>/iteration-NNNNNN/{trajectories,segments}.parquet`` with the columns above.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollout.types import STATUSES, Segment, Trajectory

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

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("env_id", pa.string(), nullable=False),
        pa.field("family", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("env_spec_hash", pa.string(), nullable=False),
        pa.field("verifier_hash", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("verifier", pa.string(), nullable=False),
        pa.field("engine", pa.string(), nullable=False),
        pa.field("timings", pa.string(), nullable=False),
        pa.field("created", pa.float64(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("n_tokens", pa.int64(), nullable=False),
        pa.field("n_trainable", pa.int64(), nullable=False),
        pa.field("min_version", pa.int32(), nullable=False),
        pa.field("max_version", pa.int32(), nullable=False),
        pa.field("n_segments", pa.int32(), nullable=False),
    ]
)
SEGMENT_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("seg_index", pa.int32(), nullable=False),
        pa.field("tokens", pa.large_list(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.large_list(pa.bool_()), nullable=False),
        pa.field("logprobs", pa.large_list(pa.float32()), nullable=False),
        pa.field("versions", pa.large_list(pa.int32()), nullable=False),
        pa.field("start_turn", pa.int32(), nullable=False),
        pa.field("end_turn", pa.int32(), nullable=False),
        pa.field("summary", pa.bool_(), nullable=False),
    ]
)
_ORDER = "iteration, created, trajectory_id"
_I32 = np.iinfo(np.int32)


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


class StoreLockedError(RuntimeError):
    """Another process holds the DuckDB file (one read-write process per file)."""


def _show(ids: Sequence[str], n: int = 10) -> str:
    head = ", ".join(repr(i) for i in ids[:n])
    return head + (f" and {len(ids) - n} more" if len(ids) > n else "")


# ----------------------------------------------------------------------------------------------- Arrow


def _flat(seqs: list, dtype: type, what: str) -> np.ndarray:
    """Concatenate per-segment sequences (lists or arrays) into one numpy array of `dtype`."""
    if not seqs:
        return np.zeros(0, dtype=dtype)
    try:
        return np.concatenate([np.asarray(s, dtype=dtype) for s in seqs])
    except (OverflowError, ValueError, TypeError) as e:
        raise ValueError(f"segment {what} do not convert to {np.dtype(dtype).name}: {e}") from e


def _json(value: dict, tid: str, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"trajectory {tid!r}: {what} is not JSON-serialisable: {e}") from e


def to_arrow(trajs: Sequence[Trajectory]) -> tuple[pa.Table, pa.Table]:
    """Columnar form of `trajs`: (trajectories table, segments table) with `TRAJECTORY_SCHEMA`/`SEGMENT_SCHEMA`.

    List columns are built from flat numpy arrays and offsets (no per-token Python work beyond one
    conversion per segment column); the derived counts and policy versions are reduced in numpy.
    """
    segs: list[Segment] = []
    seg_tid: list[str] = []
    seg_idx: list[int] = []
    n_segs = np.zeros(len(trajs), dtype=np.int64)
    for k, t in enumerate(trajs):
        if not isinstance(t, Trajectory):
            raise TypeError(f"expected rollout.types.Trajectory, got {type(t).__name__}")
        if t.status not in STATUSES:
            raise ValueError(f"trajectory {t.trajectory_id!r}: status {t.status!r}, expected one of {STATUSES}")
        n_segs[k] = len(t.segments)
        for i, s in enumerate(t.segments):
            n = len(s.tokens)
            if not (len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n):
                raise ValueError(
                    f"trajectory {t.trajectory_id!r} segment {i}: columns differ in length (tokens {n}, "
                    f"loss_mask {len(s.loss_mask)}, logprobs {len(s.logprobs)}, versions {len(s.versions)})"
                )
            segs.append(s)
            seg_tid.append(t.trajectory_id)
            seg_idx.append(i)

    seg_len = np.fromiter((len(s.tokens) for s in segs), dtype=np.int64, count=len(segs))
    offsets = np.zeros(len(segs) + 1, dtype=np.int64)
    np.cumsum(seg_len, out=offsets[1:])
    tokens = _flat([s.tokens for s in segs], np.int32, "tokens")
    mask = _flat([s.loss_mask for s in segs], np.bool_, "loss_mask")
    logprobs = _flat([s.logprobs for s in segs], np.float32, "logprobs")
    versions = _flat([s.versions for s in segs], np.int32, "versions")

    # per-trajectory token ranges [t0, t1) and reductions over generated tokens
    seg_bounds = np.zeros(len(trajs) + 1, dtype=np.int64)
    np.cumsum(n_segs, out=seg_bounds[1:])
    t0, t1 = offsets[seg_bounds[:-1]], offsets[seg_bounds[1:]]
    cum_mask = np.zeros(len(mask) + 1, dtype=np.int64)
    np.cumsum(mask, out=cum_mask[1:])
    n_trainable = cum_mask[t1] - cum_mask[t0]
    vmin = np.full(len(trajs), -1, dtype=np.int32)
    vmax = np.full(len(trajs), -1, dtype=np.int32)
    nonempty = t1 > t0
    if nonempty.any():
        # ranges of the non-empty trajectories tile [first start, end) contiguously, so reduceat works
        starts = t0[nonempty]
        lo = np.minimum.reduceat(np.where(mask, versions, _I32.max), starts)
        hi = np.maximum.reduceat(np.where(mask, versions, _I32.min), starts)
        vmin[nonempty], vmax[nonempty] = lo, hi
    gen = n_trainable > 0
    vmin[~gen] = -1
    vmax[~gen] = -1

    def lists(values: np.ndarray, typ: pa.DataType) -> pa.Array:
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type=typ))

    seg_tbl = pa.Table.from_arrays(
        [
            pa.array(seg_tid, pa.string()),
            pa.array(seg_idx, pa.int32()),
            lists(tokens, pa.int32()),
            lists(mask, pa.bool_()),
            lists(logprobs, pa.float32()),
            lists(versions, pa.int32()),
            pa.array([s.start_turn for s in segs], pa.int32()),
            pa.array([s.end_turn for s in segs], pa.int32()),
            pa.array([bool(s.summary) for s in segs], pa.bool_()),
        ],
        schema=SEGMENT_SCHEMA,
    )
    traj_tbl = pa.Table.from_arrays(
        [
            pa.array([t.trajectory_id for t in trajs], pa.string()),
            pa.array([t.env_id for t in trajs], pa.string()),
            pa.array([t.family for t in trajs], pa.string()),
            pa.array([t.domain for t in trajs], pa.string()),
            pa.array([t.env_spec_hash for t in trajs], pa.string()),
            pa.array([t.verifier_hash for t in trajs], pa.string()),
            pa.array([t.iteration for t in trajs], pa.int32()),
            pa.array([float(t.reward) for t in trajs], pa.float64()),
            pa.array([t.status for t in trajs], pa.string()),
            pa.array([_json(t.verifier, t.trajectory_id, "verifier") for t in trajs], pa.string()),
            pa.array([t.engine for t in trajs], pa.string()),
            pa.array([_json(t.timings, t.trajectory_id, "timings") for t in trajs], pa.string()),
            pa.array([float(t.created) for t in trajs], pa.float64()),
            pa.array([t.error for t in trajs], pa.string()),
            pa.array(t1 - t0, pa.int64()),
            pa.array(n_trainable, pa.int64()),
            pa.array(vmin, pa.int32()),
            pa.array(vmax, pa.int32()),
            pa.array(n_segs, pa.int32()),
        ],
        schema=TRAJECTORY_SCHEMA,
    )
    return traj_tbl, seg_tbl


def _list_column(tbl: pa.Table, name: str) -> tuple[np.ndarray, list[int]]:
    """A list column as (flat numpy values, offsets starting at 0)."""
    arr = tbl.column(name).combine_chunks()
    offs = arr.offsets.to_numpy().astype(np.int64)
    return arr.flatten().to_numpy(zero_copy_only=False), (offs - offs[0]).tolist()


def from_arrow(traj_tbl: pa.Table, seg_tbl: pa.Table) -> list[Trajectory]:
    """Rebuild trajectories (in `traj_tbl` row order) from the two tables; segments may come in any order.

    Raises RuntimeError when a trajectory's segments are missing (fewer rows than its `n_segments`).
    """
    by_tid: dict[str, list[tuple[int, Segment]]] = {}
    if seg_tbl.num_rows:
        cols = {n: _list_column(seg_tbl, n) for n in ("tokens", "loss_mask", "logprobs", "versions")}
        offs = cols["tokens"][1]
        if any(c[1] != offs for c in cols.values()):
            raise RuntimeError("segment list columns differ in length")
        tok, msk, lps, ver = (cols[n][0] for n in ("tokens", "loss_mask", "logprobs", "versions"))
        tids = seg_tbl.column("trajectory_id").to_pylist()
        idx = seg_tbl.column("seg_index").to_pylist()
        st = seg_tbl.column("start_turn").to_pylist()
        en = seg_tbl.column("end_turn").to_pylist()
        sm = seg_tbl.column("summary").to_pylist()
        for r in range(seg_tbl.num_rows):
            a, b = offs[r], offs[r + 1]
            seg = Segment(
                tokens=tok[a:b].tolist(),
                loss_mask=msk[a:b].tolist(),
                logprobs=lps[a:b].tolist(),
                versions=ver[a:b].tolist(),
                start_turn=st[r],
                end_turn=en[r],
                summary=sm[r],
            )
            by_tid.setdefault(tids[r], []).append((idx[r], seg))

    rows = traj_tbl.to_pydict()
    out = []
    for r in range(traj_tbl.num_rows):
        tid = rows["trajectory_id"][r]
        segs = sorted(by_tid.get(tid, []), key=lambda x: x[0])
        if len(segs) != rows["n_segments"][r]:
            raise RuntimeError(f"trajectory {tid!r}: {len(segs)} segments stored, expected {rows['n_segments'][r]}")
        out.append(
            Trajectory(
                trajectory_id=tid,
                env_id=rows["env_id"][r],
                family=rows["family"][r],
                domain=rows["domain"][r],
                env_spec_hash=rows["env_spec_hash"][r],
                verifier_hash=rows["verifier_hash"][r],
                iteration=rows["iteration"][r],
                segments=[s for _, s in segs],
                reward=rows["reward"][r],
                status=rows["status"][r],
                verifier=json.loads(rows["verifier"][r]),
                engine=rows["engine"][r],
                timings=json.loads(rows["timings"][r]),
                created=rows["created"][r],
                error=rows["error"][r],
            )
        )
    return out


# ----------------------------------------------------------------------------------------------- queries


def _where(
    iteration: int | Iterable[int] | None,
    status: str | Iterable[str] | None,
    min_version: int | None,
    max_staleness: int | None,
    current_version: int | None,
    ids: Sequence[str] | None = None,
    domain: str | Iterable[str] | None = None,
) -> tuple[str, list]:
    """SQL predicate and parameters for the trajectory filters shared by every read method."""
    clauses: list[str] = []
    params: list = []

    def among(column: str, values: list) -> None:
        clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
        params.extend(values)

    if ids is not None:
        if isinstance(ids, str):
            raise ValueError("ids must be a list of trajectory ids, not one string")
        if not ids:
            return "FALSE", []
        among("trajectory_id", [str(i) for i in ids])
    if domain is not None:
        doms = [domain] if isinstance(domain, str) else list(domain)
        if not doms or not all(isinstance(d, str) for d in doms):
            raise ValueError(f"domain must be a string or a non-empty list of strings, got {domain!r}")
        among("domain", doms)
    if iteration is not None:
        its = [iteration] if isinstance(iteration, int) else list(iteration)
        if not its or not all(isinstance(i, int) for i in its):
            raise ValueError(f"iteration must be an int or a non-empty list of ints, got {iteration!r}")
        among("iteration", its)
    if status is not None:
        sts = [status] if isinstance(status, str) else list(status)
        bad = [s for s in sts if s not in STATUSES]
        if not sts or bad:
            raise ValueError(f"status {status!r}: expected one or more of {STATUSES}")
        among("status", sts)
    # trajectories without generated tokens (n_trainable = 0) have no policy version: version filters keep them
    if min_version is not None:
        clauses.append("(n_trainable = 0 OR min_version >= ?)")
        params.append(int(min_version))
    if max_staleness is not None:
        if current_version is None:
            raise ValueError("max_staleness needs current_version (the trainer's policy version)")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        clauses.append("(n_trainable = 0 OR min_version >= ?)")
        params.append(int(current_version) - int(max_staleness))
    elif current_version is not None:
        raise ValueError("current_version is only used together with max_staleness")
    return (" AND ".join(clauses) or "TRUE"), params


class _Cursors:
    """One DuckDB cursor per thread over a shared connection (a DuckDB connection is not thread-safe)."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self._con = con
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[duckdb.DuckDBPyConnection] = []
        self.closed = False

    def get(self) -> duckdb.DuckDBPyConnection:
        cur = getattr(self._local, "cur", None)
        if cur is None:
            with self._lock:
                if self.closed:
                    raise RuntimeError("the store is closed")
                cur = self._con.cursor()
                self._all.append(cur)
            self._local.cur = cur
        elif self.closed:
            raise RuntimeError("the store is closed")
        return cur

    def close(self) -> None:
        with self._lock:
            self.closed = True
            for c in self._all:
                c.close()
            self._all.clear()


class _Queries(ABC):
    """Read methods shared by `TrajectoryStore` (database tables) and `ParquetReader` (exported files)."""

    _cursors: _Cursors

    @abstractmethod
    def _sources(self, iteration: int | Iterable[int] | None) -> tuple[str, str] | None:
        """SQL table expressions for (trajectories, segments); None when there is nothing to read."""

    @contextmanager
    def _snapshot(self) -> Iterator[duckdb.DuckDBPyConnection]:
        yield self._cursors.get()

    def read(
        self,
        iteration: int | Iterable[int] | None = None,
        status: str | Iterable[str] | None = None,
        min_version: int | None = None,
        max_staleness: int | None = None,
        current_version: int | None = None,
        limit: int | None = None,
        *,
        ids: Sequence[str] | None = None,
        domain: str | Iterable[str] | None = None,
    ) -> list[Trajectory]:
        """Trajectories matching every given filter, ordered by (iteration, created, trajectory_id).

        iteration: one iteration or several. status: one status or several. min_version: every generated
        token came from policy version >= min_version. max_staleness with current_version: keep
        trajectories whose staleness, current_version - min_version over generated tokens, is at most
        max_staleness. Trajectories with no generated tokens pass both version filters. limit: at most
        this many (the first in the order above). ids: only these trajectories (an empty list: none).
        domain: one domain or several.
        """
        return from_arrow(*self.read_arrow(iteration, status, min_version, max_staleness, current_version, limit,
                                           ids=ids, domain=domain))

    def read_arrow(
        self,
        iteration: int | Iterable[int] | None = None,
        status: str | Iterable[str] | None = None,
        min_version: int | None = None,
        max_staleness: int | None = None,
        current_version: int | None = None,
        limit: int | None = None,
        *,
        ids: Sequence[str] | None = None,
        domain: str | Iterable[str] | None = None,
    ) -> tuple[pa.Table, pa.Table]:
        """`read` without building Python objects: (trajectories, segments) Arrow tables for a trainer's collate.

        Same filters and trajectory order as `read`; segments are ordered by (trajectory_id, seg_index).
        Column names are the schema's; list columns come as Arrow list or large_list. Building Python lists
        (`read`) costs about ten times more than this.
        """
        where, params = _where(iteration, status, min_version, max_staleness, current_version, ids, domain)
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        src = self._sources(iteration)
        if src is None:
            return TRAJECTORY_SCHEMA.empty_table(), SEGMENT_SCHEMA.empty_table()
        traj_src, seg_src = src
        lim = "" if limit is None else f" LIMIT {int(limit)}"
        with self._snapshot() as cur:
            # trajectories first, then their segments: see export_parquet for why this order matters
            sel = cur.sql(f"SELECT * FROM {traj_src} WHERE {where} ORDER BY {_ORDER}{lim}", params=params).to_arrow_table()
            cur.register("_temper_selected", sel.select(["trajectory_id"]))
            try:
                segs = cur.sql(
                    f"SELECT * FROM {seg_src} WHERE trajectory_id IN (SELECT trajectory_id FROM _temper_selected) "
                    f"ORDER BY trajectory_id, seg_index"
                ).to_arrow_table()
            finally:
                cur.unregister("_temper_selected")
        return sel, segs

    def count(
        self,
        iteration: int | Iterable[int] | None = None,
        status: str | Iterable[str] | None = None,
        min_version: int | None = None,
        max_staleness: int | None = None,
        current_version: int | None = None,
        *,
        ids: Sequence[str] | None = None,
        domain: str | Iterable[str] | None = None,
    ) -> int:
        """How many trajectories `read` would return with the same filters."""
        where, params = _where(iteration, status, min_version, max_staleness, current_version, ids, domain)
        src = self._sources(iteration)
        if src is None:
            return 0
        with self._snapshot() as cur:
            return cur.execute(f"SELECT count(*) FROM {src[0]} WHERE {where}", params).fetchall()[0][0]

    def stats(self, iteration: int | Iterable[int] | None = None, *, ids: Sequence[str] | None = None) -> dict:
        """Counts, tokens and mean reward of an iteration (None: all), in total, per status and per family.

        Returns {"trajectories", "tokens", "trainable_tokens", "mean_reward" (None when empty), "by_status":
        {status: n}, "by_family": {family: {the same keys, by_status included}}}. ids: only these trajectories.
        """
        where, params = _where(iteration, None, None, None, None, ids)
        src = self._sources(iteration)
        rows = []
        if src is not None:
            with self._snapshot() as cur:
                rows = cur.execute(
                    f"SELECT family, status, count(*), sum(reward), sum(n_tokens), sum(n_trainable) "
                    f"FROM {src[0]} WHERE {where} GROUP BY family, status ORDER BY family, status",
                    params,
                ).fetchall()

        def empty() -> dict:
            return {"trajectories": 0, "tokens": 0, "trainable_tokens": 0, "reward_sum": 0.0, "by_status": {}}

        total, fams = empty(), {}
        for family, status, n, rsum, ntok, ntrain in rows:
            for acc in (total, fams.setdefault(family, empty())):
                acc["trajectories"] += n
                acc["tokens"] += int(ntok)
                acc["trainable_tokens"] += int(ntrain)
                acc["reward_sum"] += rsum
                acc["by_status"][status] = acc["by_status"].get(status, 0) + n

        def finish(acc: dict) -> dict:
            rsum = acc.pop("reward_sum")
            acc["mean_reward"] = rsum / acc["trajectories"] if acc["trajectories"] else None
            return acc

        out = finish(total)
        out["by_family"] = {f: finish(a) for f, a in fams.items()}
        return out

    def domain_rewards(self, ids: Sequence[str], iteration: int | None = None) -> dict[str, dict]:
        """The verifier rewards of the trajectories `ids`, per domain, from the store's `rewards` view:
        {domain: {"trajectories": n, "mean_reward": r, "by_status": {status: n}, "ids": [...]}}, ids in the
        store's order. Every trajectory counts, crashed ones at their reward of 0: this is what the policy earned."""
        where, params = _where(iteration, None, None, None, None, ids, None)
        src = self._sources(iteration)
        out: dict[str, dict] = {}
        if src is None:
            return out
        with self._snapshot() as cur:
            rows = cur.execute(f"SELECT domain, trajectory_id, status, reward FROM {src[0]} WHERE {where} "
                               f"ORDER BY domain, {_ORDER}", params).fetchall()
        for dom, tid, status, reward in rows:
            d = out.setdefault(dom, {"trajectories": 0, "reward_sum": 0.0, "by_status": {}, "ids": []})
            d["trajectories"] += 1
            d["reward_sum"] += reward
            d["by_status"][status] = d["by_status"].get(status, 0) + 1
            d["ids"].append(tid)
        for d in out.values():
            d["mean_reward"] = d.pop("reward_sum") / d["trajectories"]
        return out


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


def _quote(s: str | os.PathLike) -> str:
    return "'" + str(s).replace("'", "''") + "'"


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
            raise
        self._wlock = threading.Lock()
        try:
            if not read_only:
                self._con.execute(_DDL)
                self._con.execute(
                    "INSERT INTO store_meta VALUES ('schema_version', ?) ON CONFLICT DO NOTHING", [str(SCHEMA_VERSION)]
                )
            self._check_schema()
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


# ----------------------------------------------------------------------------------------------- parquet


class ParquetReader(_Queries):
    """Reads `TrajectoryStore.export_parquet` output (folders `iteration-NNNNNN/` under `root`) without the database.

    Same `read`/`count`/`stats` API and filters as the store. Runs on an in-memory DuckDB connection, so
    any number of processes can read while the writer process holds the database file. Files are
    listed at each call, so new exports show up without reopening.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._con = duckdb.connect(":memory:")
        self._cursors = _Cursors(self._con)

    def _folders(self) -> dict[int, Path]:
        out = {}
        if self.root.is_dir():
            for d in self.root.iterdir():
                name = d.name
                if name.startswith("iteration-") and name[10:].isdigit() and (d / "trajectories.parquet").is_file():
                    out[int(name[10:])] = d
        return dict(sorted(out.items()))

    def iterations(self) -> list[int]:
        """The exported iterations, ascending."""
        return list(self._folders())

    def _sources(self, iteration: int | Iterable[int] | None) -> tuple[str, str] | None:
        folders = self._folders()
        if iteration is not None:
            wanted = {iteration} if isinstance(iteration, int) else set(iteration)
            folders = {i: d for i, d in folders.items() if i in wanted}
        if not folders:
            return None

        def scan(name: str) -> str:
            files = ", ".join(_quote(d / f"{name}.parquet") for d in folders.values())
            return f"read_parquet([{files}], hive_partitioning = false)"

        return scan("trajectories"), scan("segments")

    def close(self) -> None:
        self._cursors.close()
        self._con.close()

    def __enter__(self) -> ParquetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
