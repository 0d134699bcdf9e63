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

The compiled code is cached on disk by Inductor (`TORCHINDUCTOR_CACHE_DIR`; the pipeline puts it under the run root),
so a later process pays for tracing, not for C++ compilation. The seconds spent compiling are counted in
`EngineStats.compile_seconds`. Any failure turns compilation off for this engine, with a warning and
`EngineStats.compiled` saying why, and the engine decodes eagerly.

Exactness: the recorded log-probs of a rollout come from the engine's rescoring forward (`Engine._score`, the
trainers' own function), not from the decode step, so train/rollout mismatch stays 0. The step's logits differ from
the eager step's in the last bits (the GEMMs' blocking, the fused loops' order); they only choose the tokens.
"""

from __future__ import annotations

import logging
import threading
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
    """The engine's plain decode forward through `compiled_decode()`; the cache's last slot is the spare one.

    The compile runs in a thread of its own (`background`, the default) on a scratch cache of the engine's geometry,
    one call per variant, while the engine decodes eagerly: `run` answers None until both variants are compiled, so
    no step waits for the compiler. A short stage may end before it is ready (it then decoded eagerly throughout); a
    long one switches to the compiled step as soon as it is. `wait` blocks until the compile ended either way."""

    def __init__(self, model: Transformer, cache: KVCache, stats: EngineStats, background: bool = True):
        self.model, self.cache, self.stats = model, cache, stats
        self.pad = cache.n_slots - 1
        self.done = threading.Event()
        stats.compiled = "compiling"
        if background:
            threading.Thread(target=self._compile, name="compile-decode", daemon=True).start()
        else:
            self._compile()

    def variants(self) -> list[int]:
        """A key count on each side of the indexer's top-k that this cache can hold (one where no DSA selects)."""
        cfg = self.model.config
        dense = [min(2, self.cache.max_len)]
        return dense + ([cfg.index_topk + 1] if cfg.use_dsa and cfg.index_topk + 1 <= self.cache.max_len else [])

    def _compile(self) -> None:
        t0 = time.perf_counter()
        try:
            c = self.cache
            scratch = KVCache(c.cfg, c.n_slots, c.max_len, dtype=c.kv[0].dtype, device=c.kv[0].device)
            dev = scratch.lengths.device
            ids = torch.zeros(2, 1, dtype=torch.long, device=dev)
            slots = torch.tensor([0, self.pad], device=dev)
            n_new = torch.ones(2, dtype=torch.long, device=dev)
            # the engine decodes under no_grad (a thread-local mode): compiled for it, or its calls would recompile
            with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
                for n_keys in self.variants():
                    scratch.lengths.fill_(n_keys - 1)
                    compiled_decode()(self.model, scratch, ids, slots, n_new, n_keys, self.pad)
            self.stats.compiled = "on"
        except Exception as e:  # noqa: BLE001 - not compilable here: the engine decodes eagerly, and says why
            self.stats.compiled = f"fallback: {type(e).__name__}: {e}"[:300]
            log.warning("compiled decode off, decoding eagerly: %s: %s", type(e).__name__, e)
        finally:
            self.stats.compile_seconds += time.perf_counter() - t0
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compile ended (compiled, or fallen back); whether it did within `timeout`."""
        return self.done.wait(timeout)

    def run(self, ids: torch.Tensor, slots: torch.Tensor, n_keys: int) -> torch.Tensor | None:
        """Logits [B, 1, V] of one decode step, where no row has more than `n_keys` keys after it; None while the
        step compiles or when compilation is off (the caller decodes eagerly)."""
        if self.stats.compiled != "on":
            return None
        b = ids.shape[0]
        if b == 1:  # padded to two rows: the second decodes into the spare slot
            ids = torch.cat([ids, ids])
            slots = torch.cat([slots, slots.new_full((1,), self.pad)])
        n_new = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
        try:
            logits = compiled_decode()(self.model, self.cache, ids, slots, n_new, n_keys, self.pad)
        except Exception as e:  # noqa: BLE001 - not compilable here: decode eagerly, and say so
            self.stats.compiled = f"fallback: {type(e).__name__}: {e}"[:300]
            log.warning("compiled decode off, decoding eagerly: %s: %s", type(e).__name__, e)
            return None
        self.stats.compiled_steps += 1
        return logits[:b]
