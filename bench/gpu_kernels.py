"""The kernels section of the GPU bench (bench/gpu.py): each Triton kernel against its torch reference.

In the order of the aims (K2): the sparse MLA and its tile sweep first, then the indexer and top-k (GLM-5's shapes at
8K and 32K context) and its tilings, then the rest (MoE, norms, rope, SwiGLU, the router, the chunked loss). Each part
records as it goes, so a call cut by its cap keeps the aims' rows."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit decorates the kernels


from gpu_common import bench, kernel_mode, peak_gbs, peak_gib, peak_reset, peak_tflops, record, table  # noqa: E402

import temper_kernels as kernels  # noqa: E402
from temper_kernels import indexer as kix  # noqa: E402
from temper_kernels import mla as kmla  # noqa: E402
from temper_kernels import moe as kmoe  # noqa: E402
from temper_kernels import norm as knorm  # noqa: E402
from temper_kernels import rotary as krope  # noqa: E402


class Rows:
    """The kernel-vs-reference rows of one part: `both` times the reference and the Triton kernel, records the row at
    once, and keeps going when one kernel fails (compile, resources): a failure must not lose the others' figures."""

    def __init__(self, dev):
        self.dev, self.rows = dev, []

    def both(self, name, ref_fn, tri_fn, flops=None, nbytes=None, check=None):
        dev = self.dev
        try:
            with kernel_mode("reference"):
                t_ref = bench(ref_fn, dev)
            with kernel_mode("triton"):
                t_tri = bench(tri_fn, dev)
            rate = (f"{flops / t_tri / 1e12:,.1f} TFLOP/s ({100 * flops / t_tri / 1e12 / peak_tflops():.0f}%)" if flops
                    else f"{nbytes / t_tri / 1e9:,.0f} GB/s ({100 * nbytes / t_tri / 1e9 / peak_gbs():.0f}%)")
            extra = check() if check else ""
        except Exception as e:
            self.rows.append([name, "—", "—", "—", "—", f"{type(e).__name__}: {str(e)[:120]}"])
            record("kernels", name, {"error": f"{type(e).__name__}: {e}"})
            return
        self.rows.append([name, f"{1e3 * t_ref:.3f}", f"{1e3 * t_tri:.3f}", t_ref / t_tri, rate, extra])
        record("kernels", name, {"ref_ms": 1e3 * t_ref, "triton_ms": 1e3 * t_tri, "rate": rate, "check": extra})

    def table(self, title: str) -> None:
        table(title, ["kernel", "reference ms", "triton ms", "speed-up", "rate (% of the card's peak)", "check"],
              self.rows)


def section_kernels(dev, dtype, smoke: bool) -> None:
    """The three parts in the order of the aims; one that raises is recorded and the next still runs."""
    import traceback

    for name, part in (("sparse_mla", kernels_mla), ("indexer", kernels_indexer), ("others", kernels_others)):
        try:
            part(dev, dtype, smoke)
        except Exception as e:
            traceback.print_exc()
            record("kernels", f"{name} error", f"{type(e).__name__}: {e}")


