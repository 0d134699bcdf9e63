"""Issue 41's correctness checks on the GPU, ≤ 1 minute: the FP8 indexer's agreement, and the kernels past 2³¹ elements.

Every input is drawn on the device by a device generator (drawing the offsets section's 9.3·10⁹ elements on a host
generator took ~2 minutes, longer than the cap). The FP8 agreement, an aim, runs first.

1. offsets — each kernel that addressed its tensors with 32-bit offsets, run where they wrapped (bf16, the Triton
   kernels), its result on the rows past 2³¹ elements compared with the torch twin computed on those rows alone:
   - sparse MLA forward + backward, 65,536 tokens × 64 heads × 576 (2.4 G query elements; it wrapped at 58,255);
   - rope on the model's strided q slice at 135,168 tokens × 64 heads (it wrapped past 131,072);
   - the Triton grouped GEMM (the path of a GPU without torch's `_grouped_mm`) forward + backward over 360,448 rows ×
     6144 (2.2 G), and over 72 experts × 4096 × 8192 weights (the expert offset, 2.4 G);
   the backward's output gradient is zero except on the checked rows, so every input gradient is the twin's too.
   Each row of the table gives the largest difference relative to the twin's largest value (bf16 rounding: ~1e-3;
   a wrapped offset reads another row: ~1).
2. fp8 — `bench/indexer_fp8_agreement.py`'s measure with the Triton kernels: GLM-5's indexer shapes at 32K context,
   and the tiny base model's trained indexer.

`--smoke` runs both at toy shapes in fp32 (on a CPU: the offsets section's kernels under TRITON_INTERPRET=1, the
fp8 section on the twins; tested), so the script stays working without a GPU:

    PYTHONPATH=<cp312 wheels dir>:. python bench/gpu_checks.py --out $OUT        # bash bench/gpu_run.sh checks
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import Figures  # noqa: E402
from gpu_common import table, use_card  # noqa: E402

FIGURES = Figures("checks.json")
record = FIGURES.record
ROWS: list[list] = []


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _row(name: str, size: str, **diffs: float) -> None:
    worst = max(diffs.values())
    ok = worst <= 2e-2
    ROWS.append([name, size, " ".join(f"{k} {v:.1e}" for k, v in diffs.items()), "ok" if ok else "WRONG"])
    record("offsets", name, {"size": size, **diffs, "ok": ok})


def sparse_mla(dev, dtype, t: int, h: int, dv: int, dr: int, k: int, tail: int) -> None:
    from temper_kernels import sparse_mla, sparse_mla_reference

    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, t, h, dv + dr, generator=g, device=dev, dtype=dtype).requires_grad_()
    kv = torch.randn(1, t, dv + dr, generator=g, device=dev, dtype=dtype).requires_grad_()
    qpos = torch.arange(t, device=dev)[None]
    idx = (torch.rand(1, t, k, generator=g, device=dev) * (qpos[..., None] + 1)).long()  # k of each query's past
    scale = (dv + dr) ** -0.5
    o = sparse_mla(q, kv, idx, qpos, scale, dv)
    do = torch.zeros_like(o)
    do[:, -tail:] = torch.randn(1, tail, h, dv, generator=g, device=dev, dtype=dtype)
    o.backward(do)
    qs, kvs = q.detach()[:, -tail:].requires_grad_(), kv.detach().requires_grad_()
    want = sparse_mla_reference(qs, kvs, idx[:, -tail:], qpos[:, -tail:], scale, dv)
    want.backward(do[:, -tail:])
    _row("sparse MLA fwd+bwd", f"{t:,} tokens × {h} heads × {dv + dr}: {q.numel() / 2**31:.2f}·2³¹",
         o=_rel(o[:, -tail:], want), dq=_rel(q.grad[:, -tail:], qs.grad), dkv=_rel(kv.grad, kvs.grad),
         dq_rest=float(q.grad[:, :-tail].abs().max()))  # (0 exactly: their output gradient is 0)


def rope(dev, dtype, t: int, h: int, nope: int, r: int, tail: int) -> None:
    from temper_kernels import rope, rope_reference

    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(1, t, h, nope + r, generator=g, device=dev, dtype=dtype)
    ang = torch.rand(1, t, 1, r // 2, generator=g, device=dev) * 6.3
    cos, sin = ang.cos(), ang.sin()
    got = rope(q[..., nope:], cos, sin, True)  # the model's strided slice
    want = rope_reference(q[:, -tail:, :, nope:].float(), cos[:, -tail:], sin[:, -tail:], True)
    _row("rope (q's rotary slice)", f"{t:,} tokens × {h} heads × {nope + r}: {q.numel() / 2**31:.2f}·2³¹",
         y=_rel(got[:, -tail:], want))


def grouped_mm(dev, dtype, m: int, e: int, nout: int, kin: int, tail: int, last_expert_only: bool) -> None:
    from temper_kernels.moe import _GroupedMM

    g = torch.Generator(device=dev).manual_seed(2)
    xs = torch.randn(m, kin, generator=g, device=dev, dtype=dtype).requires_grad_()
    w = torch.randn(e, nout, kin, generator=g, device=dev, dtype=dtype).mul_(kin**-0.5).requires_grad_()
    ends = torch.arange(1, e + 1) * (m // e)  # each expert's end row (cumulative)
    if last_expert_only:
        ends = (torch.arange(e) == e - 1) * m  # every row to the last expert
    ends = ends.to(dev, torch.int32)
    y = _GroupedMM.apply(xs, w, ends)  # the Triton kernels, not torch's _grouped_mm
    dy = torch.zeros_like(y)
    dy[-tail:] = torch.randn(tail, nout, generator=g, device=dev, dtype=dtype)
    y.backward(dy)
    x_t, w_t, dy_t = xs.detach()[-tail:].float(), w.detach()[-1].float(), dy[-tail:].float()
    what = f"{e} experts × {nout} × {kin}: {w.numel() / 2**31:.2f}·2³¹" if last_expert_only else (
        f"{m:,} rows × {kin}: {xs.numel() / 2**31:.2f}·2³¹")
    name = f"grouped GEMM fwd+bwd (Triton), {'expert' if last_expert_only else 'row'} offsets"
    _row(name, what, y=_rel(y[-tail:], x_t @ w_t.T), dx=_rel(xs.grad[-tail:], dy_t @ w_t),
         dw=_rel(w.grad[-1], dy_t.T @ x_t), dw_rest=float(w.grad[:-1].abs().max()))


def offsets(smoke: bool, dev) -> None:
    dtype = torch.float32 if smoke else torch.bfloat16
    if smoke and dev.type == "cpu":  # the Triton kernels under the interpreter (main set TRITON_INTERPRET)
        os.environ["TEMPER_KERNELS"] = "triton"
    try:
        _offsets(smoke, dev, dtype)
    finally:
        os.environ.pop("TEMPER_KERNELS", None)
    table("Kernels past 2³¹ elements against their twins on the last rows (max |Δ| / max |twin|)",
          ["kernel", "size", "differences", "result"], ROWS)


def _offsets(smoke: bool, dev, dtype) -> None:
    if smoke:
        sparse_mla(dev, dtype, 40, 4, 16, 16, 8, 4)
        rope(dev, dtype, 24, 4, 16, 16, 4)
        grouped_mm(dev, dtype, 96, 3, 16, 32, 8, False)
        grouped_mm(dev, dtype, 8, 3, 16, 32, 8, True)
    else:
        sparse_mla(dev, dtype, 65536, 64, 512, 64, 64, 8)
        rope(dev, dtype, 135168, 64, 192, 64, 8)
        grouped_mm(dev, dtype, 360448, 4, 64, 6144, 64, False)
        grouped_mm(dev, dtype, 64, 72, 4096, 8192, 64, True)
        torch.cuda.empty_cache()


def fp8(smoke: bool, dev) -> None:
    from indexer_fp8_agreement import agreement, synthetic, tiny_base

    rows = []
    for t, s, topk in ([(32, 128, 16)] if smoke else [(2048, 8192, 2048), (4096, 32768, 2048)]):
        r = agreement(*synthetic(t, s, False, dev, h=4 if smoke else 32, d=16 if smoke else 128), topk)
        record("fp8", f"gaussian T{t} S{s} k{topk}", r)
        rows.append(["GLM-5 shapes, Gaussian", t, s, topk, f"{100 * r['mean']:.2f}%", f"{100 * r['rotated']:.2f}%"])
    (q, w, k, qpos), topk = tiny_base(dev, t=80 if smoke else 1024)
    r = agreement(q, w, k, qpos, topk)
    record("fp8", "tiny-base", r)
    rows.append(["tiny-base's indexer on README", q.shape[1], k.shape[1], topk, f"{100 * r['mean']:.2f}%",
                 f"{100 * r['rotated']:.2f}%"])
    table("FP8 e4m3 indexer top-k: share of the fp32 selection kept (aim ≥ 97%)",
          ["inputs", "T", "S", "k", "agreement", "Hadamard first"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/gpu")
    ap.add_argument("--smoke", action="store_true", help="toy shapes in fp32 (a CPU under the Triton interpreter)")
    ap.add_argument("--sections", nargs="+", default=["fp8", "offsets"], choices=["offsets", "fp8"])
    args = ap.parse_args()
    FIGURES.to(args.out)
    dev = torch.device("cpu" if args.smoke and not torch.cuda.is_available() else "cuda")
    if dev.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: its kernels become interpreter functions
    record("device", "name", use_card(dev, FIGURES))
    FIGURES.run({"fp8": lambda: fp8(args.smoke, dev), "offsets": lambda: offsets(args.smoke, dev)}, args.sections)


if __name__ == "__main__":
    main()
