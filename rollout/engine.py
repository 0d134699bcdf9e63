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
  stamped on every generated token; in-flight requests continue, their context re-prefilled under the new
  weights, and idle sessions' prefixes are dropped: no cached row outlives the weights that computed it. A
  checkpoint path is read with its checksums verified; one without recorded checksums (from the hub) is refused
  unless `verify=False` says the caller trusts it (loaded with a warning, "verified": False in the result). Its
  version is the caller's, else the one the checkpoint records, else the update is refused (never a default).
* Batches: `submit_batch` checks every request and the queue's room before any is queued (all or nothing).
* MTP speculative decoding (`spec_drafts=N`, rollout/speculative.py): the MTP layer drafts N tokens, one
  target forward verifies them; greedy acceptance at temperature 0, rejection sampling above it (exact);
  returned log-probs are the target model's. CUDA graphs of the decode step: rollout/graphs.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import torch

from model import KVCache, Transformer, load_checkpoint, read_checkpoint_meta, token_logprobs
from model.checkpoint import verify_checkpoint
from model.tokenizer import ByteTokenizer, Tokenizer

from .compiled import CompiledDecode
from .graphs import SYNC_WARNING, DecodeGraphs, syncs_in  # noqa: F401 - re-exported (split out of this module)
from .requests import EngineStats, GenRequest, is_scoring, prefill_plan
from .sampling import sample
from .speculative import SpeculativeDecoding

log = logging.getLogger(__name__)


class EngineError(ValueError):
    pass


class QueueFull(RuntimeError):
    pass