def kernels_mla(dev, dtype, smoke: bool) -> None:
    """The sparse MLA forward and forward+backward (FlashMLA's shapes: 64 heads, d 576/512, top-2048) and the tile
    sweep, BK 64 among the tiles (N = 32 a warpgroup on sm_90 where BK 32 gives 16)."""
    g = torch.Generator(dev).manual_seed(0)
    r = Rows(dev)
    both = r.both
    # sparse MLA (FlashMLA's shapes: 64 heads, d 576/512, top-2048)
    t, h, dv, dr, kk, s = (8, 4, 32, 16, 16, 64) if smoke else (4096, 64, 512, 64, 2048, 8192)
    qm = (torch.randn(1, t, h, dv + dr, device=dev, generator=g) * 0.1).to(dtype).requires_grad_()
    kv = (torch.randn(1, s, dv + dr, device=dev, generator=g) * 0.1).to(dtype).requires_grad_()
    qp = (torch.arange(t, device=dev) + (s - t))[None]
    idx = torch.sort(torch.rand(1, t, s, device=dev, generator=g).masked_fill(
        torch.arange(s, device=dev) > qp[..., None], -1).topk(kk, -1).indices, -1).values
    scale = (dv + dr) ** -0.5
    fl_f = 2 * t * h * kk * (dv + dr + dv)
    with torch.no_grad():
        o_r = kmla.sparse_mla_reference(qm, kv, idx, qp, scale, dv)
        try:
            with kernel_mode("triton"):
                o_t = kernels.sparse_mla(qm, kv, idx, qp, scale, dv)
            err = (o_t.float() - o_r.float()).abs().max().item()
        except Exception as e:
            o_t, err = o_r, float("nan")
            print(f"sparse MLA kernel failed: {type(e).__name__}: {e}", flush=True)
    with torch.no_grad():
        both("sparse MLA forward", lambda: kmla.sparse_mla_reference(qm, kv, idx, qp, scale, dv),
             lambda: kernels.sparse_mla(qm, kv, idx, qp, scale, dv), flops=fl_f, check=lambda: f"max |Δ| {err:.1e}")
    go = torch.randn_like(o_t)

    def fb(ref: bool):
        o = kmla.sparse_mla_reference(qm, kv, idx, qp, scale, dv) if ref else kernels.sparse_mla(qm, kv, idx, qp,
                                                                                                  scale, dv)
        torch.autograd.grad(o, (qm, kv), go)

    def grad_check() -> str:
        """The Triton backward's gradients against the reference's (max |Δ| / max |ref|, per input)."""
        o_ref = kmla.sparse_mla_reference(qm, kv, idx, qp, scale, dv)
        want = torch.autograd.grad(o_ref, (qm, kv), go)
        with kernel_mode("triton"):
            got = torch.autograd.grad(kernels.sparse_mla(qm, kv, idx, qp, scale, dv), (qm, kv), go)
        r = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, want)]
        return f"grad rel dq {r[0]:.1e}, dkv {r[1]:.1e}"

    both("sparse MLA fwd+bwd", lambda: fb(True), lambda: fb(False), flops=fl_f * 3.5, check=grad_check)

    r.table("sparse MLA vs the torch reference")
    _mla_sweep(dev, smoke, qm, kv, idx, qp, scale, dv, dr, o_r, fl_f, fb)


def _mla_sweep(dev, smoke: bool, qm, kv, idx, qp, scale, dv, dr, o_r, fl_f, fb) -> None:
    """The sparse MLA tiles: (heads, keys, warps) per program, for every launch (the dkv kernel's keys too). Every head
    of a token in one program (64: the default, 8 warps) gathers each selected row once; 16 heads a program (the
    former default) gathers it four times and issues four times the dkv atomics."""
    h = qm.shape[2]
    sweep = []
    for blocks in ([(16, 16, 4), (32, 16, 8), (16, 64, 4)] if smoke else
                   [(64, 32, 8), (64, 64, 8), (64, 16, 8), (32, 64, 8), (32, 32, 8), (32, 16, 8), (16, 32, 4)]):
        kmla.BLOCKS = blocks
        try:
            with torch.no_grad(), kernel_mode("triton"):
                err = (kernels.sparse_mla(qm, kv, idx, qp, scale, dv).float() - o_r.float()).abs().max().item()
                t_f = bench(lambda: kernels.sparse_mla(qm, kv, idx, qp, scale, dv), dev)
            with kernel_mode("triton"):
                t_fb = bench(lambda: fb(False), dev)
            atomics = kmla.dkv_atomics(idx, qp, h, dv, dr, bh=blocks[0])  # the backward's fp32 adds into dkv
            res = {"fwd_ms": 1e3 * t_f, "fwd_tflops": fl_f / t_f / 1e12, "fwdbwd_ms": 1e3 * t_fb,
                   "max_abs_err": err, "dkv_atomics": atomics}
            sweep.append([str(blocks), f"{1e3 * t_f:.3f}", f"{fl_f / t_f / 1e12:,.1f}", f"{1e3 * t_fb:.3f}", err,
                          f"{atomics:,}"])
        except Exception as e:  # out of registers or shared memory: a row that says so
            res = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            sweep.append([str(blocks), "—", "—", "—", res["error"][:80], "—"])
        finally:
            kmla.BLOCKS = None
        record("kernels", f"sparse_mla_tiles {blocks}", res)
    table("sparse MLA tiles (heads, keys, warps per program)", ["tiles", "forward ms", "forward TFLOP/s",
                                                                "fwd+bwd ms", "max |Δ| vs reference",
                                                                "dkv atomics"], sweep)


