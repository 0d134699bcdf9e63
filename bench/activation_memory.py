"""What one training forward keeps for its backward, counted on the CPU: the model on the `meta` device in bf16 with
every op on its Triton branch (`temper_kernels.meta.on_meta`, the CUDA path as an H200 runs it), and every tensor
autograd saves recorded by a saved-tensors hook (each storage once; the weights not counted). Two losses, each with
the whole logits and through the head in row chunks (`model.losses.head_chunk_rows`):

* the LM step: next-token loss + the MTP loss (`lm_forward_loss`, `mtp_loss`: SFT, the base recipe);
* the policy's scoring: `token_logprobs` with its graph (log-probabilities and entropy: SAO's and OPD's actor).

    python bench/activation_memory.py [--sizes 524M 2B] [--batch 4] [--seq 4096]

The figure is the bytes saved for the backward at the end of the forward: the activations part of a step's peak
(the weights, their gradients and the optimizer come on top, and so does the backward's own working memory, here one
chunk's logits and their gradient). A chunk's tensors are recomputed in the backward, so they are not saved. The
configs are bench/gpu.py's (the issue's 524M config, and the GLM-5-proportioned 2B one), with one MTP layer.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import table  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def saved_bytes(fn, exclude=()) -> tuple[int, collections.Counter]:
    """Bytes of the storages autograd saves while `fn()` runs (each once, and none of `exclude`'s: the weights, which
    a backward reads where they are), and their split by the project line that saved them."""
    seen: dict[int, tuple[int, str]] = {}
    keep = []
    skip = {t.untyped_storage()._cdata for t in exclude}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        key = st._cdata
        if key not in seen and key not in skip:
            where = "?"
            for f in reversed(traceback.extract_stack(limit=40)):
                if f.filename.startswith(ROOT) and "/.venv/" not in f.filename and not f.filename.endswith(
                        ("activation_memory.py", "temper_kernels/memory.py")):
                    where = f"{f.filename[len(ROOT):]}:{f.lineno}"
                    break
            seen[key] = (st.nbytes(), where)
            keep.append(t)  # the storage stays alive, so its key is not reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    by: collections.Counter = collections.Counter()
    for nb, where in seen.values():
        by[where] += nb
    return sum(nb for nb, _ in seen.values()), by


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["524M", "2B"], choices=["524M", "2B"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--top", type=int, default=6, help="the largest savers to list per config (chunked LM step)")
    args = ap.parse_args()
    from gpu_common import hf_config

    import model.losses as losses
    from model import ModelConfig, Transformer, lm_forward_loss, mtp_loss, token_logprobs
    from temper_kernels.meta import on_meta

    gib = 2.0**30
    rows, top = [], []
    for size in args.sizes:
        # with one MTP layer, as GLM-5 trains (bench/gpu.py's configs have none: transformers' model has no MTP)
        cfg = ModelConfig.from_hf_dict({**hf_config(size, False).to_dict(), "num_nextn_predict_layers": 1})
        with torch.device("meta"):
            m = Transformer(cfg).train().to(torch.bfloat16)
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
        mask = torch.ones(args.batch, args.seq, dtype=torch.bool, device="meta")

        def lm_step(m=m, ids=ids, mask=mask):
            out, loss = lm_forward_loss(m, ids, mask)
            return loss + 0.3 * mtp_loss(m, out.hidden, ids, mask, steps=1)

        passes = {"LM step (next-token + MTP)": lm_step, "policy scoring (log-probs + entropy)":
                  lambda m=m, ids=ids: token_logprobs(m, ids)}
        for name, fn in passes.items():
            got = {}
            for mode, limit in (("whole", 1 << 62), ("chunked", losses.LOGITS_CHUNK)):
                saved = losses.LOGITS_CHUNK
                losses.LOGITS_CHUNK = limit
                try:
                    with on_meta():
                        got[mode] = saved_bytes(fn, exclude=[*m.parameters(), *m.buffers()])
                finally:
                    losses.LOGITS_CHUNK = saved
            w, c = got["whole"][0], got["chunked"][0]
            rows.append([size, name, f"{w / gib:.2f}", f"{c / gib:.2f}", f"{w / c:.2f}×", f"{(w - c) / gib:.2f}"])
            if name.startswith("LM"):
                top.append([size, "; ".join(f"{k} {v / gib:.2f}" for k, v in got["chunked"][1].most_common(args.top))])
    table(f"saved for the backward, bf16, B={args.batch}, T={args.seq} (GiB; chunks of {losses.LOGITS_CHUNK:,} "
          "logits)", ["config", "pass", "whole logits", "head in chunks", "ratio", "saved"], rows)
    table("largest savers, LM step through chunks (GiB by line)", ["config", "where"], top)


if __name__ == "__main__":
    main()
