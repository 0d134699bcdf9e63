"""Spec generation: from family patterns (deterministic per seed) or, optionally, from a free-text
pattern through an OpenAI-compatible chat endpoint. Both produce `TaskSpec`s that go through the same
gate (`envs.gate.validate`) before anything trains on them.

Patterns are family names with optional knobs: "kv-lookup", "fix-bug?horizon=2".

A model's reply is data: a reply that does not fit the schema, names an unsafe path, or writes a "python" check that
would run workspace code is rejected (`SpecRejected`, a ValueError, with the reason) before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

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


def data_seed(purpose: str, seed: int, pattern: str, index: int) -> int:
    """The seed of a set's `index`-th spec of `pattern`: a hash of what the set is for (held-out, validation, RL, SFT,
    …), the set's seed, the pattern and the index, so two sets built for different purposes never share a seed
    (seeds that were plain offsets once made the held-out set a copy of base-recipe data)."""
    h = hashlib.sha256(f"temper-data:{purpose}:{seed}:{pattern}:{index}".encode()).digest()
    return int.from_bytes(h[:6], "big")


def generate(patterns: Sequence[str] | None, n: int, seed: int = 0, purpose: str | None = None) -> list[TaskSpec]:
    """`n` specs cycling over `patterns` (default: every family). Same arguments → same specs. With `purpose`, each
    spec's seed is `data_seed(purpose, seed, pattern, i)`; without, `seed * 1_000_003 + i` (the base recipe's
    data, kept so the shipped base's recipe reproduces)."""
    pat_strs = list(patterns or list(FAMILIES))
    pats = [parse_pattern(p) for p in pat_strs]
    if n < 0:
        raise ValueError("n must be >= 0")
    out = []
    for i in range(n):
        name, knobs = pats[i % len(pats)]
        s = data_seed(purpose, seed, pat_strs[i % len(pats)], i) if purpose else seed * 1_000_003 + i
        out.append(get_family(name).make(s, knobs))
    return out


def task_content(spec: TaskSpec) -> str:
    """What makes two tasks the same task, whatever their ids and seeds: the family, the instruction and the files."""
    return json.dumps([spec.family, spec.instruction, sorted(spec.files.items())])


