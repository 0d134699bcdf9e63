"""The Megatron backend's optimizer (trainers/optim.py, `ShardedAdamW`), both sides in one run.

    python bench/megatron_optimizer.py                 # micro, 200 steps; two gloo ranks at EP = 2
    python bench/megatron_optimizer.py --preset tiny --steps 300 --lr 1e-3

1. **bf16 training** (one rank; per seed, the model's initialisation and the data): the same model, data and steps
   as an fp32 run, with bf16 weights updated (a) by a bf16 AdamW, as the backend did before, and (b) through fp32
   main weights and fp32 main gradients. Each step accumulates two micro-batches. The table gives the loss on the
   training rows along the way, and how far each bf16 run's weights end from the fp32 run's (relative L2 over every
   weight), then each bf16 run's final loss minus the fp32 run's of the same seed, as a mean over seeds with a 95%
   t-interval.
2. **Sharding** (two gloo ranks, EP = 2, distributed optimizer): optimizer state a rank holds and the time of
   `optimizer.step()`, a whole AdamW on every rank against `ShardedAdamW`, after the same steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

import configs  # noqa: E402
from model import Transformer  # noqa: E402
from trainers.megatron.convert import megatron_state  # noqa: E402


def _batch(vocab: int, rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows, seq), generator=g)


ARMS = (("fp32, AdamW", torch.float32), ("bf16, bf16 AdamW", torch.bfloat16),
        ("bf16, fp32 main weights + grads", torch.bfloat16))


def _train(be, cfg, arm: str, dtype, seed: int, steps: int, lr: float, seq: int, marks: list[int]) -> dict:
    from trainers.megatron.parity import step_loss

    ids = _batch(cfg.vocab_size, 8, seq, seed)
    n = ids.shape[0] * (ids.shape[1] - 1)
    be.dtype = dtype
    torch.manual_seed(seed)
    m = be.wrap(Transformer(cfg))
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0) if arm.startswith("bf16, bf16") else \
        be.optimizer(m.parameters(), lr=lr, weight_decay=0.0)
    losses = {}
    t0 = time.perf_counter()
    for step in range(steps):
        total = 0.0
        for rows in (ids[:4], ids[4:]):  # two micro-batches into one step
            loss, _, _ = step_loss(m, rows, n)
            loss.backward()
            total += float(loss)
        be.all_reduce_grads(m)
        be.clip_grad_norm(m, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in marks:
            losses[step] = total
    return {"losses": losses, "state": {k: v.detach().float().clone() for k, v in megatron_state(m).items()},
            "seconds": time.perf_counter() - t0, "optimizer": type(opt).__name__}


def bf16_training(preset: str, steps: int, lr: float, seq: int, seeds: list[int]) -> None:
    from trainers.megatron.backend import MegatronBackend

    cfg = configs.load(preset).model
    be = MegatronBackend(1, 1, 1, 1)
    marks = sorted({0, steps // 4, steps // 2, steps - 1})
    runs: dict[tuple[str, int], dict] = {}
    try:
        for seed in seeds:
            for arm, dtype in ARMS:
                runs[arm, seed] = _train(be, cfg, arm, dtype, seed, steps, lr, seq, marks)
    finally:
        be.close()
    rows, gaps = [], {}
    for (arm, seed), r in runs.items():
        ref = runs["fp32, AdamW", seed]
        num = sum((r["state"][k] - ref["state"][k]).pow(2).sum() for k in ref["state"])
        den = sum(ref["state"][k].pow(2).sum() for k in ref["state"])
        gaps.setdefault(arm, []).append(r["losses"][steps - 1] - ref["losses"][steps - 1])
        rows.append([arm, seed, r["optimizer"], *(f"{r['losses'][s]:.4f}" for s in marks),
                     f"{float((num / den).sqrt()):.2e}", f"{r['seconds']:.1f}"])
    table(f"bf16 training, {preset}, {steps} steps of 2 micro-batches, lr {lr}, loss on the training rows",
          ["run", "seed", "optimizer", *(f"loss @ step {s + 1}" for s in marks), "weights vs fp32 (rel. L2)", "s"],
          rows)
    summary = []
    for arm, g in gaps.items():
        mean = statistics.fmean(g)
        half = _t95(len(g)) * statistics.stdev(g) / len(g) ** 0.5 if len(g) > 1 else float("nan")
        summary.append([arm, len(g), f"{mean:+.4f}", f"[{mean - half:+.4f}, {mean + half:+.4f}]"])
    table("final loss minus the fp32 run's, same seed (mean over seeds, 95% t-interval)",
          ["run", "seeds", "mean gap", "95% interval"], summary)


def _t95(n: int) -> float:
    """Student's t quantile for a 95% two-sided interval of a mean of n values (n − 1 degrees of freedom)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1))


