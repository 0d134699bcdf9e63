"""CUDA graphs of the engine's plain decode step (`DecodeGraphs`), and `syncs_in`, which finds the host syncs that
would make a step uncapturable. Split out of rollout/engine.py; the engine re-exports both names."""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model import KVCache, Transformer

if TYPE_CHECKING:
    from .engine import EngineStats

log = logging.getLogger(__name__)

SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says


def bounded_decode(model: Transformer, cache: KVCache, ids: torch.Tensor, slots: torch.Tensor, n_new: torch.Tensor,
                   n_keys: int, pad: int) -> torch.Tensor:
    """One decode step with the engine's own bound on the keys (`Transformer.run(n_keys=...)`: no host sync), then
    the padding slot's length reset in place on the device (`lengths[pad] = 0` would copy a host scalar in: a
    synchronous copy, which a capture refuses): the padding rows' token is forgotten. What a captured CUDA graph
    replays and what `torch.compile` compiles (rollout/compiled.py)."""
    logits = model.run(ids, cache=cache, slots=slots, n_new=n_new, n_keys=n_keys).logits
    cache.lengths.narrow(0, pad, 1).zero_()
    return logits


def syncs_in(fn) -> list[str]:
    """Run `fn`; return the `file:line`s where it (this thread) raised the sync-debug warning. Warnings from other
    threads in the meantime (an in-process trainer, say) are neither counted nor swallowed: they reach the handler
    that was there before."""
    me, found = threading.get_ident(), set()
    with warnings.catch_warnings():  # restores the filters and the handler below when it exits
        warnings.simplefilter("always")
        before = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() == me and SYNC_WARNING in str(message):
                found.add(f"{Path(filename).name}:{lineno}")
            else:
                before(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        fn()
    return sorted(found)


class DecodeGraphs:
    """CUDA graphs of the plain decode forward (one new token per row), one per (batch bucket, key bucket): batch
    buckets 1, 2, 4, … up to the slot count, key buckets powers of two from 64 up to the cache's max_len (and the
    indexer's top-k). Each is captured on first use over static input buffers and replayed with the batch padded up
    to its bucket. Padding rows
    decode into the cache's spare last slot (`pad`, never handed out), whose length the graph itself resets, so they
    touch no real slot and always attend to one key.

    Capturing needs a forward with no host syncs (`.item()`, `.tolist()`, `nonzero()`, `bool(t)`, host-to-device
    copies) and no Python branch or shape that depends on the cache's contents: such a value would be frozen into the
    graph. So the key count is not read from the device: the engine passes its own bound (the longest row after this
    step, which it tracks on the host), rounded up to the key bucket, as `Transformer.run(n_keys=…)`; keys past a
    row's positions are masked, so a larger bound changes nothing but the work (a bound below the true count would
    drop keys: the engine's is exact bookkeeping). A warm-up run under
    `torch.cuda.set_sync_debug_mode("warn")` checks for syncs (the reason names the line); any failure turns graphs
    off for good, with a warning and `EngineStats.cuda_graphs` saying why, and the engine decodes eagerly."""

    MIN_KEYS = 64

    def __init__(self, model: Transformer, cache: KVCache, max_batch: int, stats: EngineStats):
        self.model, self.cache, self.stats = model, cache, stats
        self.pad = cache.n_slots - 1
        self.buckets = [1 << i for i in range((max_batch - 1).bit_length() + 1)]
        self.graphs: dict[int, tuple] = {}
        self.pool = None  # one memory pool shared by the buckets' graphs
        stats.cuda_graphs = "on"

    def key_bucket(self, n_keys: int) -> int:
        """The smallest power of two ≥ n_keys (at least MIN_KEYS), capped at the cache's max_len; and never past the
        indexer's top-k when n_keys is within it, so a rounded-up bound takes the same attention path as the exact
        count (dense below the top-k, selected above it)."""
        b = min(max(self.MIN_KEYS, 1 << (max(n_keys, 1) - 1).bit_length()), self.cache.max_len)
        topk = self.model.config.index_topk if self.model.config.use_dsa else None
        return topk if topk is not None and n_keys <= topk < b else b

    def run(self, ids: torch.Tensor, slots: torch.Tensor, n_keys: int) -> torch.Tensor | None:
        """Logits [B, 1, V] of one decode step of ids [B, 1] in `slots` [B], where no row has more than `n_keys`
        keys after the step; None when graphs are off."""
        if self.stats.cuda_graphs != "on":
            return None
        b = ids.shape[0]
        key = (next(x for x in self.buckets if x >= b), self.key_bucket(n_keys))
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(*key)
            except Exception as e:  # noqa: BLE001 - not capturable (yet): decode eagerly, and say so
                self.stats.cuda_graphs = f"fallback: {type(e).__name__}: {e}"[:300]
                log.warning("CUDA graphs off, decoding eagerly: the decode forward could not be captured (%s: %s)",
                            type(e).__name__, e)
                return None
        graph, s_ids, s_slots, s_logits = self.graphs[key]
        s_ids[:b].copy_(ids)
        s_slots[:b].copy_(slots)
        s_slots[b:].fill_(self.pad)
        graph.replay()
        self.stats.graph_replays += 1
        return s_logits[:b]

    def step(self, ids: torch.Tensor, slots: torch.Tensor, n_new: torch.Tensor, n_keys: int) -> torch.Tensor:
        """The captured decode step (`bounded_decode`)."""
        return bounded_decode(self.model, self.cache, ids, slots, n_new, n_keys, self.pad)

    def _capture(self, size: int, n_keys: int) -> tuple:
        dev = self.cache.lengths.device
        ids = torch.zeros(size, 1, dtype=torch.long, device=dev)
        slots = torch.full((size,), self.pad, dtype=torch.long, device=dev)
        n_new = torch.ones(size, dtype=torch.long, device=dev)

        def step() -> torch.Tensor:
            return self.step(ids, slots, n_new, n_keys)

        self.pool = self.pool or torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (lazy inits, allocator) off the capture, refusing host syncs
            torch.cuda.set_sync_debug_mode("warn")  # a warning carries the Python line that synced; an error not
            try:
                syncs = syncs_in(step)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if syncs:
            raise RuntimeError("a synchronizing CUDA operation in the decode step at " + ", ".join(syncs))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = step()
        return graph, ids, slots, logits