def kernels_indexer(dev, dtype, smoke: bool) -> None:
    """The lightning indexer + top-k at GLM-5's shapes (32 heads × 128, top-2048) over 8K and 32K keys (the aim: top-k
    at 32K context below the sparse MLA's time), fp32 and FP8, then the tilings of its two kernels."""
    g = torch.Generator(dev).manual_seed(0)
    r = Rows(dev)
    for s_ in ((64, 128) if smoke else (8192, 32768)):
        _indexer_rows(r, dev, g, smoke, s_)
    r.table("indexer + top-k vs the torch reference")
    _indexer_sweep(dev, g, smoke)


def _indexer_q(dev, g, smoke: bool, s: int):
    """GLM-5's indexer inputs at s keys: the last t queries of the context (t = 2048, or 8 in --smoke)."""
    t, hi, d, topk = (8, 2, 16, 16) if smoke else (2048, 32, 128, 2048)
    q = torch.randn(1, t, hi, d, device=dev, generator=g)
    w = torch.randn(1, t, hi, device=dev, generator=g)
    k = torch.randn(1, s, d, device=dev, generator=g)
    qpos = (torch.arange(t, device=dev) + (s - t))[None]
    return q, w, k, qpos, topk, 2 * t * s * hi * d


def _indexer_rows(r: Rows, dev, g, smoke: bool, s: int) -> None:
    q, w, k, qpos, topk, fl = _indexer_q(dev, g, smoke, s)
    t = q.shape[1]

    def agree(fp8):
        """fp32: is the kernel's set the twin's? fp8: the share of the fp32 selection the fp8 one keeps."""
        with kernel_mode("triton"):
            a = kernels.indexer_topk(q, w, k, qpos, topk, fp8=fp8)
        with kernel_mode("reference"):
            r = kix.indexer_topk_reference(q, w, k, qpos, topk)
        if not fp8:
            return f"identical set: {torch.equal(a, r)}"  # both ascending by position
        hits = sum(int((a[0, i:i + 64, :, None] == r[0, i:i + 64, None, :]).any(-1).sum()) for i in range(0, t, 64))
        return f"agreement with fp32 top-k {hits / r.numel():.4f}"

    r.both(f"indexer top-k fp32, {s:,} keys", lambda: kix.indexer_topk_reference(q, w, k, qpos, topk),
           lambda: kernels.indexer_topk(q, w, k, qpos, topk), flops=fl, check=lambda: agree(False))
    r.both(f"indexer top-k fp8, {s:,} keys", lambda: kix.indexer_topk_reference(q, w, k, qpos, topk, fp8=True),
           lambda: kernels.indexer_topk(q, w, k, qpos, topk, fp8=True), flops=fl, check=lambda: agree(True))


