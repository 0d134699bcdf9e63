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
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit decorates the kernels



from gpu_common import (  # noqa: E402 - one figures file for every section
    FIGURES,
    bench,
    hf_config,
    kernel_mode,
    peak_gib,
    peak_reset,
    peak_tflops,
    record,
    sync,
    table,
    use_card,
)
from gpu_kernels import section_kernels  # noqa: E402


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


_HF: dict[tuple[str, bool], object] = {}  # (size, smoke) -> the fp32 transformers model, built once a process


def _hf_model(size: str, dev, smoke: bool):
    """transformers' GlmMoeDsaForCausalLM of a bench size in fp32 on dev, initialised there (a 524M model's init on
    the host takes ~17 s), seeded, built once a process and reused by every section that compares against it."""
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    if (size, smoke) not in _HF:
        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        with torch.device(dev):
            _HF[(size, smoke)] = GlmMoeDsaForCausalLM(hf_config(size, smoke)).eval()
    return _HF[(size, smoke)]


def build_pair(size: str, dev, dtype, smoke: bool, with_hf: bool = True, decode_check: bool = False):
    """(transformers model or None, temper model) with the same weights, on dev in dtype: temper's is converted from
    the transformers model's state dict in memory (`model_from_hf_tensors`, the checkpoint loader's own mapping; no
    2 GB save and load). The transformers model is cast for the caller; its fp32 original is kept for the next
    section. `decode_check`: first compare the two's greedy decode in fp32 (`decode_fidelity_fp32`)."""
    import json

    from model import ModelConfig
    from model.checkpoint import model_from_hf_tensors

    hf32 = _hf_model(size, dev, smoke)
    cfg = ModelConfig.from_hf_dict(json.loads(hf32.config.to_json_string()))
    state = {k: v.detach().clone() for k, v in hf32.state_dict().items()}  # temper's own copy, not a view of hf's
    ours = model_from_hf_tensors(cfg, state, dtype=torch.float32, device=dev, source=f"transformers {size}")
    del state
    if not with_hf:
        return None, ours.to(dtype)  # router, bias, rotary and indexer weights stay fp32
    hf = hf32
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
    import copy

    return copy.deepcopy(hf).to(dtype), ours.to(dtype)


def _held_by_others(dev, model) -> float:
    """GiB allocated on dev besides `model`'s own weights (the other models a process keeps for later sections): what
    a peak measured now includes but the model alone would not."""
    if dev.type != "cuda":
        return 0.0
    own = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return (torch.cuda.memory_allocated(dev) - own) / 2**30


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

        held = _held_by_others(dev, ours)  # the transformers models kept for later sections: not temper's peak
        peak_reset(dev)
        res["temper_fwd_s"] = bench(_fwd, dev, ours, ids, repeat=3, warmup=1)
        peak_reset(dev)
        res["temper_fwdbwd_s"] = bench(_fwd_bwd, dev, ours, ids, repeat=3, warmup=1)
        res["temper_fwdbwd_peak_gib"] = peak_gib(dev) - held
        res["temper_fwdbwd_saved_gib_counted"] = counted_saved_gib(ours, ids)  # the CPU's count, beside the peak
        ours.activation_checkpointing = True  # trainer.activation_checkpointing: each layer recomputed in backward
        peak_reset(dev)
        res["temper_ckpt_fwdbwd_s"] = bench(_fwd_bwd, dev, ours, ids, repeat=3, warmup=1)
        res["temper_ckpt_fwdbwd_peak_gib"] = peak_gib(dev) - held
        ours.activation_checkpointing = False
        if hf is not None:
            with torch.no_grad():
                lo, lh = _logits(ours(ids[:1, :256])).float(), _logits(hf(ids[:1, :256])).float()
            res["max_abs_logit_diff_vs_hf"] = (lo - lh).abs().max().item()
            held = _held_by_others(dev, hf)
            peak_reset(dev)
            res["hf_fwd_s"] = bench(_fwd, dev, hf, ids, repeat=3, warmup=1)
            peak_reset(dev)
            res["hf_fwdbwd_s"] = bench(_fwd_bwd, dev, hf, ids, repeat=3, warmup=1)
            res["hf_fwdbwd_peak_gib"] = peak_gib(dev) - held
        for k in ("fwd", "fwdbwd", "ckpt_fwdbwd"):
            flops = (2 if k == "fwd" else 6) * n_act * n  # checkpointing's recompute is not counted as useful work
            tok = n / res[f"temper_{k}_s"]
            res[f"temper_{k}_tok_s"] = tok
            res[f"temper_{k}_mfu"] = flops / res[f"temper_{k}_s"] / (peak_tflops() * 1e12)
            hf_k = "fwdbwd" if k == "ckpt_fwdbwd" else k
            hf_tok = n / res[f"hf_{hf_k}_s"] if f"hf_{hf_k}_s" in res else float("nan")
            peak = res.get(f"temper_{k}_peak_gib", float("nan"))
            hf_peak = res.get(f"hf_{k}_peak_gib", float("nan"))
            rows.append([size, k, f"{hf_tok:,.0f}", f"{tok:,.0f}", tok / hf_tok if hf_tok == hf_tok else "—",
                         f"{100 * res[f'temper_{k}_mfu']:.1f}%", f"{peak:.1f}", f"{hf_peak:.1f}"])
        record("model", size, res)
        hf = ours = None
        if size == "2B":
            _HF.pop((size, smoke), None)  # 8 GB in fp32, wanted by no later section
        peak_reset(dev)
    table(f"model tokens/s, B={b}, T={t}, {dtype} (ckpt_fwdbwd: with activation checkpointing)",
          ["config", "pass", "transformers", "temper", "ratio", "temper MFU", "temper peak GiB", "transformers peak GiB"],
          rows)


# ---- 2. kernels ----------------------------------------------------------------------------------------------
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
    """Train a tiny model briefly in fp32 on the device (200 steps: ~80 s on a host CPU, a few seconds on a GPU), then
    compare its logits on the device in bf16 and fp32 (the Triton kernels) with the same weights on the CPU in fp32
    (the torch references)."""
    import copy

    import yaml

    from model import ModelConfig, Transformer

    root = Path(__file__).resolve().parents[1]
    cfg = ModelConfig(**yaml.safe_load((root / "configs/presets/tiny.yaml").read_text())["model"])
    torch.manual_seed(0)
    model = Transformer(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    steps = 20 if smoke else 200
    for _ in range(steps):  # a copy task: the second half repeats the first
        half = torch.randint(1, 200, (8, 48), generator=g)
        ids = torch.cat([half, half], 1).to(dev)
        loss = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model = model.cpu().eval()
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
    record("env", "device", use_card(dev))
    record("env", "torch", torch.__version__)
    FIGURES.run({"kernels": lambda: section_kernels(dev, dtype, args.smoke),
                 "model": lambda: section_model(dev, dtype, args.smoke, args.model_sizes),
                 "decode": lambda: section_decode(dev, dtype, args.smoke),
                 "parity": lambda: section_parity(dev, args.smoke),
                 "profile": lambda: section_profile(dev, dtype, args.smoke)}, args.sections)

if __name__ == "__main__":
    main()
