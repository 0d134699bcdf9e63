"""The trajectory store's queries (`read`, `read_arrow`, `count`, `stats`, `domain_rewards`), shared by the DuckDB store
and `ParquetReader` (split out of store/trajectories.py, which re-exports `ParquetReader`)."""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa

from rollout.types import STATUSES, Trajectory
from store.arrow import SEGMENT_SCHEMA, TRAJECTORY_SCHEMA, from_arrow

_ORDER = "iteration, created, trajectory_id"


def _quote(s: str | os.PathLike) -> str:
    return "'" + str(s).replace("'", "''") + "'"


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