def _rank(rank: int, port: int, preset: str, steps: int, lr: float, seq: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from trainers.megatron.backend import MegatronBackend
    from trainers.megatron.parity import step_loss

    cfg = configs.load(preset).model
    be = MegatronBackend(1, 1, 2, 1, distributed_optimizer=True)
    ids = _batch(cfg.vocab_size, 8, seq)
    rows = ids[be.rank :: be.world_size]
    res = {}
    try:
        for arm, zero in (("AdamW on every rank", False), ("ShardedAdamW", True)):
            be.distributed_optimizer = zero
            torch.manual_seed(0)
            m = be.wrap(Transformer(cfg))
            opt = be.optimizer(m.parameters(), lr=lr, weight_decay=0.0)
            times = []
            for _ in range(steps):
                loss, _, _ = step_loss(m, rows, ids.shape[0] * (ids.shape[1] - 1))
                loss.backward()
                be.all_reduce_grads(m)
                be.clip_grad_norm(m, 1.0)
                torch.distributed.barrier()
                t = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t)
                opt.zero_grad(set_to_none=True)
            if zero:
                held = opt.local_state_bytes()
            else:
                held = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items()
                           if k in ("exp_avg", "exp_avg_sq"))
            res[arm] = {"held": held, "step_ms": 1e3 * statistics.median(times[1:]),
                        "params": sum(p.numel() for p in m.parameters()),
                        "state": {k: v.detach().float().clone() for k, v in megatron_state(m).items()}}
    finally:
        be.close()
    torch.save(res, Path(out) / f"rank{rank}.pt")


def sharding(preset: str, steps: int, lr: float, seq: int) -> None:
    from trainers.backends import free_port

    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(_rank, args=(free_port(), preset, steps, lr, seq, out), nprocs=2, join=True)
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(2)]
    rows = []
    for r, res in enumerate(ranks):
        whole, zero = res["AdamW on every rank"], res["ShardedAdamW"]
        same = all(torch.equal(whole["state"][k], zero["state"][k]) for k in whole["state"])
        rows.append([r, whole["params"], f"{whole['held'] / 2**20:.3f}", f"{zero['held'] / 2**20:.3f}",
                     f"{zero['held'] / whole['held']:.3f}",
                     f"{whole['step_ms']:.2f}", f"{zero['step_ms']:.2f}", f"{zero['step_ms'] / whole['step_ms']:.2f}",
                     "yes" if same else "NO"])
    table(f"EP = 2 on two gloo ranks, {preset}, fp32: optimizer state per rank (Adam's two moments; ShardedAdamW: "
          f"its share of them), optimizer.step() median over {steps - 1} steps",
          ["rank", "params held", "AdamW state MiB", "ShardedAdamW state MiB", "ratio",
           "AdamW step ms", "ShardedAdamW step ms", "ratio", "same weights after"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sections", nargs="+", default=["bf16", "sharding"], choices=["bf16", "sharding"])
    a = ap.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if "bf16" in a.sections:
        bf16_training(a.preset, a.steps, a.lr, a.seq, a.seeds)
    if "sharding" in a.sections:
        sharding(a.preset, min(a.steps, 20), a.lr, a.seq)


if __name__ == "__main__":
    main()