def generate_disjoint(patterns: Sequence[str] | None, n: int, seed: int, purpose: str,
                      exclude: set[str] = frozenset(), max_tries: int = 50) -> tuple[list[TaskSpec], int]:
    """`generate(patterns, n, seed, purpose)` with no task twice and none whose `task_content` is in `exclude`:
    each pattern keeps its share of the `n` (as `generate` cycles them), a skipped task replaced by the pattern's
    next index. Returns (specs, how many were skipped). A pattern whose task space runs out (`max_tries` × its share
    drawn) is an error naming it."""
    pat_strs = list(patterns or list(FAMILIES))
    k = len(pat_strs)
    quota = [len(range(j, n, k)) for j in range(k)]
    seen, skipped, per = set(exclude), 0, []
    for j, p in enumerate(pat_strs):
        name, knobs = parse_pattern(p)
        got, i = [], j
        while len(got) < quota[j]:
            if i >= j + k * max(1, quota[j]) * max_tries:
                raise ValueError(f"pattern {p!r}: only {len(got)} distinct tasks for {purpose!r} outside the excluded "
                                 f"sets, {quota[j]} asked")
            spec = get_family(name).make(data_seed(purpose, seed, p, i), knobs)
            c = task_content(spec)
            if c in seen:
                skipped += 1
            else:
                seen.add(c)
                got.append(spec)
            i += k
        per.append(got)
    return [per[i % k][i // k] for i in range(n)], skipped


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
{"kind": "calls", "name": str, "calls": [{"module": "solution", "fn": "add", "args": [2, 3]}, ...],
 "returns": [5, ...]}  (imports the workspace's module, calls the function, and compares what it returns with the
 expected value, type-strictly: use it for anything that runs the workspace's code) or
{"kind": "python", "name": str, "code": str}  (code runs sandboxed in the final workspace, reads its files as
data and calls emit({"pass": bool, "detail": str}); it may import only stdlib modules such as ast, json, re, os,
and must never import, exec or run the workspace's code). Check exact values, never that a text contains
another."""


class GeneratedTask(BaseModel):
    """What the task writer must return (validated here, whatever the server enforced)."""

    domain: Literal["code", "math", "reasoning"]
    instruction: str = Field(min_length=1)
    files: dict[str, str] = Field(default_factory=dict)
    tools: list[str]
    hidden: dict[str, Any]
    reference: list[str] = Field(min_length=1)


class GeneratedVerifier(BaseModel):
    checks: list[Check] = Field(min_length=1)


class SpecRejected(ValueError):
    """The model's reply is not a spec temper will run: a field that does not fit, an unsafe path, a check that
    would run workspace code. `reason` says which; the caller skips this spec (nothing of it was written or run)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _why(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x)[:40] for x in err['loc']) or '(root)'}: {err['msg']}" for err in e.errors())


class LLMUnavailable(RuntimeError):
    """The endpoint could not be reached or kept failing after the SDK's retries."""


class LLMGenerator:
    """Turns a free-text task pattern into a TaskSpec with two calls to an OpenAI-compatible chat endpoint,
    through the `openai` SDK (optional dependency: `pip install temper[llm]`): one writes the task, hidden state
    and reference; a second writes the verifier from the public task and hidden state only.

    The SDK brings the timeouts and the retries (connection errors, 408/409/429/5xx, with backoff).
    `structured`: ask for JSON-schema structured output (`response_format`; SGLang, vLLM and OpenAI decode
    under the schema). temper's own engine has no constrained decoding and refuses it, so against `temper serve`
    pass `structured=False`. Either way the reply is validated against the schema here, and a reply that does not
    fit fails with the field that is wrong.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 2, structured: bool = True, max_tokens: int = 2048):
        try:
            import openai
        except ImportError:  # pragma: no cover - depends on the install
            raise ImportError("the LLM generator needs the openai SDK: pip install 'temper[llm]'") from None
        self.model, self.structured, self.max_tokens = model, structured, max_tokens
        url = base_url.rstrip("/")
        self.client = openai.OpenAI(base_url=url if url.endswith("/v1") else url + "/v1", api_key=api_key or "none",
                                    timeout=timeout, max_retries=max_retries)

    def _chat(self, system: str, user: str, seed: int, schema: type[BaseModel]) -> BaseModel:
        import openai

        kw: dict[str, Any] = {}
        if self.structured:
            kw["response_format"] = {"type": "json_schema", "json_schema": {
                "name": schema.__name__, "schema": schema.model_json_schema()}}
        try:
            r = self.client.chat.completions.create(
                model=self.model, temperature=0, seed=seed, max_tokens=self.max_tokens,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": user}], **kw)
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise LLMUnavailable(f"{self.client.base_url}: {type(e).__name__}: {e} "
                                 f"(after {self.client.max_retries} retries)") from None
        except openai.APIStatusError as e:
            raise ValueError(f"{self.client.base_url} refused the request: HTTP {e.status_code}: {e.message}") from None
        text = r.choices[0].message.content or ""
        m = re.search(r"\{.*\}", text, re.S)
        if not m:
            raise SpecRejected(f"model reply holds no JSON object: {text[:200]!r}")
        try:
            return schema.model_validate_json(m.group())
        except ValidationError as e:
            raise SpecRejected(f"model reply does not fit {schema.__name__}: {_why(e)}") from None

    def generate(self, pattern: str, seed: int = 0) -> TaskSpec:
        task = self._chat(TASK_PROMPT, f"Task pattern: {pattern}\nSeed: {seed}", seed, GeneratedTask)
        slug = re.sub(r"[^a-z0-9]+", "-", pattern.lower()).strip("-")[:32] or "task"
        try:  # the task's paths are checked here, before anything of it is written anywhere
            public = PublicTask(id=f"llm-{slug}-{seed:06d}", family=f"llm:{slug}", domain=task.domain,
                                instruction=task.instruction, files=task.files,
                                tools=[t for t in task.tools if t not in ("submit", "done")],
                                max_turns=max(8, 3 * len(task.reference) + 4))
        except ValidationError as e:
            raise SpecRejected(f"generated task rejected: {_why(e)}") from None
        for call in task.reference:
            if not isinstance(parse_action(call), Action):
                raise SpecRejected(f"reference call does not parse: {call[:200]!r}")
        ver = self._chat(VERIFIER_PROMPT, json.dumps({"task": public.model_dump(), "hidden": task.hidden}), seed,
                         GeneratedVerifier)
        try:
            spec = TaskSpec(**public.model_dump(), seed=seed, hidden=task.hidden, reference=list(task.reference),
                            verifier=Verifier(checks=ver.checks), source="llm")
        except ValidationError as e:
            raise SpecRejected(f"generated spec rejected: {_why(e)}") from None
        return spec.compute_hashes()
