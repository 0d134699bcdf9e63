"""Resumable training checkpoints: a killed run continues bit-for-bit from its last checkpoint.

Layout of a checkpoint root::

    root/
      step-00000010/
        policy/            HF-layout safetensors + config.json + temper.json (policy version, checksum)
        trainer.pt         optimizer / critic state, step, policy version, data cursor, RNG states, extra
        meta.json          written last: its presence marks the checkpoint complete; sha256 of trainer.pt (and of
                           every rank file)
      step-00000015/ …
      latest               "step-00000015": the newest complete checkpoint
      .step-00000020.*     a save in progress (or abandoned by a crash): never read

Atomicity: a checkpoint is assembled in a hidden temp directory, every file is fsynced, the directory
is renamed to `step-NNNNNNNN` (an atomic rename within one filesystem) and the root directory fsynced;
only then is `latest` replaced (write + fsync + `os.replace`). A crash at any point leaves either the
previous checkpoint or the new one as the newest complete one; `load_training_state` trusts complete
`step-*` directories (with `meta.json`) rather than the pointer alone, so a crash between the rename
and the pointer update loses nothing. One writer per root (in data parallelism: the main rank);
leftover temp directories of crashed writers are removed by the next save.

Sharded training state (`backend.sharded_state`: Megatron ranks, each holding its own tensor- / expert-parallel
shard and that shard's optimizer moments): every rank calls `save_training_state` (a collective). The policy is
gathered into temper's model and written whole by rank 0, as above, so engines and `temper eval` read it like
any other; each rank writes its own `rank-RRRRR.pt` (its optimizer, critic and critic optimizer shards, its RNG
states, the layout) into the same temp directory; rank 0 renames it only after every rank reported its file
written, and `meta.json` names the rank count, so a checkpoint missing a rank file is not complete. `restore`
with the backend loads each rank's own file and refuses another layout with the keys to change.

Integrity: `load_training_state` checks every file against the checksums recorded at save (meta.json, the policy's
temper.json) and unpickles trainer.pt; a damaged newest state (a truncated trainer.pt, a flipped byte) is skipped with
a warning naming it, and the newest intact one is resumed instead.

The policy is stored in the live parameter dtype (float32 stays float32), so restoring is exact.
`trainer.pt` is a pickle (`torch.load(weights_only=False)`): load only checkpoints you wrote.

    save_training_state(ckpt, policy=model, optimizer=opt, step=s, policy_version=v, data_cursor=g.get_state())
    state = load_training_state(ckpt)             # FileNotFoundError naming ckpt when there is none
    restore(state, model, opt)                    # weights, optimizer, RNG states
    g.set_state(state.data_cursor); start = state.step
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from model import Transformer, load_checkpoint, save_checkpoint
from model.checkpoint import ChecksumError, file_sha256, replace_dir, to_hf_state, verify_checkpoint, verify_files

log = logging.getLogger(__name__)

FORMAT = 1
LATEST = "latest"
META = "meta.json"
TRAINER = "trainer.pt"
POLICY = "policy"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


@dataclass
class TrainingState:
    """Everything `save_training_state` wrote, read back from one complete checkpoint directory."""

    path: Path  # the step directory
    step: int
    policy_version: int
    data_cursor: Any
    optimizer: dict | None = None
    critic: dict | None = None
    critic_optimizer: dict | None = None
    rng: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    ranks: int = 0  # > 0: a sharded state, one `rank-RRRRR.pt` per rank (their optimizers, critics and RNGs)
    layout: dict | None = None  # the parallel layout that saved a sharded state
    verified: bool = False  # its files were checked against their checksums when it was read
    skipped: list = field(default_factory=list)  # (path, why) of newer states passed over as damaged

    @property
    def policy_path(self) -> Path:
        """The HF-layout policy directory (what an inference engine loads)."""
        return self.path / POLICY


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def rng_state() -> dict:
    """RNG states of torch (CPU and every CUDA device), Python's `random` and NumPy's global generator."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- save --------------------------------------------------------------------------------------------
