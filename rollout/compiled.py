"""The engine's plain decode step compiled by `torch.compile` (Inductor's C++ backend on a CPU): `CompiledDecode`.

On the 2-core default a decode step of `tiny` is a few hundred small ops (MLA, the indexer, the router and eight
experts per layer), each a dispatcher call of a few microseconds, so the step is bound by per-op overhead, not
arithmetic. Inductor fuses the elementwise ops between the GEMMs into generated C++ loops.

What makes the step compilable as one graph (`fullgraph=True`):
- the host-sync-free forward the CUDA graphs use (`Transformer.run(n_keys=...)`: the engine's own bound on the keys,
  so no shape is read from the cache's contents);
- the MoE as `moe_experts_dense` under the compiler (every expert over the step's few tokens, weighted by the routing
  matrix: no data-dependent shape);
- dynamic shapes: one graph serves every batch size ≥ 2 and every key count on each side of the indexer's top-k (a
  dense and a selected variant: two compiles in all). A batch of one is padded to two with the cache's spare slot,
  whose length the step resets, as `DecodeGraphs` does, so no third variant is compiled for it.

Python floats (the softmax scale, the routed scaling factor) are specialised (`specialize_float`): left symbolic,
Inductor's scalar pass restarted the whole trace once, and a warm compile took 30 s instead of 17.

The compile runs on the engine's thread, in its first steps. A compile in a thread of its own, beside eager steps,
was tried and taken back: while Dynamo compiles, `torch.compiler.is_compiling()` is true for every thread (the eager
prefill and rescoring would take the compiled-only dense MoE, whose bits are not the trainer's), and Dynamo restores
the global RNG state when it ends (unseeded sampling would draw the same noise again).

The compiled code is cached on disk by Inductor (`TORCHINDUCTOR_CACHE_DIR`; the pipeline puts it under the run root),
so a later process pays for tracing, not for C++ compilation. The seconds spent compiling are counted in
`EngineStats.compile_seconds`. Any failure turns compilation off for this engine, with a warning and
`EngineStats.compiled` saying why, and the engine decodes eagerly.

Exactness: the recorded log-probs of a rollout come from the engine's rescoring forward (`Engine._score`, the
trainers' own function), not from the decode step, so train/rollout mismatch stays 0. The step's logits differ from
the eager step's in the last bits (the GEMMs' blocking, the fused loops' order); they only choose the tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import torch

from model import KVCache, Transformer

from .graphs import bounded_decode

if TYPE_CHECKING:
    from .engine import EngineStats

log = logging.getLogger(__name__)


_compiled = None


def compiled_decode():
    """The one compiled `bounded_decode` (rollout/graphs.py: the step the CUDA graphs capture) of this process. Its
    graphs serve every engine of the same model config: the model and cache are inputs, guarded by their tensors'
    shapes and dtypes."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(bounded_decode, dynamic=True, fullgraph=True)
    return _compiled


class CompiledDecode:
    """The engine's plain decode forward through `compiled_decode()`; the cache's last slot is the spare one."""

    def __init__(self, model: Transformer, cache: KVCache, stats: EngineStats):
        self.model, self.cache, self.stats = model, cache, stats
        self.pad = cache.n_slots - 1
        self.seen: set[bool] = set()  # the variants this engine has run (dense, selected): first runs are timed
        stats.compiled = "on"

    def run(self, ids: torch.Tensor, slots: torch.Tensor, n_keys: int) -> torch.Tensor | None:
        """Logits [B, 1, V] of one decode step, where no row has more than `n_keys` keys after it; None when
        compilation is off (the caller decodes eagerly)."""
        if self.stats.compiled != "on":
            return None
        b = ids.shape[0]
        if b == 1:  # padded to two rows: the second decodes into the spare slot
            ids = torch.cat([ids, ids])
            slots = torch.cat([slots, slots.new_full((1,), self.pad)])
        n_new = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
        cfg = self.model.config
        variant = bool(cfg.use_dsa and n_keys > cfg.index_topk)
        t0 = time.perf_counter()
        first = variant not in self.seen  # (the config patch costs ~0.2 ms a call: only where a compile is due)
        try:
            with torch._dynamo.config.patch(specialize_float=True) if first else contextlib.nullcontext():
                logits = compiled_decode()(self.model, self.cache, ids, slots, n_new, n_keys, self.pad)
        except Exception as e:  # noqa: BLE001 - not compilable here: decode eagerly, and say so
            self.stats.compiled = f"fallback: {type(e).__name__}: {e}"[:300]
            log.warning("compiled decode off, decoding eagerly: %s: %s", type(e).__name__, e)
            return None
        if first:
            self.seen.add(variant)
            self.stats.compile_seconds += time.perf_counter() - t0
        self.stats.compiled_steps += 1
        return logits[:b]
