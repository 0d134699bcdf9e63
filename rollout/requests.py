"""The engine's request and statistics records (split out of rollout/engine.py; the engine re-exports them)."""

from __future__ import annotations

import queue
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


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
    finish_version: int | None = None  # the weight version when it finished: what computed its last rows
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
    compiled: str = "off"  # the compiled CPU decode step (rollout/compiled.py): "on", or "fallback: <why>"
    compiled_steps: int = 0
    compile_seconds: float = 0.0  # first runs of each compiled variant: tracing, and C++ compiling unless cached

    @property
    def accept_length(self) -> float:
        return self.spec_emitted / self.spec_verifies if self.spec_verifies else 0.0

    @property
    def prefix_reuse(self) -> float:
        """Share of prompt tokens whose cache rows came from the session's earlier turns."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# A forward's fixed cost in token positions: on the 2-core CPU a forward of the tiny model costs about as much as ~100
# more positions (one row of 6 new tokens 9 ms, forty rows 33 ms; one row of 120 21 ms, two rows 29 ms).
FORWARD_OVERHEAD = 96


def prefill_plan(reqs: list, remaining: list[int], budget: int, overhead: int = FORWARD_OVERHEAD) -> tuple[list, list[int]]:
    """The rows of one chunked-prefill forward: (requests, new tokens of each), the requests in their given order.

    A forward is right-padded to its widest row, so it computes rows × width positions, whatever the rows hold. For a
    width W the forward takes W tokens of the rows with at least W left (a chunk, no padding) and then the longest
    shorter rows, while rows × W ≤ `budget`; of the widths the candidates offer (their `remaining` tokens, at most
    `budget`), the one with the most real tokens per position computed (`overhead` positions added per forward)
    wins, ties to the wider. The first request (the oldest) always goes, so none waits forever. When every row fits
    whole at the widest row's width, the forward takes them all: a split would leave a remnant for another forward.
    """
    caps = [min(n, budget) for n in remaining]
    if len(caps) * max(caps) <= budget and caps == remaining:  # all of it in one forward: none left for another
        return list(reqs), caps
    order = sorted(range(len(caps)), key=lambda i: -caps[i])  # stable: equal lengths keep their age order
    best: tuple[float, int, list[int]] | None = None
    for w in sorted(set(caps), reverse=True):
        w = max(w, 1)
        chosen = order[: max(1, budget // w)]
        if 0 not in chosen:
            chosen[-1] = 0
        lens = [min(caps[i], w) for i in chosen]
        w = max(lens)  # the forced first request may be the only row, and shorter
        score = sum(lens) / (overhead + len(chosen) * w)
        if best is None or score > best[0]:
            best = (score, w, chosen)
    _, w, chosen = best
    chosen.sort()
    return [reqs[i] for i in chosen], [min(caps[i], w) for i in chosen]
