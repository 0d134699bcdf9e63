"""temper's GPU kernels (Triton), each beside its torch reference twin: the `kernels` room.

The package is `temper_kernels`, not `kernels`: Hugging Face's `kernels` package (a dependency of transformers
from 5.25, imported by `transformers.activations`) owns that top-level name, and a project package of the same
name would shadow it.

Every op here has two implementations with one signature:

* the **reference**: plain torch, runs anywhere, defines the numbers;
* the **Triton** kernel: what runs on CUDA.

`backend(*tensors)` picks one per call: Triton when the tensors are on CUDA and Triton imports, the
reference elsewhere. The environment variable `TEMPER_KERNELS` overrides the choice:

* `TEMPER_KERNELS=reference` forces the torch twins (debugging, bisecting a numerical difference);
* `TEMPER_KERNELS=triton` forces the Triton kernels even for CPU tensors, which is only meaningful with
  `TRITON_INTERPRET=1` (Triton's interpreter runs the kernel body with numpy): the tests use it to check
  every kernel against its twin on a machine without a GPU.

Ops: `indexer_topk` (lightning-indexer scores fused with a deterministic top-k, fp32 or FP8 e4m3),
`sparse_mla` (attention over the selected latent rows, forward and backward), `moe_experts` (device-side
routing and grouped GEMM; `grouped_linear`, its grouped GEMM alone; `route`, the router's fused biased
group-limited top-k), `rms_norm`, `rope` (rotary embedding),
`swiglu` (silu(g) ⊙ u), `chunked_cross_entropy`, `chunked_logprobs` and `chunked_kl` (the lm-head's losses
without the whole logits), and `recomputed` (a tensor kept for the backward as a recipe).
"""

from __future__ import annotations

import functools
import os

import torch

MODES = ("auto", "reference", "triton")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install on a machine without a driver
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def mode() -> str:
    m = os.environ.get("TEMPER_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"TEMPER_KERNELS: {m!r} is not one of {', '.join(MODES)}")
    return m


def backend(*tensors: torch.Tensor) -> str:
    """"triton" or "reference" for an op on `tensors` (see the module docstring)."""
    m = mode()
    if m == "reference":
        return "reference"
    if m == "triton":
        if not triton_available():
            raise RuntimeError("TEMPER_KERNELS=triton but triton does not import (pip install triton)")
        on_cpu = any(t.device.type != "cuda" for t in tensors)
        if on_cpu and not interpreting():
            raise RuntimeError("TEMPER_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1")
        return "triton"
    on_cuda = bool(tensors) and all(t.device.type == "cuda" for t in tensors)
    return "triton" if on_cuda and triton_available() else "reference"


from .act import swiglu, swiglu_reference  # noqa: E402
from .indexer import indexer_topk, indexer_topk_reference, stable_topk  # noqa: E402
from .memory import recomputed  # noqa: E402
from .mla import sparse_mla, sparse_mla_reference  # noqa: E402
from .moe import (  # noqa: E402
    grouped_linear,
    grouped_mm_reference,
    moe_experts,
    moe_experts_reference,
    route,
    route_reference,
)
from .norm import chunked_cross_entropy, chunked_kl, chunked_logprobs, rms_norm, rms_norm_reference  # noqa: E402
from .rotary import rope, rope_reference  # noqa: E402

__all__ = [
    "backend",
    "chunked_cross_entropy",
    "chunked_kl",
    "chunked_logprobs",
    "grouped_linear",
    "grouped_mm_reference",
    "indexer_topk",
    "indexer_topk_reference",
    "mode",
    "moe_experts",
    "moe_experts_reference",
    "recomputed",
    "rms_norm",
    "route",
    "route_reference",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "sparse_mla",
    "sparse_mla_reference",
    "stable_topk",
    "swiglu",
    "swiglu_reference",
    "triton_available",
]
