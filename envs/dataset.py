"""Datasets of specs on disk: `specs.jsonl` + `manifest.json` with the file's sha256 and every spec's
hashes, so a reader can tell exactly which environments (and verifiers) a run trained on."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from pathlib import Path

from .spec import TaskSpec

SPECS = "specs.jsonl"
MANIFEST = "manifest.json"


def write_dataset(specs: list[TaskSpec], path: str | os.PathLike, meta: dict | None = None) -> dict:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (SPECS + ".tmp")
    with open(tmp, "w") as f:
        for s in specs:
            f.write(s.model_dump_json() + "\n")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path / SPECS)
    digest = hashlib.sha256((path / SPECS).read_bytes()).hexdigest()
    manifest = {
        "n": len(specs),
        "families": dict(Counter(s.family for s in specs)),
        "sha256": digest,
        "specs": [{"id": s.id, "family": s.family, "spec_hash": s.spec_hash, "verifier_hash": s.verifier_hash}
                  for s in specs],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(meta or {}),
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def read_dataset(path: str | os.PathLike, verify: bool = True) -> list[TaskSpec]:
    path = Path(path)
    if not (path / SPECS).exists():
        raise FileNotFoundError(f"{path}: no {SPECS} (not a temper env dataset)")
    if verify and (path / MANIFEST).exists():
        want = json.loads((path / MANIFEST).read_text())["sha256"]
        got = hashlib.sha256((path / SPECS).read_bytes()).hexdigest()
        if got != want:
            raise ValueError(f"{path}: {SPECS} sha256 {got[:12]}… does not match the manifest's {want[:12]}…")
    specs = [TaskSpec.model_validate_json(line) for line in (path / SPECS).read_text().splitlines() if line.strip()]
    if verify:
        for s in specs:
            s.check_hashes()
    return specs
