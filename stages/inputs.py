"""What a stage's result is a function of, and when a recorded result may be reused (no Dagster here).

A stage's *inputs* are: the config it reads (`CONFIG_READS`: whole sections or single leaves), the identities of the
upstream results it reads (their data versions), its code version, and a few stage-specific extras (the checkpoint a
warm start continues from, the rollout backend). Their hash is the stage's *input key*. Each iteration directory
holds, next to a stage's result (`<asset>.json`), the record of the inputs it was computed from
(`<asset>.inputs.json`):

- the key matches and the result is intact → the result is reused (the caller logs it and says so in metadata);
- the key matches and there is no result yet → a retried or repaired step: what the earlier attempt kept (checkpoints,
  cached verdicts, finished experts) is kept, and the stage resumes from it;
- anything else (inputs changed, or working files of unknown provenance) → the stage's working paths and its old
  result are removed and the stage computes from scratch.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

# the config each asset's result depends on: what its stage function reads (checked against the stage's source by
# tests/pipelines/test_inputs.py) plus what the asset body reads (the served engines: model, loop.n_slots,
# agent.max_context, seed; rewards' envs.mine_every; env_specs' and warm_start's hand_off). A section covers all its leaves.
CONFIG_READS: dict[str, tuple[str, ...]] = {
    "env_specs": ("agent", "base", "envs", "hand_off", "loop.batch_in_flight", "loop.compile_decode"),  # (probes)
    "verified_envs": ("envs.probe_every", "envs.probes", "envs.sandbox", "envs.validate_workers",
                      "loop.max_crashed_share"),
    "warm_start": ("agent", "base", "envs.sandbox", "hand_off", "loop.save_every", "model", "seed", "train", "trainer"),
    "rollout_batches": ("agent", "envs.sandbox", "loop.batch_in_flight", "loop.max_crashed_share", "loop.n_slots",
                        "model", "seed"),
    "rewards": ("envs.mine_every",),
    "sao_experts": ("agent", "envs.sandbox", "loop", "model", "sao", "seed", "trainer"),
    "opd_student": ("agent", "envs.sandbox", "loop.batch_in_flight", "loop.batch_size", "loop.compile_decode",
                    "loop.in_flight", "loop.max_crashed_share", "loop.n_slots", "loop.save_every", "model", "opd", "seed",
                    "trainer"),
    "evaluation": ("agent", "envs.sandbox", "loop.batch_in_flight", "loop.compile_decode", "loop.max_crashed_share",
                   "loop.n_slots", "model", "seed"),
}
# result fields that say how a computation went, not what it computed: left out of a result's identity
VOLATILE = ("seconds", "workers")


def canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _stable(obj):
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if k not in VOLATILE}
    return [_stable(v) for v in obj] if isinstance(obj, list) else obj


def result_id(result: dict) -> str:
    """The identity of a stage result (its Dagster data version): a hash of its content without `VOLATILE` fields (at any depth),
    and of the content checksum of every checkpoint it names (`checkpoint`, top level or one level down): a
    checkpoint rewritten at the same path is another result, and a recorded result whose checkpoint changed since
    is not reused."""
    view = _stable(result)
    named = [result.get("checkpoint"), *(v.get("checkpoint") for v in result.values() if isinstance(v, dict))]
    sums = {p: checkpoint_identity(p) for p in named if isinstance(p, str)}
    return hashlib.sha256(canonical({"result": view, "checkpoints": sums}).encode()).hexdigest()[:16]


def config_inputs(asset: str, config: dict) -> dict:
    """The values of the config paths `asset` reads (`CONFIG_READS`), from the resolved config as JSON."""
    out = {}
    for path in CONFIG_READS[asset]:
        v = config
        for part in path.split("."):
            if not isinstance(v, dict) or part not in v:
                raise KeyError(f"{asset} reads config `{path}`, which the config does not have")
            v = v[part]
        out[path] = v
    return out


def checkpoint_identity(path: str | None) -> str | None:
    """A checkpoint's content checksum as its `temper.json` records it (None: no checkpoint, or none recorded)."""
    if not path:
        return None
    meta = Path(path) / "temper.json"
    try:
        return json.loads(meta.read_text()).get("checksum")
    except (OSError, ValueError):
        return None


def input_key(inputs: dict) -> str:
    return hashlib.sha256(canonical(inputs).encode()).hexdigest()[:16]


def changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """What differs between two input records, as `path: old → new` lines (for the log)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {canonical(a)[:60]} → {canonical(b)[:60]}")
    return out


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


class Memo:
    """One asset's result in one iteration directory, and the inputs it was computed from.

    `inputs`: the stage's inputs (see the module docstring); `work`: the paths the stage writes while it computes
    (checkpoints, caches), removed when the inputs change. `reusable()` → the recorded result, or None; then
    `prepare()` before computing and `save(result)` after."""

    def __init__(self, run_dir: Path, asset: str, inputs: dict, work: list[Path] = ()):
        self.dir, self.asset, self.inputs, self.work = Path(run_dir), asset, inputs, [Path(p) for p in work]
        self.key = input_key(inputs)
        self.result_path = self.dir / f"{asset}.json"
        self.record_path = self.dir / f"{asset}.inputs.json"
        self.result_id: str | None = None

    def record(self) -> dict | None:
        try:
            rec = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) else None

    def reusable(self) -> tuple[dict, dict] | None:
        """(result, record) when a result was computed from these very inputs and is intact, else None."""
        rec = self.record()
        if rec is None or rec.get("key") != self.key or not rec.get("result_id"):
            return None
        try:
            result = json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(result, dict) or result_id(result) != rec["result_id"]:
            return None
        self.result_id = rec["result_id"]
        return result, rec

    def prepare(self, run_id: str = "") -> list[str]:
        """Before computing: keep what an earlier attempt on the same inputs left (it resumes from it); otherwise
        remove the working paths and the old result. Records the inputs. Returns what changed (empty: a fresh
        directory or a resumed attempt)."""
        rec = self.record()
        same = rec is not None and rec.get("key") == self.key
        why: list[str] = []
        if not same:
            left = [p for p in [*self.work, self.result_path] if p.exists()]
            if rec is not None:
                why = changes(rec.get("inputs") or {}, self.inputs) or ["the input key"]
            elif left:
                why = ["working files without a record of their inputs"]
            for p in left:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            _write(self.record_path, {"key": self.key, "inputs": self.inputs, "run_id": run_id, "result_id": None})
        return why

    def save(self, result: dict, run_id: str = "") -> str:
        """After computing: the result (the people's copy `temper run` summarises), then the record that makes it
        reusable. Returns the result's identity."""
        plain = json.loads(json.dumps(result, default=str))
        _write(self.result_path, plain)
        self.result_id = result_id(plain)
        _write(self.record_path, {"key": self.key, "inputs": self.inputs, "run_id": run_id, "result_id": self.result_id})
        return self.result_id
