"""Task specs and verifiers.

A `TaskSpec` is everything about one environment: what the agent sees (`PublicTask`: instruction,
initial workspace files, tools, turn budget), the seeded hidden state, the difficulty knobs, the
reference solution (hidden from agent and verifier), the verifier, and content hashes of the spec and
of the verifier for provenance.

A `Verifier` is data: a list of checks. "answer" compares the submitted answer; "python" runs a
generated script in the sandbox over a copy of the final workspace (it reads files as data; no code of the
agent's runs there); "calls" calls the workspace's functions in the sandbox and compares what came back with
expected values that never enter the sandbox, on the host and type-strictly; "unchanged" pins files by hash
without following links. No verdict is computed in a process that ran the agent's code: a "python" check that
could run workspace code (imports it, execs it, starts a process) fails validation (`envs.checkcode`).

Every path in a spec (task files, pinned files, forbidden prefixes) is data until proven safe: `check_path` rejects,
at validation, anything but a plain relative path inside the workspace, naming the offending path. A copy made
without validation (`model_copy(update=...)`) is checked again by `TaskSpec.problems()`, which the gate calls
before anything runs.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from .checkcode import check_python

Domain = Literal["code", "math", "reasoning"]

MAX_PATH_CHARS = 255
MAX_PATH_PARTS = 16
MAX_NAME_BYTES = 255  # NAME_MAX: one component
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){0,15}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def check_path(path: Any, what: str = "path") -> str:
    """`path` if it is a plain relative path inside the workspace; ValueError naming it otherwise.

    Every path in a spec is data until proven safe: relative, non-empty components, no `.` or `..`, no backslash,
    no NUL or control character, valid UTF-8, at most MAX_PATH_PARTS components and MAX_PATH_CHARS characters."""
    if not isinstance(path, str):
        raise ValueError(f"{what} {path!r}: not a string")
    why = None
    if not path:
        why = "is empty"
    elif len(path) > MAX_PATH_CHARS:
        why = f"has {len(path)} characters, more than {MAX_PATH_CHARS}"
    elif _CONTROL.search(path):
        why = "holds a NUL or control character"
    elif "\\" in path:
        why = "holds a backslash"
    elif path.startswith("/"):
        why = "is absolute"
    elif not _utf8(path):
        why = "is not valid UTF-8"
    else:
        parts = path.split("/")
        longest = max(len(p.encode("utf-8")) for p in parts)
        if len(parts) > MAX_PATH_PARTS:
            why = f"has {len(parts)} components, more than {MAX_PATH_PARTS}"
        elif "" in parts:
            why = "has an empty component"
        elif ".." in parts:
            why = "has a '..' component"
        elif "." in parts:
            why = "has a '.' component"
        elif longest > MAX_NAME_BYTES:
            why = f"has a component longer than {MAX_NAME_BYTES} bytes"
    if why:
        raise ValueError(f"{what} {path[:80]!r} {why}: a spec's paths are relative paths inside the workspace")
    return path


def check_files(files: dict[str, Any], what: str = "task file") -> dict[str, Any]:
    """Every key a safe path (`check_path`), and no file that is also the directory of another."""
    for p in files:
        check_path(p, what)
    dirs = {p.rsplit("/", i)[0] for p in files for i in range(1, p.count("/") + 1)}
    clash = sorted(dirs & set(files))
    if clash:
        raise ValueError(f"{what} {clash[0]!r} is both a file and the directory of another file")
    return files


MAX_TASK_BYTES = 16 << 20  # a task's files together, well inside a workspace's quota (Limits.workspace_bytes)


def check_task_files(files: dict[str, Any]) -> dict[str, Any]:
    """A task's files: safe paths (`check_files`) whose contents together fit MAX_TASK_BYTES (a larger set would fail
    the workspace's set-up, not the agent)."""
    check_files(files)
    total = sum(len(v.encode("utf-8", "surrogatepass")) for v in files.values() if isinstance(v, str))
    if total > MAX_TASK_BYTES:
        raise ValueError(f"task files hold {total} bytes, more than {MAX_TASK_BYTES}")
    return files


