"""What a task family provides, and how a spec is assembled from it.

A family samples a task from a seeded RNG and difficulty knobs (public instruction + workspace files,
and the hidden state), builds its verifier from the public task and the hidden state only — the
signature leaves no way to hand it the reference solution — and separately writes the oracle solution.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ..actions import Action
from ..spec import Domain, PublicTask, TaskSpec, Verifier


@dataclass
class Sampled:
    instruction: str
    files: dict[str, str]
    hidden: dict[str, Any]


def sample_horizon(rng: random.Random, lo: int, hi: int) -> int:
    """Long-tailed horizon in [lo, hi]: each step up is half as likely as the one before."""
    h = lo
    while h < hi and rng.random() < 0.5:
        h += 1
    return h


class Family(ABC):
    name: str
    domain: Domain
    tiny: bool  # learnable by the byte-level `tiny` model in CPU-minutes
    tools: tuple[str, ...]
    essential: tuple[str, ...] = ()  # each entry "a|b": a genuine solve uses one of these tools
    forbidden: tuple[str, ...] = ()  # workspace path prefixes a genuine solve never touches
    horizon: tuple[int, int] = (1, 3)

    def knobs(self, rng: random.Random, knobs: dict[str, Any] | None) -> dict[str, Any]:
        k = dict(knobs or {})
        lo, hi = self.horizon
        if "horizon" not in k:
            k["horizon"] = sample_horizon(rng, lo, hi)
        elif not (isinstance(k["horizon"], int) and lo <= k["horizon"] <= hi):
            raise ValueError(f"{self.name}: knob horizon={k['horizon']!r} outside [{lo}, {hi}]")
        return k

    def max_turns(self, knobs: dict[str, Any]) -> int:
        return 4 * knobs["horizon"] + 6

    @abstractmethod
    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        """Draw the task: instruction, initial files, hidden state."""

    @abstractmethod
    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        """The verifier, from what the agent sees plus the hidden state — never the reference."""

    @abstractmethod
    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        """The oracle's tool calls."""

    def sloppy(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action] | None:
        """A careless demonstrator's tool calls: the family's typical mistake (work stopped a step early, a value of
        the wrong type), which the verifier must refuse. None: the family has no such demonstrator. The base recipe
        mixes these with the oracle's (`sloppy:PATTERN` in `base`), so the base knows both ways and only the reward
        tells them apart."""
        return None

    def corrupt(self, act: Action, rng: random.Random) -> Action:
        """A plausible-but-wrong version of a state-changing action (for the triad's partial leg)."""
        return corrupt_action(act, rng)

    def make(self, seed: int, knobs: dict[str, Any] | None = None) -> TaskSpec:
        rng = random.Random(f"{self.name}:{seed}")
        k = self.knobs(rng, knobs)
        s = self.sample(rng, k)
        task = PublicTask(id=f"{self.name}-{seed:06d}", family=self.name, domain=self.domain,
                          instruction=s.instruction, files=s.files, tools=list(self.tools),
                          max_turns=self.max_turns(k))
        verifier = self.build_verifier(task.model_copy(deep=True), dict(s.hidden))
        reference = [a.render() for a in self.solve(task, s.hidden)]
        spec = TaskSpec(**task.model_dump(), seed=seed, knobs=k, hidden=s.hidden, reference=reference,
                        verifier=verifier, essential=list(self.essential), forbidden_paths=list(self.forbidden))
        return spec.compute_hashes()


def corrupt_action(act: Action, rng: random.Random) -> Action:
    """Generic corruption: a wrong answer, a replacement that keeps the old text or a bumped number, a
    truncated file, a no-op program."""
    a = dict(act.args)
    if act.tool == "submit":
        a["answer"] = _bump(a["answer"], rng)
    elif act.tool == "replace":
        a["new"] = a["old"] if rng.random() < 0.5 else _bump(a["new"], rng)
    elif act.tool == "write":
        lines = a.get("content", "").splitlines()
        a["content"] = "\n".join(lines[:-1]) + "\n"
    elif act.tool == "python":
        a = {"code": "pass"}
    return Action(act.tool, a)


def _bump(s: str, rng: random.Random) -> str:
    m = re.search(r"-?\d+", s)
    if m:
        v = int(m.group()) + rng.choice([1, 2, 3, 7])
        return s[: m.start()] + str(v) + s[m.end() :]
    return s + "x"
