"""The trajectory store's Arrow form: the two tables' schemas and the conversions from and to `Trajectory` (split out
of store/trajectories.py, which re-exports them)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from rollout.types import STATUSES, Segment, Trajectory

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
_I32 = np.iinfo(np.int32)


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