class Engine(SpeculativeDecoding):
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
        compile_decode: bool = False,
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
        if compile_decode and (cuda_graphs or spec_drafts):
            log.warning("compile_decode is for plain decoding without CUDA graphs: running without it")
            compile_decode = False
        spare = int(cuda_graphs or compile_decode)  # a spare slot (never handed out) takes the rows that pad a batch
        self.cache = KVCache(self.cfg, n_slots + spare, max_len, dtype=dt, device=dev)
        self.graphs = DecodeGraphs(model, self.cache, n_slots, self.stats) if cuda_graphs else None
        self.compiled = CompiledDecode(model, self.cache, self.stats) if compile_decode else None
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
    def check(self, req: GenRequest) -> None:
        """Raise EngineError if `req` cannot run here (nothing is queued, nothing changes)."""
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

    def submit(self, req: GenRequest) -> GenRequest:
        return self.submit_batch([req])[0]

    def submit_batch(self, reqs: list[GenRequest]) -> list[GenRequest]:
        """All or nothing: every request is checked (EngineError naming the first bad one, `batch[i]: …` for a batch)
        and the queue's room for all of them is checked (QueueFull) before any is queued or scored."""
        for i, req in enumerate(reqs):
            try:
                self.check(req)
            except EngineError as e:
                raise EngineError(f"batch[{i}]: {e}" if len(reqs) > 1 else str(e)) from None
        for req in reqs:
            if req.params.sampling_seed is not None:
                req.gen = torch.Generator(self.device).manual_seed(req.params.sampling_seed)
            if req.stream:
                req.chunks = queue.Queue()
        queued = [r for r in reqs if not is_scoring(r)]
        with self._cv:
            if queued and len(self.waiting) + len(queued) > self.max_queue:
                raise QueueFull(f"queue full ({self.max_queue} waiting)" if len(queued) == 1 else
                                f"queue full: {len(queued)} requests do not fit ({len(self.waiting)} of "
                                f"{self.max_queue} waiting)")
            self.waiting.extend(queued)
            self._cv.notify()
        for req in reqs:
            if not is_scoring(req):
                continue  # scored whole on the engine thread, between steps: one weight version, exact bits
            if self._thread is None:
                self._run_command("score", req, Future())
            else:
                self._cmds.put(("score", req, Future()))
                with self._cv:
                    self._cv.notify()
        return reqs

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
                       version: int | None = None, flush_cache: bool = False, abort_all: bool = False,
                       verify: bool = True) -> dict:
        return self._command("update", (path, state_dict, version, flush_cache, abort_all, verify))

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

    def _update(self, path, state_dict, version, flush_cache, abort_all, verify=True) -> dict:
        t0, verified, note = time.perf_counter(), None, ""
        if path is not None:
            if not (Path(path) / "config.json").is_file():
                raise EngineError(f"{path}: no config.json (not an HF-layout checkpoint directory)")
            if version is None:  # the checkpoint's recorded version; without one (a hub checkpoint) none is made up
                version = read_checkpoint_meta(path).get("policy_version")
                if version is None:
                    raise EngineError(f"{path} records no policy version (no temper.json): the update must name the "
                                      "weight_version it serves")
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise EngineError(f"weight version {version!r}: expected an integer >= 0")
            verified = verify_checkpoint(path)["checked"]  # a corrupt file: ChecksumError naming it
            if not verified and verify:
                raise EngineError(f"{path} records no checksums (no temper.json with them: a checkpoint from the hub "
                                  "or another tool), so its weights cannot be verified; refusing it (say verify=false "
                                  "to load it anyway)")
            if not verified:
                note = f"; UNVERIFIED: {path} records no checksums, loaded as the caller trusts it (verify=false)"
                log.warning("loading %s without verifying it: it records no checksums (verify=false)", path)
            loaded = load_checkpoint(path, verify=False)  # (verified just above)
            theirs, ours = loaded.config.model_dump(mode="json"), self.model.config.model_dump(mode="json")
            differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            if differ:  # the engine would compute with its own config on another model's weights
                said = ", ".join(f"{k}={theirs.get(k)!r} here {ours.get(k)!r}" for k in differ[:3])
                raise EngineError(f"weights do not match the model: the checkpoint at {path} has another config "
                                  f"({len(differ)} keys differ: {said})")
            sd = loaded.state_dict()
        elif state_dict is not None:
            sd = state_dict
        else:
            raise EngineError("update_weights needs a checkpoint path or a state dict")
        own = self.model.state_dict()
        missing, extra = set(own) - set(sd), set(sd) - set(own)
        if missing or extra:  # (extra weights once passed: a 3-layer checkpoint loaded into 2 layers, silently)
            raise EngineError(f"weights do not match the model: missing {sorted(missing)[:5]}, unexpected "
                              f"{sorted(extra)[:5]}")
        with torch.no_grad():
            for k, v in own.items():
                if v.shape != sd[k].shape:
                    raise EngineError(f"weights do not match the model: {k} {tuple(sd[k].shape)} vs {tuple(v.shape)}")
            for k, v in own.items():
                v.copy_(sd[k])
        if version is not None and int(version) < self.version:
            log.warning("weight version goes back from %d to %d (%s)", self.version, int(version), path or "tensors")
        self.version = int(version) if version is not None else self.version + 1
        self.stats.weight_updates += 1
        paused = len(self.running) + len(self.waiting)
        if abort_all:
            self._abort(None)
        # every cached row was computed by the old weights: idle sessions' prefixes are dropped, and running requests
        # re-prefill their context under the new ones (with or without `flush_cache`). Kept rows once gave a session's
        # next turn log-probs off by 0.2 from the new weights' while its tokens were stamped with the new version.
        self._flush()
        return {"success": True, "message": f"weights updated to version {self.version}{note}", "version": self.version,
                "verified": verified, "num_paused_requests": paused, "seconds": time.perf_counter() - t0}

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
        if chunked:
            reqs, n_new = prefill_plan(reqs, [len(r.context()) - r.cached for r in reqs], self.chunk_size)
        else:
            n_new = [len(r.context()) - r.cached for r in reqs]
        rows = [r.context()[r.cached : r.cached + n] for r, n in zip(reqs, n_new)]
        width = max(n_new)
        ids = self._t([row + [0] * (width - len(row)) for row in rows])
        slots = self._t([r.slot for r in reqs])
        logits = None
        if self.graphs is not None and not chunked and width == 1:  # the engine's own bound on the keys: no sync
            logits = self.graphs.run(ids, slots, max(r.cached + n for r, n in zip(reqs, n_new)))
        elif self.compiled is not None and not chunked and width == 1:
            logits = self.compiled.run(ids, slots, max(r.cached + n for r, n in zip(reqs, n_new)))
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
        r.finish_version = self.version  # the weights its last work was computed with (see `_update`)
        r.finish = fin
        if r.chunks is not None:
            r.chunks.put(("finish", fin, None))
        if not r.future.done():
            r.future.set_result(r)
