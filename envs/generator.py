"""Spec generation: from family patterns (deterministic per seed) or, optionally, from a free-text
pattern through an OpenAI-compatible chat endpoint. Both produce `TaskSpec`s that go through the same
gate (`envs.gate.validate`) before anything trains on them.

Patterns are family names with optional knobs: "kv-lookup", "fix-bug?horizon=2".
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .actions import Action, parse_action
from .families import FAMILIES, get_family
from .spec import Check, PublicTask, TaskSpec, Verifier


def parse_pattern(pattern: str) -> tuple[str, dict[str, Any]]:
    name, _, query = pattern.partition("?")
    get_family(name)
    knobs: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        k, eq, v = part.partition("=")
        if not eq:
            raise ValueError(f"pattern {pattern!r}: knob {part!r} needs key=value")
        knobs[k] = int(v) if v.lstrip("-").isdigit() else v
    return name, knobs


def generate(patterns: Sequence[str] | None, n: int, seed: int = 0) -> list[TaskSpec]:
    """`n` specs cycling over `patterns` (default: every family). Same arguments → same specs."""
    pats = [parse_pattern(p) for p in (patterns or list(FAMILIES))]
    if n < 0:
        raise ValueError("n must be >= 0")
    out = []
    for i in range(n):
        name, knobs = pats[i % len(pats)]
        out.append(get_family(name).make(seed * 1_000_003 + i, knobs))
    return out


# ---- LLM-backed generator ------------------------------------------------------------------------------
TASK_PROMPT = """You write executable agent tasks. Reply with ONE JSON object, no prose:
{"domain": "code"|"math"|"reasoning", "instruction": str, "files": {path: content}, "tools": [tool names],
 "hidden": {any facts the checker needs, e.g. the true answer}, "reference": [tool calls that solve it]}
Tools: ls, read, write, replace, calc, python, pytest, submit, done. A tool call is written
<tool_call>TOOL ARGS</tool_call>, e.g. <tool_call>read notes.txt</tool_call>, <tool_call>submit 42</tool_call>.
The reference must be minimal: it ends with its last state-changing call (write, replace, python or submit)."""

VERIFIER_PROMPT = """You write the verifier of an agent task from its public description and hidden facts
(you never see a solution). Reply with ONE JSON object: {"checks": [check, ...]} where a check is
{"kind": "answer", "name": str, "expected": str, "normalize": "strip"|"number"|"casefold"} or
{"kind": "python", "name": str, "code": str}  (code runs sandboxed in the final workspace and calls
emit({"pass": bool, "detail": str}))."""


class LLMGenerator:
    """Turns a free-text task pattern into a TaskSpec with two calls to an OpenAI-compatible endpoint:
    one writes the task, hidden state and reference; a second writes the verifier from the public task
    and hidden state only. Off unless constructed with an endpoint."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0):
        import httpx

        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _chat(self, system: str, user: str, seed: int) -> dict[str, Any]:
        r = self.http.post("/v1/chat/completions", json={
            "model": self.model, "temperature": 0, "seed": seed,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        })
        r.raise_for_status()
        text = r.json()["choices"][0]["message"]["content"]
        m = re.search(r"\{.*\}", text, re.S)
        if not m:
            raise ValueError(f"model reply holds no JSON object: {text[:200]!r}")
        return json.loads(m.group())

    def generate(self, pattern: str, seed: int = 0) -> TaskSpec:
        task = self._chat(TASK_PROMPT, f"Task pattern: {pattern}\nSeed: {seed}", seed)
        for k in ("domain", "instruction", "files", "tools", "hidden", "reference"):
            if k not in task:
                raise ValueError(f"generated task lacks {k!r}")
        slug = re.sub(r"[^a-z0-9]+", "-", pattern.lower()).strip("-")[:32] or "task"
        public = PublicTask(id=f"llm-{slug}-{seed:06d}", family=f"llm:{slug}", domain=task["domain"],
                            instruction=task["instruction"], files=task["files"],
                            tools=[t for t in task["tools"] if t not in ("submit", "done")],
                            max_turns=max(8, 3 * len(task["reference"]) + 4))
        for call in task["reference"]:
            if not isinstance(parse_action(call), Action):
                raise ValueError(f"reference call does not parse: {call!r}")
        ver = self._chat(VERIFIER_PROMPT, json.dumps({"task": public.model_dump(), "hidden": task["hidden"]}), seed)
        verifier = Verifier(checks=[Check(**c) for c in ver.get("checks", [])])
        spec = TaskSpec(**public.model_dump(), seed=seed, hidden=task["hidden"], reference=list(task["reference"]),
                        verifier=verifier, source="llm")
        return spec.compute_hashes()
