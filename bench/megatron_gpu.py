"""The Megatron backend on one H200: parity with temper's torch model, one SAO step, TP = 2, and tokens/s.

One script, ≤ 6 minutes on one H200. It prints tables and writes every figure to `--out/megatron.json` as it goes:

1. parity — `MegatronGLM` (Megatron-core's block, parallel linears, router, dispatcher and experts with temper's
   MLA + DSA attention) against temper's `Transformer` on the same weights, in spawned ranks (`run_layout`): loss,
   logits, MTP logits and every gradient, fp32 and bf16 on the GPU, each against temper's fp32 model (aims: ≤ 1e-5
   relative in fp32, ≤ 2e-2 in bf16).
2. sao — one SAO trainer step on each backend from the same weights and trajectories: the value loss, the gradient
   norm and every parameter's gradient, compared the same way.
3. tp2 — TP = 2 (sequence parallel) and TP = EP = 2 in two / four gloo ranks on the host CPU. NCCL refuses two ranks
   on one GPU, so one H200 cannot hold a TP = 2 group; this section is the same check the CPU suite runs.
4. speed — forward+backward tokens/s of the Megatron backend against the torch backend on the same bf16 weights
   (the 524M-total config of bench/gpu.py, B = 4, T = 4096), with peak memory; the Megatron model twice, its routed
   experts as temper's `GroupedExperts` (the default: two grouped GEMMs per layer) and as Megatron's `SequentialMLP`
   (a loop over the experts).

`--smoke` runs every section at toy shapes on the CPU (tested), so the script stays working without a GPU:

    PYTHONPATH=<cp312 wheels dir>:. python bench/megatron_gpu.py --out $OUT        # bash bench/gpu_run.sh megatron
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import Figures  # noqa: E402
from gpu_common import table, use_card  # noqa: E402 - tables that name the card

FIGURES = Figures("megatron.json")
RESULTS = FIGURES.data
record = FIGURES.record


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def small_config(smoke: bool):
    """The model the parity and SAO sections use: `tiny` (every mechanism on, the sparse path taken at T > 64)."""
    import configs

    return configs.load("tiny").model


def speed_config(smoke: bool):
    from model.config import ModelConfig

    if smoke:
        return small_config(True)
    # bench/gpu.py's 524M-total config: 8 layers, hidden 1024, 16 heads, MLA q/kv 512/256, 32 experts top-4 + shared,
    # DSA top-512 with IndexShare every 4
    return ModelConfig(vocab_size=32768, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                       num_hidden_layers=8, first_k_dense_replace=1, num_attention_heads=16, n_routed_experts=32,
                       num_experts_per_tok=4, n_shared_experts=1, kv_lora_rank=256, q_lora_rank=512,
                       qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_topk=512, index_head_dim=128,
                       index_n_heads=16, indexer_types=["full", "shared", "shared", "shared"] * 2,
                       routed_scaling_factor=2.5, max_position_embeddings=8192, num_nextn_predict_layers=1)


def reference(cfg, ids: torch.Tensor, dev, dtype: torch.dtype = torch.float32, hf: dict | None = None):
    """temper's model on `dev` in `dtype` (from `hf`'s weights, or a seeded init): (HF weights, loss, logits, mtp
    logits, HF-named gradients)."""
    from model import Transformer
    from model.checkpoint import from_hf_state, to_hf_state
    from trainers.megatron.parity import hf_grads, step_loss

    torch.manual_seed(0)
    ref = Transformer(cfg)
    with torch.no_grad():
        if hf is None:
            for m in ref.moe_layers():
                m.gate.e_score_correction_bias.normal_(0, 0.01)
            hf = {k: v.detach().clone() for k, v in to_hf_state(ref)}
        else:
            ref.load_state_dict(from_hf_state(cfg, hf), strict=False)
    ref = ref.to(dev).to(dtype)  # router, bias, rotary and indexer head weights stay fp32
    loss, lg, mlg = step_loss(ref, ids.to(dev), ids.shape[0] * (ids.shape[1] - 1), indexer=True)
    loss.backward()
    return hf, loss.item(), lg.float().cpu(), mlg.float().cpu(), {k: v.float().cpu() for k, v in hf_grads(ref).items()}


def norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖₂ / ‖b‖₂: the relative error of the tensor as a whole (what a few flipped positions move least)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def compare(r: dict, loss: float, lg, mlg, grads) -> dict:
    keys = [k for k in grads if not k.endswith("e_score_correction_bias")]
    d = (r["logits"].double() - lg.double()).abs()
    return {"loss_rel": abs(r["loss"] - loss) / abs(loss), "logits_rel": rel(r["logits"], lg),
            "logits_mean_rel": float(d.mean() / lg.double().abs().mean()),
            "logits_norm_rel": norm_rel(r["logits"], lg),
            "positions_off_by_5e-2": float((d.amax(-1) > 0.05).double().mean()),
            "mtp_logits_rel": rel(r["mtp_logits"], mlg), "grad_rel_max": max(rel(r["grads"][k], grads[k]) for k in keys),
            "grad_norm_rel_max": max(norm_rel(r["grads"][k], grads[k]) for k in keys if grads[k].norm() > 0)}


# ---- 1. parity ---------------------------------------------------------------------------------------------------
def section_parity(dev, smoke: bool) -> None:
    from trainers.megatron.parity import run_layout

    cfg = small_config(smoke)
    ids = torch.randint(0, 256, (4, 91 if smoke else 200), generator=torch.Generator().manual_seed(1))
    hf, loss, lg, mlg, grads = reference(cfg, ids, dev)
    rows = []
    for dtype, aim in (("float32", 1e-5), ("bfloat16", 2e-2)):
        if dtype == "bfloat16" and dev.type != "cuda":
            continue  # bf16 on the CPU is not what is being measured
        r = run_layout(cfg, hf, ids, device=dev.type, dtype=dtype, indexer=True)
        refs = [("temper fp32", (loss, lg, mlg, grads))]
        if dtype == "bfloat16":  # like against like (the aim), and how far bf16 itself is from fp32 (both sides)
            refs.insert(0, ("temper bf16", reference(cfg, ids, dev, torch.bfloat16, hf)[1:]))
        for name, ref in refs:
            c = compare(r, *ref)
            like = dtype == "float32" or name == "temper bf16"
            record("parity", f"{dtype} vs {name}", {**c, "aim": aim if like else None})
            rows.append([dtype, name, c["loss_rel"], c["logits_rel"], c["logits_mean_rel"], c["logits_norm_rel"],
                         c["positions_off_by_5e-2"], c["mtp_logits_rel"], c["grad_rel_max"], c["grad_norm_rel_max"],
                         aim if like else "—"])
    table("Megatron vs temper, same weights (rel: max |Δ| / max |ref|; mean rel: mean |Δ| / mean |ref|; norm rel: "
          "‖Δ‖ / ‖ref‖, per gradient tensor, the worst)",
          ["Megatron dtype", "against", "loss rel", "logits rel", "logits mean rel", "logits norm rel",
           "positions off > 0.05", "MTP logits rel", "max grad rel", "grad norm rel", "aim"], rows)


# ---- 2. one SAO step -------------------------------------------------------------------------------------------
def _trajs(n: int = 4, length: int = 96):
    import math
    import random

    from rollout.types import Segment, Trajectory

    rng, out = random.Random(3), []
    for i in range(n):
        toks = [rng.randrange(256) for _ in range(length)]
        mask = [0] * (length // 3) + [1] * (length - length // 3)
        out.append(Trajectory(f"t{i}", f"e{i}", "f", "math", "h", "v", 0,
                              [Segment(toks, mask, [-math.log(272) if m else 0.0 for m in mask],
                                       [0 if m else -1 for m in mask])], float(i % 2), "completed"))
    return out


def section_sao(dev, smoke: bool) -> None:
    import copy

    from model import Transformer
    from trainers.config import SAOConfig
    from trainers.megatron.backend import MegatronBackend
    from trainers.megatron.convert import from_megatron
    from trainers.megatron.parity import hf_grads, megatron_grads
    from trainers.sao import SAOTrainer

    cfg = small_config(smoke)
    rows = []
    for dtype in [torch.float32] + ([torch.bfloat16] if dev.type == "cuda" else []):  # like against like
        name = "fp32" if dtype == torch.float32 else "bf16"
        torch.manual_seed(0)
        ref = Transformer(cfg).to(dev).to(dtype)
        be = MegatronBackend(dtype=dtype)
        try:
            mg = be.wrap(ref)
            sc = SAOConfig(lr=1e-4, critic_updates=1, micro_rows=2, grad_clip=1e9)  # no clipping: the raw gradients
            trajs = _trajs()
            a = SAOTrainer(ref, sc).step(copy.deepcopy(trajs), 0)
            b = SAOTrainer(mg, sc, backend=be).step(copy.deepcopy(trajs), 0)
            ga = {k: v.float() for k, v in hf_grads(ref).items()}
            gb = from_megatron({(0, 0, 0): megatron_grads(mg)}, cfg)
            worst = max((rel(gb[k], v), k) for k, v in ga.items() if not k.endswith("e_score_correction_bias"))
            res = {"value_loss_rel": abs(a["value_loss"] - b["value_loss"]) / abs(a["value_loss"]),
                   "grad_norm_rel": abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"], "grad_rel_max": worst[0],
                   "worst_tensor": worst[1], "updated": bool(a["updated"] and b["updated"])}
            record("sao", name, res)
            rows.append([name, res["value_loss_rel"], res["grad_norm_rel"], res["grad_rel_max"], res["worst_tensor"]])
        finally:
            be.close()
    table("one SAO step, Megatron vs torch backend", ["dtype", "value loss rel", "grad norm rel", "max grad rel",
                                                      "worst tensor"], rows)


# ---- 3. TP = 2 on the host -----------------------------------------------------------------------------------
def section_tp2(dev, smoke: bool) -> None:
    """Runs itself again with no GPU visible (gloo ranks on the CPU)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, __file__, "--tp2-child"] + (["--smoke"] if smoke else [])
    # the child's progress lines (stderr) pass straight through, so a run cut by its time cap still shows how far
    # it got (the H200 host's first two runs of this section ended silently at their caps)
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE if smoke else None, text=True,
                       timeout=420)
    if r.returncode:
        raise RuntimeError(f"tp2 child failed ({r.returncode}): {r.stderr[-2000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    rows = []
    for k, c in res.items():
        record("tp2", k, c)
        rows.append([k, c["loss_rel"], c["logits_rel"], c["mtp_logits_rel"], c["grad_rel_max"]])
    table("TP = 2 / TP = EP = 2 (gloo, host CPU, fp32) vs temper", ["layout", "loss rel", "logits rel",
                                                                    "MTP logits rel", "max grad rel"], rows)


def tp2_child(smoke: bool) -> None:
    from trainers.megatron.parity import run_layout

    t0 = time.perf_counter()

    def say(what: str) -> None:
        print(f"tp2: {what} at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    say(f"started ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads)")
    cfg = small_config(smoke)
    ids = torch.randint(0, 256, (4, 91), generator=torch.Generator().manual_seed(1))
    hf, loss, lg, mlg, grads = reference(cfg, ids, torch.device("cpu"))
    say("reference done")
    out = {}
    for tp, ep in ((2, 1),) if smoke else ((2, 1), (2, 2)):
        r = run_layout(cfg, hf, ids, tp=tp, ep=ep, etp=1, device="cpu", indexer=True)
        out[f"tp{tp} ep{ep}"] = compare(r, loss, lg, mlg, grads)
        say(f"tp {tp} ep {ep} done")
    print(json.dumps(out))


# ---- 4. speed ---------------------------------------------------------------------------------------------------
def section_speed(dev, smoke: bool) -> None:
    from model import Transformer
    from trainers.megatron.backend import MegatronBackend
    from trainers.megatron.parity import step_loss

    cfg = speed_config(smoke)
    b, t = (2, 64) if smoke else (4, 4096)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    ours = Transformer(cfg).to(dev).to(dtype)
    ids = torch.randint(0, cfg.vocab_size - 16, (b, t), device=dev)
    be = MegatronBackend(dtype=dtype)
    try:
        def megatron(experts: str):
            be.experts = experts
            return be.wrap(ours)

        rows = []
        # built as they come (the sequential one last: a run cut at its cap keeps the others' figures)
        for name, build in (("torch", lambda: ours), ("megatron", lambda: megatron("grouped")),
                            ("megatron_sequential", lambda: megatron("sequential"))):
            m = build()  # the previous Megatron model is freed as m and step are rebound

            def step(m=m):
                loss, _, _ = step_loss(m, ids, b * (t - 1))
                loss.backward()
                m.zero_grad(set_to_none=True)

            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(1 if smoke else 2):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            n = 2 if smoke else 5
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            tok_s = n * b * t / (time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
            record("speed", name, {"fwd_bwd_tok_s": tok_s, "peak_gib": peak, "B": b, "T": t, "dtype": str(dtype)})
            rows.append([name, tok_s, peak])
            if name != "torch":  # recorded as each model finishes: a run cut at its cap keeps the ratios it has
                ratio = tok_s / RESULTS["speed"]["torch"]["fwd_bwd_tok_s"]
                record("speed", f"{name}_over_torch", ratio)
                rows.append([f"{name} / torch", ratio, float("nan")])
        table(f"forward+backward tokens/s, B = {b}, T = {t}, {dtype}", ["backend", "tok/s", "peak GiB"], rows)
    finally:
        be.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU (checks the script)")
    ap.add_argument("--sections", nargs="+", default=["parity", "sao", "tp2", "speed"],
                    choices=["parity", "sao", "tp2", "speed"])
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--tp2-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    if args.tp2_child:
        return tp2_child(args.smoke)
    FIGURES.to(args.out)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        sys.exit("bench/megatron_gpu.py needs a CUDA device (use --smoke to check it on the CPU)")
    import megatron.core

    record("env", "device", use_card(dev, FIGURES))
    record("env", "torch", torch.__version__)
    record("env", "megatron_core", getattr(megatron.core, "__version__", "?"))
    fns = {"parity": section_parity, "sao": section_sao, "tp2": section_tp2, "speed": section_speed}
    # the spawned-rank sections first: the in-process ones hold a process group
    FIGURES.run({n: (lambda f=f: f(dev, args.smoke)) for n, f in fns.items()}, args.sections)

if __name__ == "__main__":
    main()
