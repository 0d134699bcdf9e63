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

    def wrong(self, act: Action) -> Action:
        """The oracle's final action with its answer or the value it writes changed (for the triad's wrong-answer
        leg): a different answer that still holds the right one, so a verifier that matches text accepts it."""
        return wrong_action(act)

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


# the integer part of a number (not a digit inside a name, not a fraction's digits), and a name
_NUMBER = re.compile(r"(?<![\w.])\d+(?P<frac>\.\d+)?")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def wrong_text(text: str, code: bool = False) -> str:
    """`text` with its last number or else its last word changed, deterministically, so that the result is a
    different value that still contains the original as a substring (or its prefix, for code):

    * an integer gets a digit appended: "391" -> "3917", "SIZE = 3" -> "SIZE = 37" (a text match on "SIZE = 3"
      still finds it); an integer written with a leading 0 gets a 1 in front ("0" -> "10", a valid literal);
    * a decimal gets a 1 in front ("3.14" -> "13.14": a tolerance check cannot call it equal);
    * with no number, the last word gets an "x" ("oslo" -> "oslox", "min(x, hi))" -> "min(x, hix))").
    With `code`, comments are skipped (a number in a comment changes nothing)."""
    spans = []
    offset = 0
    for line in text.splitlines(keepends=True):
        body = line.split("#", 1)[0] if code else line
        spans.append((offset, body))
        offset += len(line)
    for pattern in (_NUMBER, _WORD):
        last = None
        for start, body in spans:
            for m in pattern.finditer(body):
                last = (start, m)
        if last is None:
            continue
        start, m = last
        a, b = start + m.start(), start + m.end()
        if pattern is _WORD:
            return text[:b] + "x" + text[b:]
        if m.group("frac") or m.group().startswith("0"):
            return text[:a] + "1" + text[a:]
        return text[:b] + "7" + text[b:]
    return text + "x"


def wrong_action(act: Action) -> Action:
    """Generic wrong final action: the submitted answer, the replacement text, the written content or the program
    with its last value changed by `wrong_text`."""
    a = dict(act.args)
    key = {"submit": "answer", "replace": "new", "write": "content", "python": "code"}.get(act.tool)
    if key and isinstance(a.get(key), str):
        a[key] = wrong_text(a[key], code=act.tool != "submit")
    return Action(act.tool, a)
