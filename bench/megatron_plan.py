"""GLM-5's real layout on the Megatron backend: parallel sizes and memory per GPU on 8 and on 64 H200s.

    python bench/megatron_plan.py                       # configs/presets/glm5.yaml, 8 and 64 GPUs of 141 GiB
    python bench/megatron_plan.py --gpus 64 128 --seq-len 8192 --preset deepseek_v32

The parameter counts are exact (the model built on the meta device); the memory is the estimate of
`trainers/megatron/plan.py` (its docstring gives every term).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common import table

from configs import load
from trainers.megatron.plan import GIB, RECIPES, bytes_lower_bound, count_params, min_gpus, plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="glm5")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--gpu-gib", type=float, default=141.0)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    a = ap.parse_args()
    cfg = load(a.preset).model
    counts = count_params(cfg)
    kw = {"seq_len": a.seq_len, "micro_batch": a.micro_batch}
    print(f"{a.preset}: {counts.total / 1e9:.1f}B parameters, {counts.experts / 1e9:.1f}B of them routed experts; "
          f"{a.gpu_gib:.0f} GiB per GPU, 90% usable; s = {a.seq_len}, micro-batch {a.micro_batch}, full recompute")
    rows = [[r, f"{bytes_lower_bound(counts, r):,.0f}", str(min_gpus(cfg, r, a.gpu_gib, counts=counts, **kw))]
            for r in RECIPES]
    table("the floor: weights + grads + on-GPU optimizer state, and the fewest GPUs any layout fits on",
          ["recipe", "GiB in all", "fewest GPUs (×8)"], rows)
    report = {"preset": a.preset, "params": counts.total, "experts": counts.experts, "plans": {}}
    for n in a.gpus:
        p = plan(cfg, n, a.gpu_gib, counts=counts, **kw)
        rows = []
        for recipe, r in p["recipes"].items():
            shown = r["fits"] or [r["best_overall"]]
            for e in shown:
                rows.append([recipe, str(e.layout), f"{e.weights:.1f}", f"{e.grads:.1f}", f"{e.optimizer:.1f}",
                             f"{e.activations:.1f}", f"{e.total:.1f}", "yes" if e.total <= p["cap_gib"] else "no",
                             f"{e.host_per_node:,.0f}" if e.host_per_node else "-"])
        table(f"{a.preset} on {n} × {a.gpu_gib:.0f} GiB (fits: ≤ {p['cap_gib']:.0f} GiB; the least-memory layout "
              f"when none fits)", ["recipe", "layout", "weights", "grads", "optimizer", "activations", "total GiB",
                                   "fits", "host GiB/node"], rows)
        report["plans"][n] = {rc: [{"layout": str(e.layout), "total_gib": e.total, "fits": e.total <= p["cap_gib"],
                                    "host_gib_per_node": e.host_per_node}
                                   for e in (r["fits"] or [r["best_overall"]])] for rc, r in p["recipes"].items()}
    out = Path(os.environ.get("OUT", "runs")) / "megatron_plan.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out} ({GIB} bytes per GiB)")


if __name__ == "__main__":
    main()
