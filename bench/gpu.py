"""The H200 bench: temper's model, kernels and engine on CUDA against transformers and the torch references.

One script, ≤ 8 minutes on one H200 including warm-up. It prints ratio tables and writes every figure to
`--out/gpu.json` as it goes (a run cut short keeps what it measured):

1. model — forward and forward+backward tokens/s of temper (bf16, Triton kernels) vs transformers'
   GlmMoeDsaForCausalLM on the same weights, MFU (2·N_active or 6·N_active FLOPs per token over 989
   TFLOP/s), peak memory; on the issue's 524M-total config at B=4, T=4096 and on a GLM-5-proportioned
   ~2B config (temper only: transformers' dense-masked DSA does not fit its T).
2. kernels — each Triton kernel vs its torch reference: time, TFLOP/s or GB/s, share of the H200's peak
   (989 dense bf16 TFLOP/s, 4.8 TB/s HBM); the FP8 indexer's top-k agreement with the fp32 selection.
3. decode — the engine's greedy decode tokens/s at batch 1, 16, 64 vs transformers `generate`.
4. parity — a tiny model trained for a few hundred SFT steps on the CPU in fp32, then its logits on a
   fixed input: bf16 on the GPU (Triton kernels) and fp32 on the GPU vs fp32 on the CPU.
5. profile — the top 20 ops by self device time in one forward+backward of the 524M config.

`--smoke` runs every section at toy shapes on whatever device there is (the CPU here: references only,
or the Triton kernels under TRITON_INTERPRET=1 with TEMPER_KERNELS=triton) so the script stays working
without a GPU. Run on the H200 (see README, "GPU"):

    PYTHONPATH=<pydantic wheels dir>:. python bench/gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit decorates the kernels

from common import Figures, md_table  # noqa: E402

import temper_kernels as kernels  # noqa: E402
from temper_kernels import indexer as kix  # noqa: E402
from temper_kernels import mla as kmla  # noqa: E402
from temper_kernels import moe as kmoe  # noqa: E402
from temper_kernels import norm as knorm  # noqa: E402
from temper_kernels import rotary as krope  # noqa: E402

PEAK_TFLOPS = 989.0  # H200 dense bf16
PEAK_GBS = 4800.0  # H200 HBM3e
FIGURES = Figures("gpu.json")
RESULTS = FIGURES.data
record = FIGURES.record
table = md_table


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench(fn, dev, *args, repeat: int = 5, warmup: int = 2) -> float:
    """Median seconds of fn(*args) (synchronised)."""
    for _ in range(warmup):
        fn(*args)
    sync(dev)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        sync(dev)
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


@contextlib.contextmanager
def kernel_mode(mode: str):
    old = os.environ.get("TEMPER_KERNELS")
    os.environ["TEMPER_KERNELS"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TEMPER_KERNELS", None)
        else:
            os.environ["TEMPER_KERNELS"] = old


def peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def peak_gib(dev) -> float:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")


# ---- configs -------------------------------------------------------------------------------------------------
def hf_config(size: str, smoke: bool):
    from transformers import GlmMoeDsaConfig

    if smoke:
        base = dict(vocab_size=272, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                    num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48,
                    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=16,
                    index_n_heads=16, indexer_types=["full", "shared", "full", "shared"])
    elif size == "524M":  # the config: 8 layers, hidden 1024, 16 heads, q/kv 512/256, 32 experts top-4
        base = dict(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                    num_hidden_layers=8, num_attention_heads=16, n_routed_experts=32, num_experts_per_tok=4,
                    kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                    index_topk=512, index_head_dim=128, index_n_heads=16,
                    indexer_types=["full", "shared", "shared", "shared"] * 2)
    else:  # ~2B total, GLM-5-proportioned (MLA 576/512, 64 experts top-8, 1 shared, IndexShare every 4)
        base = dict(vocab_size=65536, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=512,
                    num_hidden_layers=8, num_attention_heads=32, n_routed_experts=64, num_experts_per_tok=8,
                    kv_lora_rank=512, q_lora_rank=1024, qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
                    index_topk=2048, index_head_dim=128, index_n_heads=32, n_group=8, topk_group=4,
                    indexer_types=["full", "shared", "shared", "shared"] * 2)
    return GlmMoeDsaConfig(num_key_value_heads=base["num_attention_heads"], first_k_dense_replace=1,
                           routed_scaling_factor=2.5, max_position_embeddings=8192, **base)


def decode_fidelity_fp32(hf, ours, dev, smoke: bool) -> None:
    """Greedy decode in fp32 on the device: the engine (eager, and with CUDA graphs where there is CUDA) against
    transformers `generate`, token for token (in bf16 a random model's flat logits part them within a few tokens)."""
    from rollout.engine import Engine, GenRequest
    from rollout.sampling import SamplingParams

    b, prompt, new = (2, 16, 8) if smoke else (4, 64, 32)
    prompts = torch.randint(1, 200, (b, prompt), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf.generate(prompts.to(dev), attention_mask=torch.ones_like(prompts).to(dev), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)[:, prompt:].tolist()
    res = {}
    for graphs in ([False, True] if dev.type == "cuda" else [False]):
        eng = Engine(ours, n_slots=b, max_len=prompt + new + 8, start=False, cuda_graphs=graphs)
        reqs = [eng.submit(GenRequest(p.tolist(), SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)))
                for p in prompts]
        while not all(r.future.done() for r in reqs):
            eng.step()
        key = "graphs" if graphs else "eager"
        res[f"{key}_same_as_hf"] = f"{sum(r.output_ids == w for r, w in zip(reqs, want))}/{b}"
        res[f"{key}_cuda_graphs"] = str(eng.stats.cuda_graphs)
        res[f"{key}_graph_replays"] = eng.stats.graph_replays
    record("decode", "fp32_fidelity", res)
    print(f"greedy decode in fp32, {b} × {new} tokens: {res}", flush=True)


def build_pair(size: str, dev, dtype, smoke: bool, with_hf: bool = True, decode_check: bool = False):
    """(transformers model or None, temper model) with the same weights, on dev in dtype. `decode_check`: first
    compare the two's greedy decode in fp32 (`decode_fidelity_fp32`)."""
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    from model import load_checkpoint

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = GlmMoeDsaForCausalLM(hf_config(size, smoke)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_checkpoint(d)
    ours = ours.to(dev)
    if not with_hf:
        del hf
        return None, ours.to(dtype)  # router, bias, rotary and indexer weights stay fp32
    hf = hf.to(dev)
    if dev.type == "cuda" and not smoke:  # fidelity on the GPU in fp32, before the cast
        ids = torch.randint(0, hf.config.vocab_size, (1, 1024), device=dev, generator=torch.Generator(dev).manual_seed(7))
        with torch.no_grad():
            a, b = ours(ids).float(), hf(ids).logits.float()
        record("fidelity_fp32", size, {"max_abs_logit_diff": (a - b).abs().max().item(),
                                       "logit_scale": b.abs().max().item(),
                                       "greedy_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()})
        del a, b
    if decode_check:
        decode_fidelity_fp32(hf, ours, dev, smoke)
    return hf.to(dtype), ours.to(dtype)


def active_params(model) -> int:
    return model.num_parameters(active=True, mtp=False)


def _logits(o) -> torch.Tensor:
    return o if torch.is_tensor(o) else o.logits


def _fwd(m, ids) -> None:
    with torch.no_grad():
        m(ids)


def _fwd_bwd(m, ids) -> None:
    """One forward+backward of the next-token loss: transformers' model on its whole logits, temper's as its trainers
    compute it (`lm_forward_loss`: through the head in row chunks where the logits are large, model/losses.py)."""
    from model import Transformer, lm_forward_loss

    if isinstance(m, Transformer):
        lm_forward_loss(m, ids)[1].backward()
    else:
        out = _logits(m(ids))
        F.cross_entropy(out[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    m.zero_grad(set_to_none=True)


def counted_saved_gib(model, ids) -> float:
    """What `bench/activation_memory.py` counts for this forward+backward (the trainers' next-token loss) on the
    `meta` device: the tensors kept for the backward, without the weights. Recorded beside the measured peak, so the
    CPU's count can be checked against the GPU."""
    from activation_memory import saved_bytes

    from model import Transformer, lm_forward_loss
    from temper_kernels.meta import on_meta

    with torch.device("meta"):  # the same config and dtype, no data (the fp32 islands stay fp32 through the cast)
        m = Transformer(model.config).train().to(model.embed_tokens.weight.dtype)
    ids = torch.zeros(ids.shape, dtype=torch.long, device="meta")
    with on_meta():
        total, _ = saved_bytes(lambda: lm_forward_loss(m, ids), exclude=[*m.parameters(), *m.buffers()])
    return total / 2**30


# ---- 1. model ------------------------------------------------------------------------------------------------
def section_model(dev, dtype, smoke: bool, sizes: list[str]) -> None:
    sizes = ["smoke"] if smoke else sizes
    b, t = (2, 64) if smoke else (4, 4096)
    rows = []
    for size in sizes:
        hf, ours = build_pair(size, dev, dtype, smoke, with_hf=(size != "2B"))
        n_act, n_tot = active_params(ours), ours.num_parameters(mtp=False)
        ids = torch.randint(0, ours.config.vocab_size, (b, t), device=dev, generator=torch.Generator(dev).manual_seed(1))
        n = b * t
        res = {"total_params": n_tot, "active_params": n_act}

        peak_reset(dev)
        res["temper_fwd_s"] = bench(_fwd, dev, ours, ids, repeat=3, warmup=1)
        peak_reset(dev)
        res["temper_fwdbwd_s"] = bench(_fwd_bwd, dev, ours, ids, repeat=3, warmup=1)
        res["temper_fwdbwd_peak_gib"] = peak_gib(dev)
        res["temper_fwdbwd_saved_gib_counted"] = counted_saved_gib(ours, ids)  # the CPU's count, beside the peak
        ours.activation_checkpointing = True  # trainer.activation_checkpointing: each layer recomputed in backward
        peak_reset(dev)
        res["temper_ckpt_fwdbwd_s"] = bench(_fwd_bwd, dev, ours, ids, repeat=3, warmup=1)
        res["temper_ckpt_fwdbwd_peak_gib"] = peak_gib(dev)
        ours.activation_checkpointing = False
        if hf is not None:
            with torch.no_grad():
                lo, lh = _logits(ours(ids[:1, :256])).float(), _logits(hf(ids[:1, :256])).float()
            res["max_abs_logit_diff_vs_hf"] = (lo - lh).abs().max().item()
            peak_reset(dev)
            res["hf_fwd_s"] = bench(_fwd, dev, hf, ids, repeat=3, warmup=1)
            peak_reset(dev)
            res["hf_fwdbwd_s"] = bench(_fwd_bwd, dev, hf, ids, repeat=3, warmup=1)
            res["hf_fwdbwd_peak_gib"] = peak_gib(dev)
        for k in ("fwd", "fwdbwd", "ckpt_fwdbwd"):
            flops = (2 if k == "fwd" else 6) * n_act * n  # checkpointing's recompute is not counted as useful work
            tok = n / res[f"temper_{k}_s"]
            res[f"temper_{k}_tok_s"] = tok
            res[f"temper_{k}_mfu"] = flops / res[f"temper_{k}_s"] / (PEAK_TFLOPS * 1e12)
            hf_k = "fwdbwd" if k == "ckpt_fwdbwd" else k
            hf_tok = n / res[f"hf_{hf_k}_s"] if f"hf_{hf_k}_s" in res else float("nan")
            peak = res.get(f"temper_{k}_peak_gib", float("nan"))
            hf_peak = res.get(f"hf_{k}_peak_gib", float("nan"))
            rows.append([size, k, f"{hf_tok:,.0f}", f"{tok:,.0f}", tok / hf_tok if hf_tok == hf_tok else "—",
                         f"{100 * res[f'temper_{k}_mfu']:.1f}%", f"{peak:.1f}", f"{hf_peak:.1f}"])
        record("model", size, res)
        hf = ours = None
        peak_reset(dev)
    table(f"model tokens/s, B={b}, T={t}, {dtype} (ckpt_fwdbwd: with activation checkpointing)",
          ["config", "pass", "transformers", "temper", "ratio", "temper MFU", "temper peak GiB", "transformers peak GiB"],
          rows)


# ---- 2. kernels ----------------------------------------------------------------------------------------------
def section_kernels(dev, dtype, smoke: bool) -> None:
    g = torch.Generator(dev).manual_seed(0)
    rows = []

    def both(name, ref_fn, tri_fn, flops=None, nbytes=None, check=None):
        try:
            with kernel_mode("reference"):
                t_ref = bench(ref_fn, dev)
            with kernel_mode("triton"):
                t_tri = bench(tri_fn, dev)
            rate = (f"{flops / t_tri / 1e12:,.1f} TFLOP/s ({100 * flops / t_tri / 1e12 / PEAK_TFLOPS:.0f}%)" if flops
                    else f"{nbytes / t_tri / 1e9:,.0f} GB/s ({100 * nbytes / t_tri / 1e9 / PEAK_GBS:.0f}%)")
            extra = check() if check else ""
        except Exception as e:  # one kernel's failure (compile, resources) must not lose the others' figures
            rows.append([name, "—", "—", "—", "—", f"{type(e).__name__}: {str(e)[:120]}"])
            record("kernels", name, {"error": f"{type(e).__name__}: {e}"})
            return
        rows.append([name, f"{1e3 * t_ref:.3f}", f"{1e3 * t_tri:.3f}", t_ref / t_tri, rate, extra])
        record("kernels", name, {"ref_ms": 1e3 * t_ref, "triton_ms": 1e3 * t_tri, "rate": rate, "check": extra})

    # lightning indexer + top-k (GLM-5: 32 heads × 128, top-2048)
    t, s, hi, d, topk = (8, 64, 2, 16, 16) if smoke else (2048, 8192, 32, 128, 2048)
    q = torch.randn(1, t, hi, d, device=dev, generator=g)
    w = torch.randn(1, t, hi, device=dev, generator=g)
    k = torch.randn(1, s, d, device=dev, generator=g)
    qpos = (torch.arange(t, device=dev) + (s - t))[None]
    fl = 2 * t * s * hi * d

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

    both("indexer top-k fp32", lambda: kix.indexer_topk_reference(q, w, k, qpos, topk),
         lambda: kernels.indexer_topk(q, w, k, qpos, topk), flops=fl, check=lambda: agree(False))
    both("indexer top-k fp8", lambda: kix.indexer_topk_reference(q, w, k, qpos, topk, fp8=True),
         lambda: kernels.indexer_topk(q, w, k, qpos, topk, fp8=True), flops=fl, check=lambda: agree(True))

    # the fp32 indexer's two kernels apart (fp32 scores; the radix-select top-k), over a few tilings:
    # (query rows, keys, warps) of the scores kernel and the top-k kernel's warps
    sweep = []
    want_sel = kix.indexer_topk_reference(q, w, k, qpos, topk)
    for blocks in ([(16, 64, 4, 4), (32, 16, 8, 2)] if smoke else
                   [(16, 64, 4, 4), (32, 64, 4, 4), (64, 64, 8, 4), (32, 128, 8, 4), (16, 64, 4, 8), (16, 64, 4, 16)]):
        kix.BLOCKS = blocks
        try:
            with kernel_mode("triton"):
                same = torch.equal(kernels.indexer_topk(q, w, k, qpos, topk), want_sel)
                t_all = bench(lambda: kernels.indexer_topk(q, w, k, qpos, topk), dev)
                t_sc = bench(lambda: kix._indexer_topk_triton(q, w, k, qpos, topk, False, scores_only=True), dev)
            res = {"all_ms": 1e3 * t_all, "scores_ms": 1e3 * t_sc, "topk_ms": 1e3 * (t_all - t_sc),
                   "scores_tflops": fl / t_sc / 1e12, "identical_set": same}
            sweep.append([str(blocks), f"{1e3 * t_all:.3f}", f"{1e3 * t_sc:.3f}", f"{1e3 * (t_all - t_sc):.3f}",
                          f"{fl / t_sc / 1e12:,.1f}", same])
        except Exception as e:  # out of resources: a row that says so
            res = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            sweep.append([str(blocks), "—", "—", "—", "—", res["error"][:80]])
        finally:
            kix.BLOCKS = None
        record("kernels", f"indexer_tiles {blocks}", res)
    table("fp32 indexer top-k tilings (scores: rows, keys, warps; top-k warps)", [
        "tiles", "all ms", "scores ms", "top-k ms", "scores TFLOP/s", "identical set"], sweep)

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

    # the sparse MLA tiles: (heads, keys, warps) per program. Fewer heads per program load each selected row more
    # times (64 heads / BH programs per query); more heads need more registers for the [BH, 512] accumulator
    sweep = []
    for blocks in ([(16, 16, 4), (32, 16, 8)] if smoke else
                   [(16, 32, 4), (16, 32, 8), (32, 32, 8), (64, 32, 8), (16, 64, 4), (32, 64, 8), (64, 16, 8)]):
        kmla.BLOCKS = blocks
        try:
            with torch.no_grad(), kernel_mode("triton"):
                err = (kernels.sparse_mla(qm, kv, idx, qp, scale, dv).float() - o_r.float()).abs().max().item()
                t_f = bench(lambda: kernels.sparse_mla(qm, kv, idx, qp, scale, dv), dev)
            with kernel_mode("triton"):
                t_fb = bench(lambda: fb(False), dev)
            res = {"fwd_ms": 1e3 * t_f, "fwd_tflops": fl_f / t_f / 1e12, "fwdbwd_ms": 1e3 * t_fb,
                   "max_abs_err": err}
            sweep.append([str(blocks), f"{1e3 * t_f:.3f}", f"{fl_f / t_f / 1e12:,.1f}", f"{1e3 * t_fb:.3f}", err])
        except Exception as e:  # out of registers or shared memory: a row that says so
            res = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            sweep.append([str(blocks), "—", "—", "—", res["error"][:80]])
        finally:
            kmla.BLOCKS = None
        record("kernels", f"sparse_mla_tiles {blocks}", res)
    table("sparse MLA tiles (heads, keys, warps per program)", ["tiles", "forward ms", "forward TFLOP/s",
                                                                "fwd+bwd ms", "max |Δ| vs reference"], sweep)

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
    table("kernels vs torch references", ["kernel", "reference ms", "triton ms", "speed-up", "rate (% of H200 peak)",
                                          "check"], rows)

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
def section_decode(dev, dtype, smoke: bool) -> None:
    from rollout.engine import Engine, GenRequest
    from rollout.sampling import SamplingParams

    hf, ours = build_pair("524M" if not smoke else "smoke", dev, dtype, smoke, decode_check=True)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompt, new = (16, 8) if smoke else (64, 128)
    batches = [1, 4] if smoke else [1, 16, 64]
    rows = []

    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    for b in batches:
        prompts = torch.randint(1, 200, (b, prompt), generator=torch.Generator().manual_seed(b))
        pd = prompts.to(dev)
        with torch.no_grad():
            hf.generate(pd, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            sync(dev)
            t0 = time.perf_counter()
            out = hf.generate(pd, attention_mask=torch.ones_like(pd), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False)
            sync(dev)
            t_hf = time.perf_counter() - t0
        res = {"hf_tok_s": b * new / t_hf}
        eager_out = None
        for graphs in ([False, True] if dev.type == "cuda" else [False]):
            eng = Engine(ours, n_slots=b, max_len=prompt + new + 8, start=False, chunk_size=prompt * b,
                         cuda_graphs=graphs)
            sp = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True)
            # the warm-up decodes as far as the timed run, so every key bucket it reaches is captured before the clock
            warm = [eng.submit(GenRequest(p.tolist(), sp)) for p in prompts]
            while not all(r.future.done() for r in warm):
                eng.step()
            sync(dev)
            t0 = time.perf_counter()
            reqs = [eng.submit(GenRequest(p.tolist(), sp.model_copy())) for p in prompts]
            while not all(r.future.done() for r in reqs):
                eng.step()
            sync(dev)
            t_e = time.perf_counter() - t0
            same = sum(r.output_ids == out[i, prompt:].tolist() for i, r in enumerate(reqs))
            # bf16 on a random model: logits are nearly flat, so one rounding difference flips a greedy token and the
            # rows part ways from there; the mean length of the prefix shared with HF says how soon
            pre = sum(prefix(r.output_ids, out[i, prompt:].tolist()) for i, r in enumerate(reqs)) / b
            key = "graphs" if graphs else "eager"
            ids_now = [r.output_ids for r in reqs]
            eager_out = eager_out or ids_now
            res[f"temper_{key}_tok_s"] = b * new / t_e
            res[f"temper_{key}_same_as_hf"] = f"{same}/{b}"
            res[f"temper_{key}_mean_prefix_with_hf"] = pre
            res[f"temper_{key}_same_as_eager"] = f"{sum(x == y for x, y in zip(ids_now, eager_out))}/{b}"
            res[f"cuda_graphs_status_{key}"] = str(getattr(eng.stats, "cuda_graphs", "off"))
            res[f"graph_replays_{key}"] = getattr(eng.stats, "graph_replays", 0)
            rows.append([b, key, f"{b * new / t_hf:,.0f}", f"{b * new / t_e:,.0f}", t_hf / t_e, f"{same}/{b}",
                         f"{pre:.1f}", res[f"temper_{key}_same_as_eager"], res[f"cuda_graphs_status_{key}"]])
            record("decode", f"batch{b}", res)  # after each engine: a later failure keeps this one's figures
    table(f"greedy decode, prompt {prompt}, {new} new tokens, {dtype}",
          ["batch", "engine", "transformers tok/s", "temper tok/s", "ratio", "same tokens as HF",
           "mean prefix shared with HF", "same as eager", "cuda graphs"], rows)


# ---- 5. profile ----------------------------------------------------------------------------------------------
def section_profile(dev, dtype, smoke: bool) -> None:
    """Where one forward+backward of the 524M config spends its device time: the top kernels by self time."""
    from torch.profiler import ProfilerActivity, profile

    _, ours = build_pair("smoke" if smoke else "524M", dev, dtype, smoke, with_hf=False)
    b, t = (2, 64) if smoke else (4, 4096)
    ids = torch.randint(0, ours.config.vocab_size, (b, t), device=dev, generator=torch.Generator(dev).manual_seed(1))
    _fwd_bwd(ours, ids)  # warm-up: compiles, allocator
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        _fwd_bwd(ours, ids)
        sync(dev)
    attr = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    evs = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in evs)
    top = sorted(evs, key=lambda e: -getattr(e, attr))[:20]
    rows = [[e.key[:70], f"{getattr(e, attr) / 1e3:.2f}", e.count, f"{100 * getattr(e, attr) / total:.1f}%"] for e in top]
    record("profile", "top", [{"op": e.key, "ms": getattr(e, attr) / 1e3, "calls": e.count} for e in top])
    record("profile", "total_ms", total / 1e3)
    table(f"one forward+backward, B={b}, T={t}: top ops by self {'device' if dev.type == 'cuda' else 'CPU'} time "
          f"(total {total / 1e3:.1f} ms)", ["op", "ms", "calls", "share"], rows)


# ---- 4. parity -----------------------------------------------------------------------------------------------
def section_parity(dev, smoke: bool) -> None:
    """Train a tiny model briefly on the CPU (fp32), then compare its logits: GPU bf16 / GPU fp32 vs CPU fp32."""
    import copy

    import yaml

    from model import ModelConfig, Transformer

    root = Path(__file__).resolve().parents[1]
    cfg = ModelConfig(**yaml.safe_load((root / "configs/presets/tiny.yaml").read_text())["model"])
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    steps = 20 if smoke else 200
    for _ in range(steps):  # a copy task: the second half repeats the first
        half = torch.randint(1, 200, (8, 48), generator=g)
        ids = torch.cat([half, half], 1)
        loss = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    half = torch.randint(1, 200, (4, 48), generator=torch.Generator().manual_seed(99))
    ids = torch.cat([half, half], 1)  # T = 96 > index_topk 64: the sparse paths run
    with torch.no_grad(), kernel_mode("reference"):
        ref = model(ids).float()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        m = copy.deepcopy(model).to(dev).to(dtype)
        with torch.no_grad():
            out = m(ids.to(dev)).float().cpu()
        err = (out - ref).abs().max().item()
        top1 = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
        top = ref.argmax(-1, keepdim=True)
        lp, lr = F.log_softmax(out, -1).gather(-1, top), F.log_softmax(ref, -1).gather(-1, top)
        dlp = (lp - lr).abs().max().item()
        rows.append([f"{dev.type} {str(dtype).removeprefix('torch.')}", err, top1, dlp])
        record("parity", str(dtype), {"max_abs_logit": err, "top1_agreement": top1, "max_abs_logprob_top1": dlp,
                                      "train_loss": loss.item(), "steps": steps})
    table(f"logits vs fp32 CPU after {steps} SFT steps (loss {loss.item():.3f}), tiny, T=96",
          ["run", "max |Δlogit|", "top-1 agreement", "max |Δ log p(top-1)|"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy shapes on any device (checks the script)")
    ap.add_argument("--sections", nargs="+", default=["kernels", "model", "decode", "parity", "profile"],
                    choices=["kernels", "model", "decode", "parity", "profile"])
    ap.add_argument("--model-sizes", nargs="+", default=["524M", "2B"], choices=["524M", "2B"],
                    help="the model section's configs (2B: temper only)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    FIGURES.to(args.out)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        sys.exit("bench/gpu.py needs a CUDA device (use --smoke to check it on the CPU)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    record("env", "device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    record("env", "torch", torch.__version__)
    FIGURES.run({"kernels": lambda: section_kernels(dev, dtype, args.smoke),
                 "model": lambda: section_model(dev, dtype, args.smoke, args.model_sizes),
                 "decode": lambda: section_decode(dev, dtype, args.smoke),
                 "parity": lambda: section_parity(dev, args.smoke),
                 "profile": lambda: section_profile(dev, dtype, args.smoke)}, args.sections)

if __name__ == "__main__":
    main()
