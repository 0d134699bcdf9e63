"""What verifying a checkpoint's checksums costs when it is loaded (model.load_checkpoint(verify=True)).

For a few checkpoint sizes (single file and sharded): load without verification, load with it, and the
verification alone (sha256 of every weight file, streamed in 8 MiB chunks, files hashed in parallel threads).
The first read of each timing is from the page cache (the file was just written); the ratio is what a load pays.

    .venv/bin/python bench/checkpoint_verify.py [--sizes-mb 8 64 256]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import table, timeit

import configs
from model import Transformer, load_checkpoint, save_checkpoint
from model.checkpoint import verify_checkpoint


def model_of(mb: int) -> Transformer:
    """The micro model with its vocabulary widened until its float32 weights are about `mb` MiB (the bytes are what
    hashing costs; their layout does not matter)."""
    base = configs.load("micro").model
    vocab = max(base.vocab_size, (mb << 20) // (2 * base.hidden_size * 4))  # embedding + head
    torch.manual_seed(0)
    return Transformer(base.model_copy(update={"vocab_size": vocab}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[8, 64, 256])
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.sizes_mb:
            m = model_of(mb)
            for shard_mb in (None, max(1, mb // 4)):
                path = Path(tmp) / f"m{mb}-{shard_mb}"
                save_checkpoint(m, path, **({"max_shard_bytes": shard_mb << 20} if shard_mb else {}))
                size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
                n = len(list(path.glob("*.safetensors")))
                plain = timeit(lambda p=path: touch(load_checkpoint(p, verify=False)))
                checked = timeit(lambda p=path: touch(load_checkpoint(p)))
                verify = timeit(lambda p=path: verify_checkpoint(p))
                rows.append([f"{size / 2**20:.0f} MiB", n, plain, checked, verify, checked / plain,
                             size / 2**20 / verify])
    table("load_checkpoint: cost of checksum verification (median of 3, warm page cache; load = build the model "
          "and read every weight once)",
          ["weights", "files", "load s", "load+verify s", "verify s", "ratio", "verify MiB/s"], rows)


def touch(m: Transformer) -> float:
    """Read every weight once (safetensors maps the files: a load alone reads nothing until a weight is used)."""
    with torch.no_grad():
        return float(sum(p.float().sum() for p in m.parameters()))


if __name__ == "__main__":
    main()