def _name(v: str) -> str:
    if not _NAME.fullmatch(v):
        raise ValueError(f"{v[:80]!r}: ids and family names are 1-128 characters of A-Z a-z 0-9 . _ : + - "
                         "(they name temporary directories and files)")
    return v


def _prefix(v: str) -> str:
    """A forbidden path prefix: a safe path, optionally ending in '/' (a directory)."""
    check_path(v[:-1] if v.endswith("/") and len(v) > 1 else v, "forbidden path")
    return v


WorkspacePath = Annotated[str, AfterValidator(lambda p: check_path(p, "task file"))]


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
        if self.kind == "python":
            if self.code is None:
                raise ValueError(f"check {self.name!r}: a 'python' check needs 'code'")
            check_python(self.name, self.code)
        check_files(self.hashes, f"check {self.name!r}: pinned path")
        if self.kind == "calls":
            if not self.calls or len(self.calls) != len(self.returns):
                raise ValueError(f"check {self.name!r}: 'calls' needs one expected value in 'returns' per call "
                                 f"(got {len(self.calls)} calls, {len(self.returns)} returns)")
            if all(r is None for r in self.returns):  # a function that does nothing (a stub, a test) would pass
                raise ValueError(f"check {self.name!r}: every expected return value is None: a check must tell a "
                                 "working function from one that does nothing")
            for c in self.calls:
                if set(c) != {"module", "fn", "args"} or not isinstance(c["args"], list):
                    raise ValueError(f"check {self.name!r}: a call is {{module, fn, args: list}}, got {c}")
                if not (isinstance(c["module"], str) and _MODULE.fullmatch(c["module"])
                        and isinstance(c["fn"], str) and _IDENT.fullmatch(c["fn"])):
                    raise ValueError(f"check {self.name!r}: a call names a module (dotted identifiers, absolute) "
                                     f"and a function (an identifier), got {c['module']!r}, {c['fn']!r}")
        return self


class Verifier(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checks: list[Check]

    def hash(self) -> str:
        return content_hash(self.model_dump(mode="json"))


class PublicTask(BaseModel):
    """What the agent (and the verifier builder) may see."""

    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, AfterValidator(_name)]
    family: Annotated[str, AfterValidator(_name)]
    domain: Domain
    instruction: str
    files: Annotated[dict[WorkspacePath, str], AfterValidator(check_task_files)]
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
    # path prefixes a genuine solve never touches
    forbidden_paths: list[Annotated[str, AfterValidator(_prefix)]] = Field(default_factory=list)
    source: str = "template"  # "template" | "llm"
    spec_hash: str = ""
    verifier_hash: str = ""

    def public(self) -> PublicTask:
        return PublicTask(**{k: getattr(self, k) for k in PublicTask.model_fields})

    def compute_hashes(self) -> TaskSpec:
        body = self.model_dump(mode="json", exclude={"spec_hash", "verifier_hash"})
        return self.model_copy(update={"spec_hash": content_hash(body), "verifier_hash": self.verifier.hash()})

    def problems(self) -> list[str]:
        """Every rule the spec breaks, checked afresh (a copy made with `model_copy(update=...)` or
        `model_construct` skipped validation): unsafe paths, checks that would run workspace code, bad fields."""
        from pydantic import ValidationError

        try:
            type(self).model_validate(self.model_dump(mode="python"))
        except ValidationError as e:
            return [f"{'.'.join(str(x)[:40] for x in err['loc']) or '(spec)'}: {err['msg']}" for err in e.errors()]
        return []

    def check_hashes(self) -> None:
        fresh = self.compute_hashes()
        if (fresh.spec_hash, fresh.verifier_hash) != (self.spec_hash, self.verifier_hash):
            raise ValueError(f"{self.id}: content hash mismatch (the spec or its verifier was modified)")
