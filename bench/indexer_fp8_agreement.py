"""How much of the fp32 indexer's top-k the FP8 e4m3 indexer keeps (`model.indexer_fp8`; issue 41's aim: ≥ 97%).

    python bench/indexer_fp8_agreement.py [--device cpu|cuda] [--json out.json]

For each row of queries: the share of the fp32 selection's key positions that the FP8 selection also picks (both
sets of min(k, allowed keys) positions, ties to the earlier position), averaged over the rows that have more allowed
keys than k (a row with fewer selects all of them in both modes). `indexer_topk` as the model calls it: on a CPU the
twins (the FP8 twin quantises queries per token and head and keys per token to e4m3 and computes with the
dequantised values: what the FP8 tensor-core kernel computes in exact arithmetic), on CUDA the Triton kernels.

Inputs:
- GLM-5's indexer shapes (32 heads × 128, ReLU, fp32 head weights) with Gaussian queries, keys and weights, the last
  T queries of an S-token context (bench/gpu.py's FP8 row: 97.9% at T 2048, S 8192, k 2048 on the H200);
- a stress case: the keys LayerNorm'd around one common direction (pairwise cosine ≈ 0.8) and each query leaning
  towards 16 earlier keys, so every head score carries a shared part ~50× the spread that ranks the keys, and the
  e4m3 rounding of that shared part (relative to each row's largest element) reorders them;
- the shipped tiny base model's own indexer (4 heads × 32, top-64) on this repository's README, its first layer's
  queries, weights and keys as the model computes them: trained activations, at tiny's scale.

The last column turns q and k by an orthonormal Hadamard matrix before quantising (exact in fp32; what production
FP8 indexers do, temper's FP8 path does not yet): how much of the loss the rotation would win back.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def hadamard(d: int, dev: torch.device) -> torch.Tensor:
    """The orthonormal d × d Sylvester-Hadamard matrix (d a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).to(dev)


def agreement(q, w, k, qpos, topk: int) -> dict:
    """{"rows", "mean", "min", "exact", "rotated"} of the FP8 selection against the fp32 one over rows with more than
    topk allowed keys; "rotated": the mean with q and k turned by a Hadamard matrix first (the rotation production
    FP8 indexers apply: it leaves the fp32 scores as they are and spreads a common direction over all dims)."""
    import temper_kernels as kernels

    a = kernels.indexer_topk(q, w, k, qpos, topk)
    n = a.shape[-1]
    live = (qpos + 1 > n).reshape(-1)
    a = a.reshape(-1, n)[live]

    def share(b: torch.Tensor) -> torch.Tensor:
        b = b.reshape(-1, n)[live]
        hits = torch.zeros(a.shape[0], device=a.device)
        for i in range(0, a.shape[0], 64):  # [rows, n, n] compares, 64 rows at a time
            hits[i : i + 64] = (a[i : i + 64, :, None] == b[i : i + 64, None, :]).any(-1).sum(-1).float()
        return hits / n

    plain = share(kernels.indexer_topk(q, w, k, qpos, topk, fp8=True))
    h = hadamard(q.shape[-1], q.device)
    rotated = share(kernels.indexer_topk(q @ h, w, k @ h, qpos, topk, fp8=True))
    return {"rows": int(a.shape[0]), "mean": float(plain.mean()), "min": float(plain.min()),
            "exact": float((plain == 1).float().mean()), "rotated": float(rotated.mean())}


def synthetic(t: int, s: int, structured: bool, dev: torch.device, seed: int = 0, h: int = 32, d: int = 128):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, t, h, d, generator=g)
    w = torch.randn(1, t, h, generator=g) * h**-0.5
    k = torch.randn(1, s, d, generator=g)
    if structured:  # LayerNorm'd keys around a shared direction; each query leans towards 16 earlier keys
        k = torch.nn.functional.layer_norm(k + 2.0 * torch.randn(d, generator=g), (d,))
        qpos0 = s - t
        picks = torch.randint(0, s, (t, 16), generator=g) % (torch.arange(t)[:, None] + qpos0 + 1)
        q = q + 0.5 * k[0, picks].sum(1)[None, :, None, :]
    qpos = (torch.arange(t) + (s - t))[None]
    return q.to(dev), w.to(dev), k.to(dev), qpos.to(dev)


def tiny_base(dev: torch.device, t: int = 1024):
    """The first indexer's (q, w, k, qpos) of checkpoints/tiny-base on README.md's first `t` bytes."""
    import model.attention as attn
    from model import ByteTokenizer, load_checkpoint

    m = load_checkpoint(ROOT / "checkpoints/tiny-base").eval().to(dev)
    ids = torch.tensor([ByteTokenizer().encode((ROOT / "README.md").read_text())[:t]], device=dev)
    seen = []
    real = attn.kernels.indexer_topk

    def spy(q, w, k, qpos, topk, **kw):
        seen.append((q, w, k, qpos))
        return real(q, w, k, qpos, topk, **kw)

    attn.kernels.indexer_topk = spy
    try:
        with torch.no_grad():
            m.run(ids)
    finally:
        attn.kernels.indexer_topk = real
    return seen[0], m.config.index_topk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    big = dev.type == "cuda"
    shapes = [(512, 4096, 512), (512, 8192, 2048), (512, 16384, 2048)]
    if big:
        shapes += [(2048, 8192, 2048), (4096, 32768, 2048)]
    rows, out = [], []
    for structured in (False, True):
        name = "GLM-5 shapes, " + ("keys sharing a direction" if structured else "Gaussian")
        for t, s, topk in shapes:
            r = agreement(*synthetic(t, s, structured, dev), topk)
            rows.append([name, t, s, topk, r["rows"], f"{100 * r['mean']:.2f}%", f"{100 * r['min']:.1f}%",
                         f"{100 * r['exact']:.1f}%", f"{100 * r['rotated']:.2f}%"])
            out.append({"inputs": name, "T": t, "S": s, "k": topk, **r})
    (q, w, k, qpos), topk = tiny_base(dev)
    r = agreement(q, w, k, qpos, topk)
    rows.append(["tiny-base's indexer on README", q.shape[1], k.shape[1], topk, r["rows"], f"{100 * r['mean']:.2f}%",
                 f"{100 * r['min']:.1f}%", f"{100 * r['exact']:.1f}%", f"{100 * r['rotated']:.2f}%"])
    out.append({"inputs": "tiny-base", "T": q.shape[1], "S": k.shape[1], "k": topk, **r})
    path = "Triton kernels" if dev.type == "cuda" else "torch twins"
    table(f"FP8 e4m3 indexer top-k: share of the fp32 selection kept ({path}, {dev.type}; aim ≥ 97%)",
          ["inputs", "T", "S", "k", "rows", "agreement", "worst row", "rows identical", "Hadamard first"], rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": str(dev), "path": path, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
