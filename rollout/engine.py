"""The embedded generation engine: continuous batching over a preallocated latent-cache pool.

Every scheduler step admits waiting requests into free cache slots, runs one chunked-prefill forward
for requests that still have prompt tokens to process and one decode forward for the rest (ragged
batches through `model.run(..., cache=, slots=, n_new=)`), samples, and retires finished requests —
so requests join and leave the running batch at every step.

* Device: the cache, every per-step tensor and sampling live on the model's device (the cache's latent rows in the
  model's dtype); one transfer per step brings the chosen token ids and their log-probs to the host. On CUDA,
  `cuda_graphs=True` replays captured decode steps (`DecodeGraphs`); the CPU path never builds one.
* Cache: `model.KVCache` slots (MLA latent + rotary key rows, indexer keys) plus, per slot, the list
  of token ids whose rows are cached. A request with a `session_id` returns to its session's slot and
  reuses the longest common prefix, so the turns of one episode do not recompute their prefix.
  Sessions: a turn whose session holds an idle slot is admitted first; a newcomer without a free slot
  evicts the session idle the longest, and only once it has been idle `session_grace` seconds (time for
  the client's next turn to arrive) — before, under load every finished session was evicted by a
  waiting newcomer before its next turn came, and prefix reuse fell to 0.
* Sampling: temperature, top-p, top-k, min-p, per-request seed, stop strings and token ids, EOS,
  min/max new tokens. Log-probs are log-softmax of the raw logits (see rollout/sampling.py). Seeded
  requests reproduce on one device type (CPU and CUDA generators draw different streams).
* Weights: `update_weights(path=… | state_dict=…)` runs between steps, bumps the policy version that is
  stamped on every generated token; in-flight requests continue (with `flush_cache` their context is
  re-prefilled under the new weights).
* MTP speculative decoding (`spec_drafts=N`): the MTP layer drafts N tokens, one target forward
  verifies them; greedy acceptance at temperature 0, rejection sampling above it (exact); returned
  log-probs are the target model's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model import KVCache, Transformer, load_checkpoint, read_checkpoint_meta, token_logprobs
from model.tokenizer import ByteTokenizer, Tokenizer

from .sampling import SamplingParams, filtered_logits, sample

log = logging.getLogger(__name__)


class EngineError(ValueError):
    pass


class QueueFull(RuntimeError):
    pass


@dataclass
class GenRequest:
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    stream: bool = False
    # runtime state
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish: dict | None = None
    scored_version: int | None = None  # a pure-scoring request: the weight version that scored it
    slot: int = -1
    cached: int = 0  # leading tokens of context() whose cache rows are in the slot
    reused: int = 0  # of those, how many came from the session's earlier turns
    future: Future = field(default_factory=Future)
    chunks: queue.Queue | None = None
    gen: torch.Generator | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    spec_verify: int = 0
    spec_accepted: int = 0

    def context(self) -> list[int]:
        return self.input_ids + self.output_ids


def is_scoring(r: GenRequest) -> bool:
    """A request that only scores its input: no new tokens, log-probs of every input token."""
    return r.params.max_new_tokens == 0 and r.return_logprob and r.logprob_start_len == 0 and not r.stream


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    generated_tokens: int = 0
    spec_verifies: int = 0
    spec_emitted: int = 0
    weight_updates: int = 0
    aborted: int = 0  # requests ended by an abort (a client's, a disconnect, abort_all)
    cuda_graphs: str = "off"  # "on", or "fallback: <why>" when the decode forward could not be captured
    graph_replays: int = 0

    @property
    def accept_length(self) -> float:
        return self.spec_emitted / self.spec_verifies if self.spec_verifies else 0.0

    @property
    def prefix_reuse(self) -> float:
        """Share of prompt tokens whose cache rows came from the session's earlier turns."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says


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
        """The captured decode step: the bounded forward, then the padding slot's length reset in place on the
        device (`lengths[pad] = 0` would copy a host scalar in: a synchronous copy, which a capture refuses)."""
        logits = self.model.run(ids, cache=self.cache, slots=slots, n_new=n_new, n_keys=n_keys).logits
        self.cache.lengths.narrow(0, self.pad, 1).zero_()  # the padding rows' token is forgotten
        return logits

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