def _indexer_sweep(dev, g, smoke: bool) -> None:
    q, w, k, qpos, topk, fl = _indexer_q(dev, g, smoke, 64 if smoke else 8192)
    # the indexer's two kernels apart (the scores; the radix-select top-k), over a few tilings: (query rows, keys,
    # warps) of the scores kernel and the top-k kernel's warps (None: the defaults). The scores dot's M is query rows ×
    # 32 heads: fp32 runs FMA dots (M 64 by default), FP8 (what GLM-5 runs) e4m3 wgmma (M 128 by default)
    sweep = []
    want_sel = {fp8: kix.indexer_topk_reference(q, w, k, qpos, topk, fp8=fp8) for fp8 in (False, True)}
    for fp8, blocks in ([(False, None), (False, (16, 16, 4, 2)), (True, None)] if smoke else
                        [(False, None), (False, (4, 64, 8, 8)), (True, None), (True, (4, 64, 8, 8)),
                         (True, (2, 128, 4, 8)), (True, (8, 64, 8, 8)), (True, (4, 128, 8, 16))]):
        kix.BLOCKS = blocks
        name = f"{'fp8' if fp8 else 'fp32'} {blocks or 'default'}"
        try:
            with kernel_mode("triton"):
                same = torch.equal(kernels.indexer_topk(q, w, k, qpos, topk, fp8=fp8), want_sel[fp8])
                t_all = bench(lambda fp8=fp8: kernels.indexer_topk(q, w, k, qpos, topk, fp8=fp8), dev)
                t_sc = bench(lambda fp8=fp8: kix._indexer_topk_triton(q, w, k, qpos, topk, fp8, scores_only=True), dev)
            res = {"all_ms": 1e3 * t_all, "scores_ms": 1e3 * t_sc, "topk_ms": 1e3 * (t_all - t_sc),
                   "scores_tflops": fl / t_sc / 1e12, "identical_set": same}
            sweep.append([name, f"{1e3 * t_all:.3f}", f"{1e3 * t_sc:.3f}", f"{1e3 * (t_all - t_sc):.3f}",
                          f"{fl / t_sc / 1e12:,.1f}", same])
        except Exception as e:  # out of resources: a row that says so
            res = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            sweep.append([name, "—", "—", "—", "—", res["error"][:80]])
        finally:
            kix.BLOCKS = None
        record("kernels", f"indexer_tiles {name}", res)
    table("indexer top-k tilings (scores: rows, keys, warps; top-k warps)", [
        "tiles", "all ms", "scores ms", "top-k ms", "scores TFLOP/s (t·s keys)", "set = its twin's"], sweep)


