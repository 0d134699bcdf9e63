"""Task specs and verifiers.

A `TaskSpec` is everything about one environment: what the agent sees (`PublicTask`: instruction,
initial workspace files, tools, turn budget), the seeded hidden state, the difficulty knobs, the
reference solution (hidden from agent and verifier), the verifier, and content hashes of the spec and
of the verifier for provenance.

A `Verifier` is data: a list of checks. "answer" compares the submitted answer; "python" runs a
generated script in the sandbox over a copy of the final workspace; "pytest" runs hidden test files in
the sandbox and requires an exact count of passing tests; "unchanged" pins files by hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Domain = Literal["code", "math", "reasoning"]


def content_hash(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(data.encode()).hexdigest()


class Check(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["answer", "python", "pytest", "unchanged"]
    name: str
    expected: str | None = None  # answer
    normalize: Literal["exact", "strip", "number", "casefold"] = "strip"
    code: str | None = None  # python: prints one JSON object {"pass": bool, "detail": str} as its last line
    files: dict[str, str] = Field(default_factory=dict)  # pytest: hidden test files
    expect_passed: int = 0  # pytest: exactly this many tests must pass (none fail, none skipped away)
    hashes: dict[str, str] = Field(default_factory=dict)  # unchanged: path -> sha256 of content


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