def save_training_state(
    dir: str | os.PathLike,
    *,
    policy: Transformer,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    policy_version: int,
    data_cursor: Any,
    critic: nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
    keep: int = 3,
    backend=None,
) -> Path:
    """Write `dir/step-NNNNNNNN/` atomically, point `dir/latest` at it, keep the newest `keep` checkpoints.

    `data_cursor` is whatever restores the data stream (a generator state, an offset, a dict); it and
    `extra` must be picklable. Saving a step that already exists replaces it; checkpoints of later steps
    are deleted (they belong to the run that was abandoned when training resumed from an earlier one),
    so `latest` and `load_training_state` always agree on the step just saved. Returns the step directory.

    With a `backend` whose ranks hold shards (`backend.sharded_state`) every rank must call this (see the module
    docstring); otherwise only the main rank does.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    common = {"format": FORMAT, "step": step, "policy_version": policy_version, "data_cursor": data_cursor,
              "extra": extra or {}}
    own = {"optimizer": optimizer.state_dict() if optimizer is not None else None,
           "critic": critic.state_dict() if critic is not None else None,
           "critic_optimizer": critic_optimizer.state_dict() if critic_optimizer is not None else None,
           "rng": rng_state()}
    meta = {"format": FORMAT, "step": step, "policy_version": policy_version, "critic": critic is not None}
    if backend is not None and getattr(backend, "sharded_state", False):
        return _save_sharded(Path(dir), backend, policy, common, own, meta, keep)
    root = Path(dir)
    tmp = _new_temp(root, step)
    try:
        _write_common(tmp, policy, {**common, **own}, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(root, tmp, step, keep)


def _new_temp(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    name = step_dir_name(step)
    return Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))


def _write_common(tmp: Path, policy: nn.Module, payload: dict, meta: dict) -> None:
    """The policy (HF layout, live dtype, its files' checksums in its temper.json), `trainer.pt` and, last,
    `meta.json` (with trainer.pt's checksum), each fsynced."""
    live_dtype = next((p.dtype for p in policy.parameters() if p.is_floating_point()), torch.float32)
    save_checkpoint(policy, tmp / POLICY, dtype=live_dtype, policy_version=payload["policy_version"])
    torch.save(payload, tmp / TRAINER)
    _fsync_file(tmp / TRAINER)
    files = {**meta.get("files", {}), TRAINER: file_sha256(tmp / TRAINER)}
    _write_synced(tmp / META, json.dumps({**meta, "files": files, "saved_at": time.time()}, indent=2))
    _fsync_dir(tmp / POLICY)
    _fsync_dir(tmp)


def _commit(root: Path, tmp: Path, step: int, keep: int) -> Path:
    """Rename the finished temp directory into place, point `latest` at it, prune (see `save_training_state`)."""
    name = step_dir_name(step)
    final = root / name
    try:
        replace_dir(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_synced(root / f".{LATEST}.tmp", name + "\n")
    os.replace(root / f".{LATEST}.tmp", root / LATEST)
    _fsync_dir(root)
    done = complete_checkpoints(root)
    for s, path in done:
        if s > step:  # the future of a run that was resumed from an earlier checkpoint: abandoned
            shutil.rmtree(path, ignore_errors=True)
    for _, path in [(s, p) for s, p in done if s <= step][:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    return final


def _save_sharded(root: Path, backend, policy: nn.Module, common: dict, own: dict, meta: dict, keep: int) -> Path:
    """Every rank: the gathered policy and the common payload by rank 0, each rank's own part in its rank file, the
    rename by rank 0 once every rank's file is on disk. A rank that fails to write fails the save on every rank."""
    import torch.distributed as dist

    full = backend.export(policy)  # a collective: temper's model, gathered from the shards
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list = [str(_new_temp(root, common["step"])) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    err, sha = None, None
    try:
        torch.save({"format": FORMAT, "rank": rank, "world": world, "layout": backend.state_layout(), **own},
                   tmp / rank_file(rank))
        _fsync_file(tmp / rank_file(rank))
        sha = file_sha256(tmp / rank_file(rank))
    except Exception as e:  # reported to every rank below, so none waits for a file that will not come
        err = f"rank {rank}: {type(e).__name__}: {e}"
    sums: list = [None] * world
    dist.all_gather_object(sums, sha)  # every rank file's checksum, recorded in meta.json by rank 0
    if rank == 0 and err is None:
        try:
            _write_common(tmp, full, {**common, "ranks": world, "layout": backend.state_layout()},
                          {**meta, "ranks": world, "files": {rank_file(r): x for r, x in enumerate(sums) if x}})
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            err = f"rank {rank}: {type(e).__name__}: {e}"
    errs: list = [None] * world
    dist.all_gather_object(errs, err)
    failed = [e for e in errs if e]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"saving the sharded training state under {root} failed: {'; '.join(failed)}")
    final = _commit(root, tmp, common["step"], keep) if rank == 0 else root / step_dir_name(common["step"])
    dist.barrier()  # no rank goes on (or saves again) before the step directory is in place
    return final


def _remove_stale_temps(root: Path) -> None:
    for p in root.iterdir():
        if p.name.startswith(".step-") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- load --------------------------------------------------------------------------------------------
def is_complete(path: Path) -> bool:
    """A step directory that finished saving (meta.json is written last, before the rename; a sharded state also has
    every rank's file)."""
    if not ((path / META).is_file() and (path / TRAINER).is_file() and (path / POLICY / "config.json").is_file()):
        return False
    try:
        ranks = int(json.loads((path / META).read_text()).get("ranks", 0))
    except (ValueError, TypeError, AttributeError):
        return False
    return all((path / rank_file(r)).is_file() for r in range(ranks))


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first; temp dirs are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and is_complete(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(dir: str | os.PathLike) -> Path:
    """The newest complete step directory under `dir` (or `dir` itself if it is one).

    The `latest` pointer is used when it names a complete checkpoint at least as new as any other;
    otherwise (missing, stale after a crash, hand-edited) the newest complete `step-*` directory wins.
    """
    root = Path(dir)
    if is_complete(root):
        return root
    found = complete_checkpoints(root)
    if not found:
        what = "does not exist" if not root.exists() else "holds no complete checkpoint (step-*/meta.json)"
        raise FileNotFoundError(f"nothing to resume: training checkpoint directory {root} {what}")
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        m = _STEP_DIR.match(target.name)
        if m and is_complete(target) and int(m.group(1)) >= found[-1][0]:
            return target
    return found[-1][1]


class StateUnreadable(RuntimeError):
    """No complete training state under a directory could be read intact."""


def load_training_state(dir: str | os.PathLike) -> TrainingState:
    """Read the newest intact complete checkpoint under `dir` (see `latest_checkpoint`).

    Every file is checked against the checksums recorded at save (trainer.pt and rank files in meta.json, the policy's
    in its temper.json) and trainer.pt must unpickle. A state that fails (truncated, corrupt) is skipped with a
    warning naming it and the reason, and the next older complete one is tried: resume falls back to the newest
    intact state, loudly (`TrainingState.skipped` lists what was passed over). If none is intact, StateUnreadable
    names each one and why."""
    root = Path(dir)
    newest = latest_checkpoint(root)
    candidates = [newest] + [p for _, p in reversed(complete_checkpoints(root)) if p != newest]
    skipped: list[tuple[Path, str]] = []
    # a step directory newer than the one resumed from, but incomplete (its meta.json gone: a save completes by
    # renaming a temporary directory, so this is damage, not a save cut short) is passed over loudly too
    m = _STEP_DIR.match(newest.name)
    if m and root.is_dir():
        for p in sorted(root.iterdir()):
            n = _STEP_DIR.match(p.name)
            if n and p.is_dir() and int(n.group(1)) > int(m.group(1)) and not is_complete(p):
                skipped.append((p, "incomplete: no meta.json"))
                log.warning("training state %s is incomplete (no meta.json) and skipped; resuming from %s", p, newest)
    for path in candidates:
        try:
            state = _read_state(path)
        except Exception as e:  # noqa: BLE001 - a damaged state: the next older one is tried, loudly
            why = f"{type(e).__name__}: {e}"
            skipped.append((path, why))
            log.warning("training state %s is damaged and skipped (%s)%s", path, why,
                        "; trying the next older one" if path != candidates[-1] else "")
            continue
        if skipped:
            log.warning("resuming from %s (step %d): the newer state%s %s could not be read", path, state.step,
                        "s" if len(skipped) > 1 else "", ", ".join(str(p) for p, _ in skipped))
        state.skipped = skipped
        return state
    raise StateUnreadable(f"no intact training state under {root}: "
                          + "; ".join(f"{p.name}: {why}" for p, why in skipped))


def _read_state(path: Path) -> TrainingState:
    meta = json.loads((path / META).read_text())
    if meta.get("files"):  # states saved before checksums were recorded are read unchecked
        verify_files(path, meta["files"], what="training state")
    if not verify_checkpoint(path / POLICY)["checked"]:
        # temper writes a policy's checksums with it (temper.json): a policy without them cannot be vouched for, and
        # reporting it verified would let `restore` load it unchecked
        raise ChecksumError(f"{path / POLICY}: no recorded checksums (its temper.json is missing or has none); "
                            "its weights cannot be verified")
    payload = torch.load(path / TRAINER, map_location="cpu", weights_only=False)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path / TRAINER}: unknown checkpoint format {payload.get('format')!r} (expected {FORMAT})")
    return TrainingState(
        path=path, step=payload["step"], policy_version=payload["policy_version"], data_cursor=payload["data_cursor"],
        optimizer=payload.get("optimizer"), critic=payload.get("critic"),
        critic_optimizer=payload.get("critic_optimizer"), rng=payload.get("rng", {}), extra=payload["extra"],
        ranks=int(payload.get("ranks", 0)), layout=payload.get("layout"), verified=True,
    )


def restore(
    state: TrainingState,
    policy: Transformer,
    optimizer: torch.optim.Optimizer | None,
    critic: nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: bool = True,
    backend=None,
) -> TrainingState:
    """Load a checkpoint into live objects, in place (optimizers keep pointing at the same parameters).

    Restores the policy weights (persistent buffers such as router biases included), the optimizer,
    the critic and its optimizer when given, and — unless `rng=False` — the torch / CUDA / Python /
    NumPy RNG states. The data cursor and `extra` are the caller's to apply. Returns `state`.

    A sharded state (saved by ranks holding shards) needs the `backend` of the same layout: each rank loads its
    own file. Another layout, or a whole state on a sharded backend, is refused with the keys to change (the
    policy itself is whole in every checkpoint: start a new run from it to change the layout).
    """
    sharded = backend is not None and getattr(backend, "sharded_state", False)
    if state.ranks or sharded:
        state = _own_part(state, backend if sharded else None)
    saved = load_checkpoint(state.policy_path, verify=not state.verified)  # (read_state verified it just now)
    if saved.config.model_copy(update={"dtype": policy.config.dtype}) != policy.config:  # dtype: see save
        raise ValueError(f"{state.policy_path}: the checkpoint's model config differs from the policy's")
    with torch.no_grad():
        if hasattr(policy, "load_hf"):  # a model kept in another layout (trainers/megatron)
            policy.load_hf(dict(to_hf_state(saved)))
        else:
            policy.load_state_dict(saved.state_dict(), strict=True)
    for name, obj, sd in (("optimizer", optimizer, state.optimizer), ("critic", critic, state.critic),
                          ("critic_optimizer", critic_optimizer, state.critic_optimizer)):
        if obj is None:
            continue
        if sd is None:
            raise ValueError(f"{state.path}: checkpoint has no {name} state to restore")
        try:
            obj.load_state_dict(sd)
        except (ValueError, KeyError) as e:  # torch's "parameter group that doesn't match the size", another format
            raise ValueError(f"{state.path}: its {name} state does not fit this run's ({type(e).__name__}: {e}). A "
                             "model or optimizer built another way since the save (trainer.kind, "
                             "trainer.megatron.experts, trainer.megatron.distributed_optimizer) cannot resume it; "
                             f"start a new run from its policy ({state.policy_path})") from e
    if rng:
        set_rng_state(state.rng)
    return state


def _own_part(state: TrainingState, backend) -> TrainingState:
    """`state` with this rank's optimizer, critic and RNG read from its rank file (sharded states only)."""
    import dataclasses

    here = backend.state_layout() if backend is not None else None
    saved_layout = dict(state.layout or {})
    if "tp" in saved_layout:  # Megatron layouts saved before these were recorded: SequentialMLP, whole AdamW
        saved_layout.setdefault("experts", "sequential")
        saved_layout.setdefault("distributed_optimizer", False)
    if not state.ranks or backend is None or here != saved_layout:
        saved = f"{state.ranks} ranks with layout {state.layout}" if state.ranks else "one whole state (not sharded)"
        now = f"a sharded layout {here}" if here is not None else "an unsharded backend"
        raise ValueError(f"{state.path}: the training state was saved by {saved}; this run has {now}. Resume with "
                         "the same trainer.world_size, trainer.distributed_optimizer and trainer.megatron (tp, ep, "
                         f"etp, experts, distributed_optimizer), or start a new run from its whole policy "
                         f"({state.policy_path})")
    import torch.distributed as dist

    rank = dist.get_rank()
    own = torch.load(state.path / rank_file(rank), map_location="cpu", weights_only=False)
    if own.get("rank") != rank or own.get("world") != state.ranks:
        raise ValueError(f"{state.path / rank_file(rank)}: holds rank {own.get('rank')} of {own.get('world')}, "
                         f"not rank {rank} of {state.ranks}")
    return dataclasses.replace(state, optimizer=own["optimizer"], critic=own["critic"],
                               critic_optimizer=own["critic_optimizer"], rng=own["rng"])