def kernels_others(dev, dtype, smoke: bool) -> None:
    """MoE grouped GEMM, RMSNorm, rope, SwiGLU, the router's selection, and the chunked loss's peak memory."""
    g = torch.Generator(dev).manual_seed(0)
    r = Rows(dev)
    both = r.both
    # MoE grouped GEMM (the 524M config's expert shapes, 16K tokens)
    n, hd, inter, e, topk_e = (64, 32, 16, 4, 2) if smoke else (16384, 1024, 704, 32, 4)
    x = torch.randn(n, hd, device=dev, generator=g).to(dtype)
    gu = (torch.randn(e, 2 * inter, hd, device=dev, generator=g) * hd**-0.5).to(dtype)
    dn = (torch.randn(e, hd, inter, device=dev, generator=g) * inter**-0.5).to(dtype)
    eidx = torch.rand(n, e, device=dev, generator=g).topk(topk_e, -1).indices
    ew = torch.rand(n, topk_e, device=dev, generator=g).to(dtype)
    fl_m = 2 * n * topk_e * 3 * hd * inter
    with torch.no_grad():
        with kernel_mode("triton"):
            y_t = kernels.moe_experts(x, eidx, ew, gu, dn)
        y_r = kmoe.moe_experts_reference(x, eidx, ew, gu, dn)
        rel = ((y_t.float() - y_r.float()).norm() / y_r.float().norm()).item()
        both("MoE experts (grouped GEMM)", lambda: kmoe.moe_experts_reference(x, eidx, ew, gu, dn),
             lambda: kernels.moe_experts(x, eidx, ew, gu, dn), flops=fl_m, check=lambda: f"rel. error {rel:.1e}")

    # RMSNorm
    n, d = (64, 48) if smoke else (32768, 2048)
    xn = torch.randn(n, d, device=dev, generator=g).to(dtype)
    wn = torch.ones(d, device=dev, dtype=dtype)
    with torch.no_grad():
        both("RMSNorm forward", lambda: knorm.rms_norm_reference(xn, wn, 1e-6), lambda: kernels.rms_norm(xn, wn, 1e-6),
             nbytes=2 * xn.numel() * xn.element_size())
    # rotary: the query's rotary slice of a GLM-5-sized batch (64 heads, r = 64), cos/sin broadcast over the heads
    b_, t_, h_, r_ = (2, 8, 4, 16) if smoke else (4, 4096, 64, 64)
    qf = torch.randn(b_, t_, h_, 128 + r_, device=dev, generator=g).to(dtype)
    ang = torch.randn(b_, t_, 1, r_ // 2, device=dev, generator=g)
    cs, sn = ang.cos().to(dtype), ang.sin().to(dtype)
    with torch.no_grad():
        err = (kernels.rope(qf[..., 128:], cs, sn, True).float()
               - krope.rope_reference(qf[..., 128:].float(), cs.float(), sn.float(), True)).abs().max().item()
        both("rotary (rope) forward", lambda: krope.rope_reference(qf[..., 128:], cs, sn, True),
             lambda: kernels.rope(qf[..., 128:], cs, sn, True), nbytes=2 * b_ * t_ * h_ * r_ * qf.element_size(),
             check=lambda: f"max |Δ| vs fp32 {err:.1e}")
    # SwiGLU with the routing weight, forward+backward, on the experts' rows (16K tokens × top-4, width 704) read in
    # place from their [g | u]
    m_, i_ = (64, 48) if smoke else (65536, 704)
    gu_rows = torch.randn(m_, 2 * i_, device=dev, generator=g).to(dtype).requires_grad_()
    rw = torch.rand(m_, device=dev, generator=g).to(dtype).requires_grad_()
    dy_s = torch.randn(m_, i_, device=dev, generator=g).to(dtype)

    def swiglu_fb(ref: bool):
        gg, uu = gu_rows.chunk(2, -1)
        y = kernels.swiglu_reference(gg, uu, rw) if ref else kernels.swiglu(gg, uu, rw)
        y.backward(dy_s)
        gu_rows.grad = rw.grad = None

    with torch.no_grad(), kernel_mode("triton"):
        gg, uu = gu_rows.chunk(2, -1)
        err_s = (kernels.swiglu(gg, uu, rw).float() - kernels.swiglu_reference(gg.float(), uu.float(),
                                                                               rw.float())).abs().max().item()
    both("SwiGLU (routing weight) fwd+bwd", lambda: swiglu_fb(True), lambda: swiglu_fb(False),
         nbytes=(2 * m_ * 2 * i_ + 2 * m_ * i_) * gu_rows.element_size(), check=lambda: f"max |Δ| vs fp32 {err_s:.1e}")
    # the router's selection: 16K tokens, GLM-5's 256 experts in 8 groups keeping 4, top-8
    n_, e_ = (64, 32) if smoke else (16384, 256)
    lg = torch.randn(n_, e_, device=dev, generator=g)
    rb = torch.randn(e_, device=dev, generator=g) * 0.1
    with torch.no_grad():
        with kernel_mode("triton"):
            ri_t, _ = kernels.route(lg, rb, 8, 8, 4, "sigmoid", True, 2.5)
        ri_r, _ = kmoe.route_reference(lg, rb, 8, 8, 4, "sigmoid", True, 2.5)
        same = (ri_t == ri_r).all(-1).float().mean().item()
        both("router selection (256 experts, 8 groups, top-8)",
             lambda: kmoe.route_reference(lg, rb, 8, 8, 4, "sigmoid", True, 2.5),
             lambda: kernels.route(lg, rb, 8, 8, 4, "sigmoid", True, 2.5), nbytes=lg.numel() * 4,
             check=lambda: f"same experts and order: {100 * same:.1f}% of tokens")
    r.table("kernels vs torch references")

    # chunked cross-entropy: peak memory of the loss on a 150K vocabulary
    n, hdim, vocab = (64, 32, 300) if smoke else (16384, 2048, 151552)
    hid = torch.randn(n, hdim, device=dev, generator=g).to(dtype).requires_grad_()
    wv = (torch.randn(vocab, hdim, device=dev, generator=g) * 0.02).to(dtype).requires_grad_()
    tg = torch.randint(0, vocab, (n,), device=dev, generator=g)
    mem = {}
    for name, fn in (("full logits", lambda: F.cross_entropy(F.linear(hid, wv).float(), tg)),
                     ("chunked", lambda: knorm.chunked_cross_entropy(hid, wv, tg))):
        peak_reset(dev)
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        fn().backward()
        mem[name] = (peak_gib(dev) - base / 2**30) if dev.type == "cuda" else float("nan")
        hid.grad = wv.grad = None
    record("kernels", "cross_entropy_peak_gib", mem)
    table(f"cross-entropy peak memory above inputs, {n} rows × {vocab} vocab", ["path", "GiB"],
          [[k, v] for k, v in mem.items()])


# ---- 3. decode -----------------------------------------------------------------------------------------------
