"""How many kernels one step issues on the CUDA path, counted on the CPU: the model on the `meta` device with every
op on its Triton branch (`temper_kernels.meta.on_meta`), aten ops counted by a dispatch mode. Views (view, slice,
permute, …) and allocations launch nothing; every other aten op launches about one CUDA kernel, and each Triton
launch one more.

    python bench/decode_ops.py [--sizes 524M 2B]

On the H200, eager decode took 24 ms a step at batch 1 and at batch 64 alike (bench/gpu.py): a step cost that does
not grow with the batch is launch overhead, and this count says how many launches there are to pay for (and what a
CUDA graph replays as one). The configs are bench/gpu.py's.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import table  # noqa: E402

VIEWS = {"view", "_unsafe_view", "expand", "slice", "select", "t", "transpose", "permute", "unsqueeze", "squeeze",
         "as_strided", "alias", "reshape", "detach", "split", "unbind", "chunk", "split_with_sizes", "narrow",
         "lift_fresh", "promote_types", "result_type", "_reshape_alias", "empty", "empty_like", "empty_strided",
         "new_empty", "new_empty_strided"}  # views and allocations: no kernel


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launches(self) -> int:
        return sum(n for k, n in self.ops.items() if k not in VIEWS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["524M", "2B"], choices=["524M", "2B"])
    ap.add_argument("--top", type=int, default=8, help="the most frequent aten ops to list per config")
    args = ap.parse_args()
    from gpu_common import hf_config

    from model import KVCache, ModelConfig, Transformer
    from rollout.engine import DecodeGraphs, EngineStats
    from temper_kernels.meta import on_meta

    rows, common_ops = [], []
    for size in args.sizes:
        cfg = ModelConfig.from_hf_dict(hf_config(size, False).to_dict())
        with torch.device("meta"):
            model = Transformer(cfg).eval().to(torch.bfloat16)
            cache = KVCache(cfg, 65, 4 * cfg.index_topk, dtype=torch.bfloat16, device=torch.device("meta"))
        graphs = DecodeGraphs(model, cache, 64, EngineStats())
        for batch in (1, 64):
            for n_keys in (cfg.index_topk // 2, 4 * cfg.index_topk):
                with on_meta() as launched, torch.no_grad(), Count() as c:
                    graphs.step(torch.zeros(batch, 1, dtype=torch.long, device="meta"),
                                torch.arange(batch, device="meta"), torch.ones(batch, dtype=torch.long, device="meta"),
                                n_keys)
                path = "dense" if n_keys <= cfg.index_topk else "sparse"
                rows.append([size, f"decode, batch {batch}, {n_keys} keys ({path})", c.launches(), len(launched),
                             c.launches() + len(launched), round((c.launches() + len(launched)) / cfg.num_hidden_layers)])
                if batch == 64 and path == "sparse":
                    top = [f"{k} {n}" for k, n in c.ops.most_common() if k not in VIEWS][: args.top]
                    common_ops.append([size, ", ".join(top)])
        with torch.device("meta"):
            train = Transformer(cfg).train().to(torch.bfloat16)
        ids = torch.zeros(1, 2 * cfg.index_topk, dtype=torch.long, device="meta")
        with on_meta() as launched, Count() as c:
            out = train.run(ids)
            out.logits.float().sum().backward()
        rows.append([size, f"forward + backward, T = {ids.shape[1]}", c.launches(), len(launched),
                     c.launches() + len(launched), round((c.launches() + len(launched)) / cfg.num_hidden_layers)])
    table("kernels one step issues on the CUDA path (counted on the CPU, meta device)",
          ["config", "step", "aten ops (no views)", "Triton launches", "kernels", "per layer"], rows)
    table("the most frequent aten ops of a sparse decode step at batch 64", ["config", "ops"], common_ops)


if __name__ == "__main__":
    main()
