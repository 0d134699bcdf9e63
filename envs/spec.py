"""Task specs and verifiers.

A `TaskSpec` is everything about one environment: what the agent sees (`PublicTask`: instruction,
initial workspace files, tools, turn budget), the seeded hidden state, the difficulty knobs, the
reference solution (hidden from agent and verifier), the verifier, and content hashes of the spec and
of the verifier for provenance.

A `Verifier` is data: a list of checks. "answer" compares the submitted answer; "python" runs a
generated script in the sandbox over a copy of the final workspace (it reads files as data; no code of the
agent's runs there); "calls" calls the workspace's functions in the sandbox and compares what came back with
expected values that never enter the sandbox, on the host and type-strictly; "unchanged" pins files by hash
without following links. No verdict is computed in a process that ran the agent's code.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Domain = Literal["code", "math", "reasoning"]


def content_hash(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(data.encode()).hexdigest()


class Check(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["answer", "python", "calls", "unchanged"]
    name: str
    expected: str | None = None  # answer
    normalize: Literal["exact", "strip", "number", "casefold"] = "strip"
    code: str | None = None  # python: prints one JSON object {"pass": bool, "detail": str} as its last line
    # calls: {"module": "pkg.mathx", "fn": "clamp", "args": [5, 0, 10]} each; only these enter the sandbox
    calls: list[dict[str, Any]] = Field(default_factory=list)
    returns: list[Any] = Field(default_factory=list)  # calls: the expected return values (host side only)
    hashes: dict[str, str] = Field(default_factory=dict)  # unchanged: path -> sha256 of content

    @model_validator(mode="after")
    def _complete(self) -> Check:
        if self.kind == "calls":
            if not self.calls or len(self.calls) != len(self.returns):
                raise ValueError(f"check {self.name!r}: 'calls' needs one expected value in 'returns' per call "
                                 f"(got {len(self.calls)} calls, {len(self.returns)} returns)")
            for c in self.calls:
                if set(c) != {"module", "fn", "args"} or not isinstance(c["args"], list):
                    raise ValueError(f"check {self.name!r}: a call is {{module, fn, args: list}}, got {c}")
        return self


class Verifier(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checks: list[Check]

    def hash(self) -> str:
        return content_hash(self.model_dump(mode="json"))


class PublicTask(BaseModel):
    """What the agent (and the verifier builder) may see."""

    model_config = ConfigDict(extra="forbid")

    id: str
    family: str
    domain: Domain
    instruction: str
    files: dict[str, str]
    tools: list[str]
    max_turns: int = Field(gt=0)


class TaskSpec(PublicTask):
    """The public task plus everything the agent must not see."""

    seed: int
    knobs: dict[str, Any] = Field(default_factory=dict)
    hidden: dict[str, Any] = Field(default_factory=dict)
    reference: list[str]  # oracle tool calls (rendered); hidden from agent and verifier
    verifier: Verifier
    essential: list[str] = Field(default_factory=list)  # tools a genuine solve must use
    forbidden_paths: list[str] = Field(default_factory=list)  # path prefixes a genuine solve never touches
    source: str = "template"  # "template" | "llm"
    spec_hash: str = ""
    verifier_hash: str = ""

    def public(self) -> PublicTask:
        return PublicTask(**{k: getattr(self, k) for k in PublicTask.model_fields})

    def compute_hashes(self) -> TaskSpec:
        body = self.model_dump(mode="json", exclude={"spec_hash", "verifier_hash"})
        return self.model_copy(update={"spec_hash": content_hash(body), "verifier_hash": self.verifier.hash()})

    def check_hashes(self) -> None:
        fresh = self.compute_hashes()
        if (fresh.spec_hash, fresh.verifier_hash) != (self.spec_hash, self.verifier_hash):
            raise ValueError(f"{self.id}: content hash mismatch (the spec or its verifier was modified)")
