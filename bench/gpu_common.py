"""What the GPU benches share: the device timing helpers, the kernel-mode switch, peak memory, the figures file, and
the transformers config of each bench size (`hf_config`). bench/gpu.py, bench/gpu_kernels.py and the CPU-side
counters (activation_memory, triton_compile, decode_ops) import it, and it imports no other bench: no import circle."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton.jit decorates the kernels

from common import Figures, md_table  # noqa: E402

# Dense bf16 TFLOP/s and HBM GB/s of the cards a device call may get (public spec sheets; the peaks every "% of peak"
# divides by). `use_card` picks the row of the card that ran, by its CUDA name; a card not listed gets NaN peaks and
# says so, never another card's numbers.
CARDS = {
    "H100 PCIe": (756.0, 2000.0),
    "H100 NVL": (835.0, 3900.0),
    "H100": (989.0, 3350.0),  # SXM, HBM3 (what "NVIDIA H100 80GB HBM3" names)
    "H200": (989.0, 4800.0),  # HBM3e
}
CARD = {"name": "cpu", "tflops": float("nan"), "gbs": float("nan")}
FIGURES = Figures("gpu.json")
RESULTS = FIGURES.data
record = FIGURES.record


def card_peaks(name: str) -> tuple[float, float]:
    """(dense bf16 TFLOP/s, HBM GB/s) of the card a CUDA device name names: the most specific row of CARDS it
    contains (an "H100 PCIe" is not an SXM H100); (nan, nan) for a card not listed."""
    for key in sorted(CARDS, key=len, reverse=True):
        if key in name:
            return CARDS[key]
    return float("nan"), float("nan")


def use_card(dev: torch.device, figures: Figures = FIGURES) -> str:
    """Name the card every figure of this process belongs to, and take its peaks (recorded under env in `figures`)."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    tflops, gbs = card_peaks(name)
    CARD.update(name=name, tflops=tflops, gbs=gbs)
    figures.record("env", "card", {"name": name, "peak_bf16_tflops": tflops, "peak_hbm_gbs": gbs})
    return name


def peak_tflops() -> float:
    return CARD["tflops"]


def peak_gbs() -> float:
    return CARD["gbs"]


def table(title: str, header: list[str], rows: list[list]) -> None:
    """md_table with the card that ran in the title: a figure pasted anywhere says which card gave it."""
    md_table(f"{title} [{CARD['name']}]", header, rows)


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
