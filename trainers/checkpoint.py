"""Resumable training checkpoints: a killed run continues bit-for-bit from its last checkpoint.

Layout of a checkpoint root::

    root/
      step-00000010/
        policy/            HF-layout safetensors + config.json + temper.json (policy version, checksum)
        trainer.pt         optimizer / critic state, step, policy version, data cursor, RNG states, extra
        meta.json          written last: its presence marks the checkpoint complete
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

The policy is stored in the live parameter dtype (float32 stays float32), so restoring is exact.
`trainer.pt` is a pickle (`torch.load(weights_only=False)`): load only checkpoints you wrote.

    save_training_state(ckpt, policy=model, optimizer=opt, step=s, policy_version=v, data_cursor=g.get_state())
    state = load_training_state(ckpt)             # FileNotFoundError naming ckpt when there is none
    restore(state, model, opt)                    # weights, optimizer, RNG states
    g.set_state(state.data_cursor); start = state.step
"""

from __future__ import annotations

import json
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
from model.checkpoint import replace_dir, to_hf_state

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

    @property
    def policy_path(self) -> Path:
        """The HF-layout policy directory (what an inference engine loads)."""
        return self.path / POLICY


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


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
) -> Path:
    """Write `dir/step-NNNNNNNN/` atomically, point `dir/latest` at it, keep the newest `keep` checkpoints.

    `data_cursor` is whatever restores the data stream (a generator state, an offset, a dict); it and
    `extra` must be picklable. Saving a step that already exists replaces it; checkpoints of later steps
    are deleted (they belong to the run that was abandoned when training resumed from an earlier one),
    so `latest` and `load_training_state` always agree on the step just saved. Returns the step directory.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)
    name = step_dir_name(step)
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
    try:
        live_dtype = next((p.dtype for p in policy.parameters() if p.is_floating_point()), torch.float32)
        save_checkpoint(policy, tmp / POLICY, dtype=live_dtype, policy_version=policy_version)
        payload = {
            "format": FORMAT,
            "step": step,
            "policy_version": policy_version,
            "data_cursor": data_cursor,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "critic": critic.state_dict() if critic is not None else None,
            "critic_optimizer": critic_optimizer.state_dict() if critic_optimizer is not None else None,
            "rng": rng_state(),
            "extra": extra or {},
        }
        torch.save(payload, tmp / TRAINER)
        _fsync_file(tmp / TRAINER)
        meta = {"format": FORMAT, "step": step, "policy_version": policy_version, "saved_at": time.time(),
                "critic": critic is not None}
        _write_synced(tmp / META, json.dumps(meta, indent=2))
        _fsync_dir(tmp / POLICY)
        _fsync_dir(tmp)
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
    """A step directory that finished saving (meta.json is written last, before the rename)."""
    return (path / META).is_file() and (path / TRAINER).is_file() and (path / POLICY / "config.json").is_file()


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


def load_training_state(dir: str | os.PathLike) -> TrainingState:
    """Read the newest complete checkpoint under `dir` (see `latest_checkpoint`)."""
    path = latest_checkpoint(dir)
    payload = torch.load(path / TRAINER, map_location="cpu", weights_only=False)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path / TRAINER}: unknown checkpoint format {payload.get('format')!r} (expected {FORMAT})")
    return TrainingState(
        path=path, step=payload["step"], policy_version=payload["policy_version"], data_cursor=payload["data_cursor"],
        optimizer=payload["optimizer"], critic=payload["critic"], critic_optimizer=payload["critic_optimizer"],
        rng=payload["rng"], extra=payload["extra"],
    )


def restore(
    state: TrainingState,
    policy: Transformer,
    optimizer: torch.optim.Optimizer | None,
    critic: nn.Module | None = None,
    critic_optimizer: torch.optim.Optimizer | None = None,
    *,
    rng: bool = True,
) -> TrainingState:
    """Load a checkpoint into live objects, in place (optimizers keep pointing at the same parameters).

    Restores the policy weights (persistent buffers such as router biases included), the optimizer,
    the critic and its optimizer when given, and — unless `rng=False` — the torch / CUDA / Python /
    NumPy RNG states. The data cursor and `extra` are the caller's to apply. Returns `state`.
    """
    saved = load_checkpoint(state.policy_path)
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
        obj.load_state_dict(sd)
    if rng:
        set_rng_state(state.rng)
    return state