class Engine:
    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer | None = None,
        n_slots: int = 16,
        max_len: int = 2048,
        chunk_size: int = 256,
        max_queue: int = 256,
        spec_drafts: int = 0,
        policy_version: int = 0,
        start: bool = True,
        name: str = "embedded",
        cuda_graphs: bool = False,
        session_grace: float = 0.25,
    ):
        self.model = model.eval()
        self.cfg = model.config
        self.tok = tokenizer or ByteTokenizer()
        self.n_slots, self.max_len, self.chunk_size, self.max_queue = n_slots, max_len, chunk_size, max_queue
        if spec_drafts and not len(model.mtp_layers):
            raise EngineError("spec_drafts needs a model with an MTP layer")
        self.spec_drafts = spec_drafts
        self.session_grace = session_grace
        dev, dt = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
        self.device = dev
        self.stats = EngineStats()
        if cuda_graphs and (dev.type != "cuda" or spec_drafts):
            log.warning("cuda_graphs needs a CUDA model and plain decoding (no spec_drafts): running eagerly")
            cuda_graphs = False
        # with graphs, one spare slot (never handed out) takes the rows that pad a batch up to its bucket
        self.cache = KVCache(self.cfg, n_slots + int(cuda_graphs), max_len, dtype=dt, device=dev)
        self.graphs = DecodeGraphs(model, self.cache, n_slots, self.stats) if cuda_graphs else None
        self.version = policy_version
        self.name = name
        self.waiting: list[GenRequest] = []
        self.running: list[GenRequest] = []
        self.free_slots = list(range(n_slots))
        self.slot_tokens: list[list[int]] = [[] for _ in range(n_slots)]
        self.sessions: OrderedDict[str, int] = OrderedDict()  # session -> idle slot, LRU order
        self._idle_at: dict[str, float] = {}  # session -> when its slot went idle
        self.busy_sessions: set[str] = set()
        hdim = self.cfg.hidden_size
        self._hidden: list[torch.Tensor] = [torch.zeros(0, hdim, dtype=dt, device=dev) for _ in range(n_slots)]
        self.paused = False
        self._cmds: queue.Queue = queue.Queue()
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._eos = getattr(self.tok, "eos_id", None)
        if start:
            self.start()

    # ---- public API (thread-safe) ------------------------------------------------------------------
    def submit(self, req: GenRequest) -> GenRequest:
        if not req.input_ids:
            raise EngineError("input_ids is empty")
        bad = [t for t in req.input_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        bad = [t for t in req.params.stop_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:  # checked here, not in the batched step, where one bad id once aborted every co-batched request
            raise EngineError(f"sampling_params.stop_token_ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if req.params.min_new_tokens > req.params.max_new_tokens:
            raise EngineError(f"sampling_params.min_new_tokens ({req.params.min_new_tokens}) exceeds max_new_tokens "
                              f"({req.params.max_new_tokens})")
        if len(req.input_ids) + req.params.max_new_tokens > self.max_len:
            raise EngineError(
                f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({req.params.max_new_tokens}) exceeds the "
                f"context length {self.max_len}"
            )
        if req.params.sampling_seed is not None:
            req.gen = torch.Generator(self.device).manual_seed(req.params.sampling_seed)
        if req.stream:
            req.chunks = queue.Queue()
        if is_scoring(req):  # scored whole on the engine thread, between steps: one weight version, exact bits
            if self._thread is None:
                self._run_command("score", req, Future())
            else:
                self._cmds.put(("score", req, Future()))
                with self._cv:
                    self._cv.notify()
            return req
        with self._cv:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"queue full ({self.max_queue} waiting)")
            self.waiting.append(req)
            self._cv.notify()
        return req

    def generate(self, input_ids: list[int], **kw) -> GenRequest:
        """Submit and wait (blocking helper for tests and scripts)."""
        req = self.submit(GenRequest(list(input_ids), **kw))
        if self._thread is None:
            while not req.future.done():
                self.step()
        req.future.result()
        return req

    def abort(self, rid: str | None = None) -> int:
        """Abort one request (or all with rid=None); returns how many were aborted."""
        return self._command("abort", rid)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        with self._cv:
            self._cv.notify()

    def flush_cache(self) -> None:
        self._command("flush", None)

    def update_weights(self, path: str | Path | None = None, state_dict: dict | None = None,
                       version: int | None = None, flush_cache: bool = False, abort_all: bool = False) -> dict:
        return self._command("update", (path, state_dict, version, flush_cache, abort_all))

    def load(self) -> dict:
        with self._cv:
            return {"waiting": len(self.waiting), "running": len(self.running), "free_slots": len(self.free_slots),
                    "version": self.version, "paused": self.paused}

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        with self._cv:
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        for r in self.waiting + self.running:
            self._finish(r, {"type": "abort", "matched": None})
        while True:  # commands nobody will run: their callers get an answer, not a hang
            try:
                kind, arg, fut = self._cmds.get_nowait()
            except queue.Empty:
                break
            if kind == "score":
                self._finish(arg, {"type": "abort", "matched": None, "error": "engine shut down"})
            if not fut.done():
                fut.set_exception(EngineError("engine shut down"))

    # ---- command plumbing: run on the engine thread between steps ----------------------------------
    def _command(self, kind: str, arg):
        fut: Future = Future()
        if self._thread is None:
            self._run_command(kind, arg, fut)
        else:
            self._cmds.put((kind, arg, fut))
            with self._cv:
                self._cv.notify()
        return fut.result()

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            self._run_command(kind, arg, fut)

    def _run_command(self, kind, arg, fut: Future) -> None:
        try:
            if kind == "abort":
                fut.set_result(self._abort(arg))
            elif kind == "flush":
                self._flush()
                fut.set_result(None)
            elif kind == "update":
                fut.set_result(self._update(*arg))
            elif kind == "score":
                self._score(arg)
                fut.set_result(None)
        except Exception as e:  # noqa: BLE001 - reported to the caller, the engine goes on
            fut.set_exception(e)
            if kind == "score":
                self._finish(arg, {"type": "abort", "matched": None, "error": f"{type(e).__name__}: {e}"})

    @torch.no_grad()
    def _score(self, r: GenRequest) -> None:
        """A pure-scoring request (no new tokens, log-probs from position 0): the whole sequence in one forward
        of `token_logprobs`, the function the trainers use on their rows. On the same weights the rollout's
        recorded log-probs and the trainer's are then the same bits, where decoding through the KV cache
        differs in the last bits (~1e-6)."""
        lp, _ = token_logprobs(self.model, torch.tensor([r.input_ids], device=self.device))
        r.input_logprobs = [None, *lp[0, 1:].tolist()]
        r.scored_version = self.version
        self.stats.prompt_tokens += len(r.input_ids)
        self._finish(r, {"type": "length", "length": 0})

    def _abort(self, rid: str | None) -> int:
        with self._cv:
            victims = [r for r in self.waiting + self.running if rid is None or r.rid == rid]
            self.waiting = [r for r in self.waiting if r not in victims]
        for r in victims:
            if r in self.running:
                self._retire(r)
            self._finish(r, {"type": "abort", "matched": None})
        self.stats.aborted += len(victims)
        return len(victims)

    def _flush(self) -> None:
        for s in list(self.sessions):
            self._drop_session(s)
        for r in self.running:  # recompute their context under the current weights
            r.cached = 0
            self.cache.reset(self._t([r.slot]))
            self.slot_tokens[r.slot] = []

    def _update(self, path, state_dict, version, flush_cache, abort_all) -> dict:
        t0 = time.perf_counter()
        if path is not None:
            sd = load_checkpoint(path).state_dict()
            if version is None:
                version = read_checkpoint_meta(path).get("policy_version")
        elif state_dict is not None:
            sd = state_dict
        else:
            raise EngineError("update_weights needs a checkpoint path or a state dict")
        own = self.model.state_dict()
        missing = set(own) - set(sd)
        if missing:
            raise EngineError(f"weights do not match the model: missing {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in own.items():
                if v.shape != sd[k].shape:
                    raise EngineError(f"weights do not match the model: {k} {tuple(sd[k].shape)} vs {tuple(v.shape)}")
            for k, v in own.items():
                v.copy_(sd[k])
        self.version = int(version) if version is not None else self.version + 1
        self.stats.weight_updates += 1
        paused = len(self.running) + len(self.waiting)
        if abort_all:
            self._abort(None)
        elif flush_cache:
            self._flush()
        else:
            for s in list(self.sessions):  # idle prefixes were computed by the old weights
                self._drop_session(s)
        return {"success": True, "message": f"weights updated to version {self.version}", "version": self.version,
                "num_paused_requests": paused, "seconds": time.perf_counter() - t0}

    # ---- scheduling ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            with self._cv:
                idle = self.paused or not (self.waiting or self.running)
                if idle:
                    self._cv.wait(timeout=0.05)
                    continue
            try:
                self.step()
                if self.waiting and not self.running:  # admission waits for an idle session's grace: no spin
                    with self._cv:
                        self._cv.wait(timeout=0.01)
            except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                log.exception("engine step failed")
                for r in list(self.running):
                    self._retire(r)
                    self._finish(r, {"type": "abort", "matched": None, "error": f"{type(e).__name__}: {e}"})

    def _t(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def _drop_session(self, sid: str) -> None:
        slot = self.sessions.pop(sid, None)
        self._idle_at.pop(sid, None)
        if slot is not None:
            self.slot_tokens[slot] = []
            self.cache.reset(self._t([slot]))
            self.free_slots.append(slot)

    def _admit(self) -> None:
        with self._cv:
            pending = list(self.waiting)
        # turns returning to their session's idle slot first (they take no slot from anyone), then FIFO
        pending.sort(key=lambda r: r.session_id not in self.sessions)
        now = time.perf_counter()
        admitted = []
        for r in pending:
            if r.session_id is not None and r.session_id in self.busy_sessions:
                continue  # one request per session at a time keeps its prefix cache coherent
            if r.session_id is not None and r.session_id in self.sessions:
                slot = self.sessions.pop(r.session_id)
                self._idle_at.pop(r.session_id)
            elif self.free_slots:
                slot = self.free_slots.pop(0)
            elif self.sessions and now - self._idle_at[oldest := next(iter(self.sessions))] >= self.session_grace:
                self._drop_session(oldest)  # the session idle the longest, its next turn not queued
                slot = self.free_slots.pop(0)
            else:
                break  # newcomers wait in order: for a slot, or for an idle session's grace to run out
            r.slot = slot
            common = 0
            old = self.slot_tokens[slot]
            lim = min(len(old), len(r.input_ids) - 1)
            if r.return_logprob and r.logprob_start_len >= 0:  # input log-probs asked from token k: positions
                lim = min(lim, max(r.logprob_start_len - 1, 0))  # k-1 on must be computed here, not reused
            if r.return_logprob and len(r.input_logprobs) != len(r.input_ids):
                r.input_logprobs = [None] * len(r.input_ids)  # by position: a recompute overwrites, never appends
            while common < lim and old[common] == r.input_ids[common]:
                common += 1
            self.cache.truncate(self._t([slot]), self._t([common]))
            self.slot_tokens[slot] = old[:common]
            self._hidden[slot] = self._hidden[slot][:common]
            r.cached = r.reused = common
            self.stats.reused_tokens += common
            self.stats.prompt_tokens += len(r.input_ids)
            if r.session_id is not None:
                self.busy_sessions.add(r.session_id)
            admitted.append(r)
        if admitted:
            with self._cv:
                self.waiting = [r for r in self.waiting if r not in admitted]
            self.running.extend(admitted)

    def step(self) -> None:
        """One scheduler iteration: admit, prefill chunks, decode (or speculate), retire."""
        self._drain_commands()
        if self.paused:
            return
        self._admit()
        if not self.running:
            return
        self.stats.steps += 1
        prefill = [r for r in self.running if len(r.context()) - r.cached > 1 or not r.output_ids]
        decode = [r for r in self.running if r not in prefill]
        pending = self._forward(prefill, chunked=True) if prefill else []
        if decode:
            if self.spec_drafts:
                self._speculate(decode)
            else:
                pending += self._forward(decode, chunked=False)
        self._emit(pending)

    @torch.no_grad()
    def _forward(self, reqs: list[GenRequest], chunked: bool) -> list[tuple[GenRequest, torch.Tensor]]:
        """One ragged forward; returns the requests whose context is now all cached, with their next-token logits
        (sampled by `_emit`, all of a step's at once)."""
        budget = self.chunk_size
        rows, n_new = [], []
        for r in reqs:
            ctx = r.context()
            n = len(ctx) - r.cached
            if chunked:
                n = min(n, max(1, budget))
                budget -= n
            rows.append(ctx[r.cached : r.cached + n])
            n_new.append(n)
            if chunked and budget <= 0:
                break
        reqs = reqs[: len(rows)]
        width = max(n_new)
        ids = self._t([row + [0] * (width - len(row)) for row in rows])
        slots = self._t([r.slot for r in reqs])
        logits = None
        if self.graphs is not None and not chunked and width == 1:  # the engine's own bound on the keys: no sync
            logits = self.graphs.run(ids, slots, max(r.cached + n for r, n in zip(reqs, n_new)))
        if logits is None:
            out = self.model.run(ids, cache=self.cache, slots=slots, n_new=self._t(n_new))
            logits = out.logits
        self._input_logprobs(reqs, logits, n_new)
        done = []
        for i, r in enumerate(reqs):
            n = n_new[i]
            self.slot_tokens[r.slot].extend(rows[i])
            if self.spec_drafts:
                self._hidden[r.slot] = torch.cat([self._hidden[r.slot][: r.cached], out.hidden[i, :n]], 0)
            r.cached += n
            if r.cached == len(r.context()):
                done.append((r, logits[i, n - 1]))
        return done

    def _input_logprobs(self, reqs: list[GenRequest], logits: torch.Tensor, n_new: list[int]) -> None:
        """Log-prob of each prompt token given the tokens before it, stored at the token's position (the first prompt
        token has none; tokens whose previous position came from a reused session prefix stay None). All of a
        forward's in one gather and one transfer."""
        at, rows, cols, toks = [], [], [], []
        for i, r in enumerate(reqs):
            if not r.return_logprob or r.cached >= len(r.input_ids):
                continue
            if len(r.input_logprobs) != len(r.input_ids):
                r.input_logprobs = [None] * len(r.input_ids)
            for j in range(n_new[i]):
                p = r.cached + j + 1  # the token predicted at position cached + j
                if p < len(r.input_ids):
                    at.append((r, p))
                    rows.append(i)
                    cols.append(j)
                    toks.append(r.input_ids[p])
        if at:
            lp = logits[self._t(rows), self._t(cols)].float().log_softmax(-1).gather(1, self._t(toks)[:, None])
            for (r, p), v in zip(at, lp[:, 0].tolist()):
                r.input_logprobs[p] = v

    # ---- token emission and stopping ---------------------------------------------------------------
    def _emit(self, pending: list[tuple[GenRequest, torch.Tensor]]) -> None:
        """Sample the next token of every request in `pending` (request, next-token logits) on the device, as one
        batch; the token ids and their log-probs cross to the host in one transfer."""
        for r, _ in pending:
            if r.params.max_new_tokens == 0:
                self._retire(r)
                self._finish(r, {"type": "length", "length": 0})
        pending = [(r, lg) for r, lg in pending if r.params.max_new_tokens > 0]
        if not pending:
            return
        reqs = [r for r, _ in pending]
        x = torch.stack([lg for _, lg in pending]).float()
        masked = [(i, t) for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens
                  for t in self._stop_ids(r)]
        if masked:
            x[self._t([i for i, _ in masked]), self._t([t for _, t in masked])] = float("-inf")
        tok = sample(x, [r.params for r in reqs], [r.gen for r in reqs])
        lp = x.log_softmax(-1).gather(1, tok[:, None])[:, 0]
        toks, lps = torch.stack([tok.double(), lp.double()]).tolist()
        for r, t, v in zip(reqs, toks, lps):
            self._append(r, int(t), v)

    def _stop_ids(self, r: GenRequest) -> set[int]:
        s = set(r.params.stop_token_ids)
        if not r.params.ignore_eos and self._eos is not None:
            s.add(self._eos)
        return s

    def _append(self, r: GenRequest, tok: int, logprob: float) -> bool:
        """Record one generated token; returns True when the request finished."""
        if r.t_first is None:
            r.t_first = time.perf_counter()
        r.output_ids.append(tok)
        r.output_logprobs.append(logprob)
        r.output_versions.append(self.version)
        self.stats.generated_tokens += 1
        if r.chunks is not None:
            r.chunks.put(("token", tok, logprob))
        p = r.params
        fin = None
        if len(r.output_ids) > p.min_new_tokens - 1 and tok in self._stop_ids(r):
            fin = {"type": "stop", "matched": tok}
        elif p.stop and len(r.output_ids) >= p.min_new_tokens:
            tail = self.tok.decode(r.output_ids[-64:])
            for s in p.stop:
                if s and s in tail:
                    fin = {"type": "stop", "matched": s}
                    break
        if fin is None and len(r.output_ids) >= p.max_new_tokens:
            fin = {"type": "length", "length": len(r.output_ids)}
        if fin is None and len(r.context()) >= self.max_len:
            fin = {"type": "length", "length": len(r.output_ids)}
        if fin is not None:
            self._retire(r)
            self._finish(r, fin)
            return True
        return False

    def _retire(self, r: GenRequest) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.slot < 0:
            return
        if r.session_id is not None:
            self.busy_sessions.discard(r.session_id)
            self.sessions[r.session_id] = r.slot  # keep the prefix for the episode's next turn
            self.sessions.move_to_end(r.session_id)
            self._idle_at[r.session_id] = time.perf_counter()
        else:
            self.slot_tokens[r.slot] = []
            self.cache.reset(self._t([r.slot]))
            self.free_slots.append(r.slot)
        r.slot = -1

    def _finish(self, r: GenRequest, fin: dict) -> None:
        if r.finish is not None:
            return
        r.finish = fin
        if r.chunks is not None:
            r.chunks.put(("finish", fin, None))
        if not r.future.done():
            r.future.set_result(r)

    # ---- MTP speculative decoding ------------------------------------------------------------------
    # Invariant per slot: `_hidden[slot]` holds the main model's last-layer hidden state for every cached
    # position (aligned with slot_tokens); the MTP cache covers a prefix of the pairs (h_j, token_{j+1}).
    @torch.no_grad()
    def _speculate(self, reqs: list[GenRequest]) -> None:
        """One speculative step for every decoding request at once: batched MTP draft forwards (each row over its
        own MTP prefix, rows with fewer drafts drop out of the later chained steps), ONE target forward verifying
        every row's [c_n, d_1..d_k] (ragged: rows without drafts verify just c_n, i.e. decode plainly), acceptance
        per row, a per-row rollback of the rejected positions, and one transfer of the emitted tokens and their
        log-probs to the host. Greedy rows are decided on the device; sampled rows with drafts run the same
        sequential rejection test as ever on their own generator (its host syncs), so seeded requests draw the
        same random stream whatever they are batched with."""
        dev = self.device
        ctxs = [r.context() for r in reqs]
        ns = [len(c) - 1 for c in ctxs]  # newest confirmed token c_n of each row is not yet in the main cache
        ks = []
        for r, c in zip(reqs, ctxs):
            p = r.params
            k = min(self.spec_drafts, p.max_new_tokens - len(r.output_ids) - 1, self.max_len - len(c) - 1)
            if len(r.output_ids) < p.min_new_tokens and self._stop_ids(r):
                k = 0  # drafts could propose (and accept) a stop token too early: decode plainly, with it masked
            ks.append(max(k, 0))
        b, kmax = len(reqs), max(ks)
        spec = [i for i in range(b) if ks[i]]
        drafts = torch.zeros(b, kmax, dtype=torch.long, device=dev)
        qdist: dict[int, list[torch.Tensor]] = {i: [] for i in spec}
        if spec:
            # draft 1: MTP over each row's positions m..n-1 (right-padded), pairing h_j with c_{j+1}
            sslots = self._t([reqs[i].slot for i in spec])
            ms = [min(m, ns[i] - 1) for i, m in zip(spec, self.cache.mtp_lengths[sslots].tolist())]
            self.cache.mtp_lengths[sslots] = self._t(ms)
            widths = [ns[i] - m for i, m in zip(spec, ms)]
            w = max(widths)
            hid = torch.stack([torch.nn.functional.pad(self._hidden[reqs[i].slot][m : ns[i]], (0, 0, 0, w - n))
                               for i, m, n in zip(spec, ms, widths)])
            nxt = self._t([ctxs[i][m + 1 : ns[i] + 1] + [0] * (w - n) for i, m, n in zip(spec, ms, widths)])
            lg, g = self.model.mtp(hid, nxt, 0, cache=self.cache, slots=sslots, n_new=self._t(widths))
            last = self._t([n - 1 for n in widths])
            ar = torch.arange(len(spec), device=dev)
            logits, g = lg[ar, last], g[ar, last]
            rows = spec  # the rows still drafting; logits/g are theirs, in this order
            for step in range(kmax):
                d = logits.argmax(-1)
                for j, i in enumerate(rows):
                    p = reqs[i].params
                    if not p.greedy:
                        q = filtered_logits(logits[j], p).softmax(-1)
                        d[j] = torch.multinomial(q, 1, generator=reqs[i].gen)[0]
                        qdist[i].append(q)
                drafts[self._t(rows), step] = d
                keep = [j for j, i in enumerate(rows) if ks[i] > step + 1]
                if not keep:
                    break
                # chain: the MTP layer consumes its own previous hidden state
                sel = self._t(keep)
                rows = [rows[j] for j in keep]
                lg, gg = self.model.mtp(g[sel][:, None], d[sel][:, None], step + 1, cache=self.cache,
                                        slots=self._t([reqs[i].slot for i in rows]))
                logits, g = lg[:, 0], gg[:, 0]
        # verify every row's [c_n, d_1..d_k] in one target forward
        slots = self._t([r.slot for r in reqs])
        kt = self._t(ks)
        ids = torch.cat([self._t([c[-1] for c in ctxs])[:, None], drafts], 1)
        out = self.model.run(ids, cache=self.cache, slots=slots, n_new=kt + 1)
        tl = out.logits.float()
        masked = [(i, t) for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens
                  for t in self._stop_ids(r)]  # only rows without drafts (k = 0): as plain decoding masks them
        if masked:
            tl[self._t([i for i, _ in masked]), 0, self._t([t for _, t in masked])] = float("-inf")
        # greedy acceptance: the longest prefix of drafts equal to the target's argmax
        col = torch.arange(kmax, device=dev)
        match = (tl[:, :kmax].argmax(-1) == drafts) & (col[None, :] < kt[:, None])
        acc = match.long().cumprod(1).sum(1)
        bonus = torch.zeros(b, dtype=torch.long, device=dev)
        rejected = set()
        for i in spec:  # rejection sampling, row by row on the request's own generator
            r = reqs[i]
            p = r.params
            if p.greedy:
                continue
            a = 0
            for j in range(ks[i]):
                dj = int(drafts[i, j])
                pt = filtered_logits(tl[i, j], p).softmax(-1)
                q = qdist[i][j]
                if float(torch.rand((), generator=r.gen, device=dev)) < min(1.0, float(pt[dj] / q[dj])):
                    a += 1
                    continue
                resid = torch.clamp(pt - q, min=0)
                bonus[i] = torch.multinomial(resid / resid.sum(), 1, generator=r.gen)[0]
                rejected.add(i)
                break
            acc[i] = a
        # the token after the accepted drafts: the target's own sample there (argmax for greedy rows)
        rest = [i for i in range(b) if i not in rejected]
        if rest:
            at = self._t(rest)
            bonus[at] = sample(tl[at, acc[at]], [reqs[i].params for i in rest], [reqs[i].gen for i in rest])
        emitted = torch.cat([drafts, drafts.new_zeros(b, 1)], 1).scatter(1, acc[:, None], bonus[:, None])
        lp = tl.log_softmax(-1).gather(2, emitted[:, :, None])[:, :, 0]
        host = torch.cat([emitted.double(), lp.double(), acc.double()[:, None]], 1).tolist()  # the one transfer
        accs = [int(h[-1]) for h in host]
        keep = [n + 1 + a for n, a in zip(ns, accs)]  # c_n and the accepted drafts stay in the main cache
        self.cache.truncate(slots, self._t(keep))
        if spec:  # chained-draft rows beyond n-1 used MTP hiddens: recompute later
            self.cache.mtp_lengths[self._t([reqs[i].slot for i in spec])] = self._t([ns[i] for i in spec])
        for i, r in enumerate(reqs):
            n, a, c = ns[i], accs[i], ctxs[i]
            toks = [int(t) for t in host[i][: a + 1]]
            self.slot_tokens[r.slot] = self.slot_tokens[r.slot][:n] + [c[n]] + toks[:a]
            self._hidden[r.slot] = torch.cat([self._hidden[r.slot][:n], out.hidden[i, : a + 1]], 0)
            r.cached = keep[i]
        for i, r in enumerate(reqs):
            a = accs[i]
            emit = zip([int(t) for t in host[i][: a + 1]], host[i][kmax + 1 : kmax + 2 + a])
            if not ks[i]:  # no drafts: a plain decode step
                self._append(r, *next(emit))
                continue
            self.stats.spec_verifies += 1
            r.spec_verify += 1
            r.spec_accepted += a
            for tok, v in emit:
                self.stats.spec_emitted += 1
                if self._append(r, tok, v):
                    break
