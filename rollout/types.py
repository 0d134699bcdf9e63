"""The trajectory record: defined once, flowing from the agent loop to the store to the trainers.

Token-in, token-out: a segment holds the exact token ids the engine saw and produced, so nothing is
re-tokenised between engine, store and trainer. A trajectory has one segment per context window; when
compaction fires a new segment starts (system + goal + summary + the last two action/observation
pairs) and `Segment.start_turn`/`end_turn` record the boundaries.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["completed", "truncated", "crashed", "aborted"]
STATUSES = ("completed", "truncated", "crashed", "aborted")


@dataclass
class Segment:
    tokens: list[int]  # every token of this context window, in order
    loss_mask: list[bool]  # true on tokens the policy generated (actions, summaries)
    logprobs: list[float]  # rollout log-prob of each generated token; 0.0 elsewhere
    versions: list[int]  # policy version that generated each token; -1 on prompt/observation tokens
    start_turn: int = 0
    end_turn: int = 0
    summary: bool = False  # this segment starts from a compaction summary

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"segment columns differ in length: tokens {n}, loss_mask {len(self.loss_mask)}, "
                f"logprobs {len(self.logprobs)}, versions {len(self.versions)}"
            )

    @property
    def n_trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Trajectory:
    trajectory_id: str
    env_id: str
    family: str
    domain: str
    env_spec_hash: str
    verifier_hash: str
    iteration: int
    segments: list[Segment]
    reward: float = 0.0
    status: Status = "completed"
    verifier: dict = field(default_factory=dict)  # reward details: checks and their verdicts
    engine: str = ""  # which engine/backend produced it (e.g. "embedded", "sglang@host:port")
    timings: dict = field(default_factory=dict)  # seconds: generate, env, verify, total
    created: float = 0.0  # unix time the trajectory finished
    error: str | None = None  # what crashed, for status "crashed"

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: expected one of {STATUSES}")

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)

    @property
    def n_trainable(self) -> int:
        return sum(s.n_trainable for s in self.segments)

    def policy_versions(self) -> tuple[int, int]:
        """(min, max) policy version over generated tokens; (-1, -1) when none were generated."""
        vs = [v for s in self.segments for v, m in zip(s.versions, s.loss_mask) if m]
        return (min(vs), max(vs)) if vs else (-1, -1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        d = dict(d)
        d["segments"] = [Segment(**s) for s in d["segments"]]
        return cls(**d)
