"""The action grammar shared by environments and the agent loop.

An assistant turn acts through one tool call, in either of two forms:

    <tool_call>read notes.txt</tool_call>                       compact: `tool arg arg…` (shell quoting)
    <tool_call>{"name": "read", "arguments": {"path": "notes.txt"}}</tool_call>        JSON (chat models)

Compact form per tool (the first line; some tools take a body on the following lines):

    ls [path]                  list files                 read PATH          print a file
    write PATH⏎CONTENT…        replace a whole file       replace PATH OLD NEW   one exact substring
    calc EXPRESSION            arithmetic                 python PATH [ARGS…] | python⏎CODE…   run Python
    pytest [ARGS…]             run the visible tests      submit ANSWER      final answer, ends the episode
    done                       stop without an answer

Text around the tool call is ignored; a missing closing tag is tolerated (stop strings often cut it).
`parse_action` never raises: a malformed call returns an `ActionError` whose message says what was
wrong and how to call the tool, and the environment returns that message as the observation.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from .bounded import BoundsError, check_text, loads

MAX_CALL_CHARS = 64 << 10  # a tool call's body: more than any budget of generated tokens decodes to

OPEN, CLOSE = "<tool_call>", "</tool_call>"

USAGE = {
    "ls": "ls [path]",
    "read": "read PATH",
    "write": "write PATH, then the new content on the following lines",
    "replace": "replace PATH OLD NEW (quote arguments that contain spaces)",
    "calc": "calc EXPRESSION",
    "python": "python PATH [ARGS...], or python followed by code on the following lines",
    "pytest": "pytest [ARGS...]",
    "submit": "submit ANSWER",
    "done": "done",
}
# tools that change the environment's state (for the triad's "corrupt the last state-changing action")
STATE_CHANGING = {"write", "replace", "submit", "python"}


@dataclass
class Action:
    tool: str
    args: dict[str, Any] = field(default_factory=dict)
    raw: str = ""

    def render(self) -> str:
        """Canonical text of this action (what an oracle or a probe emits): compact, or JSON where an argument on
        the compact form's first line holds a line break (a multi-line `replace`), which the compact form cannot
        carry."""
        inline = [v for k, v in self.args.items() if k not in ("content", "code", "expr", "answer")]
        if any("\n" in x for v in inline for x in (v if isinstance(v, list) else [v]) if isinstance(x, str)):
            return OPEN + json.dumps({"name": self.tool, "arguments": self.args}) + CLOSE
        return OPEN + render_body(self.tool, self.args) + CLOSE


@dataclass
class ActionError:
    message: str
    raw: str = ""

    def __str__(self) -> str:
        return self.message


def _q(s: str) -> str:
    return s if s and re.fullmatch(r"[\w./:+\-=,@%]+", s) else shlex.quote(s)


def render_body(tool: str, args: dict[str, Any]) -> str:
    if tool in ("ls",):
        return "ls" + (f" {_q(args['path'])}" if args.get("path") else "")
    if tool == "read":
        return f"read {_q(args['path'])}"
    if tool == "write":
        return f"write {_q(args['path'])}\n{args.get('content', '')}"
    if tool == "replace":
        return f"replace {_q(args['path'])} {_q(args['old'])} {_q(args['new'])}"
    if tool == "calc":
        return f"calc {args['expr']}"
    if tool == "python":
        if args.get("code") is not None:
            return f"python\n{args['code']}"
        return " ".join(["python", _q(args["path"]), *map(_q, args.get("argv", []))])
    if tool == "pytest":
        return " ".join(["pytest", *map(_q, args.get("argv", []))])
    if tool == "submit":
        return f"submit {args.get('answer', '')}"
    return tool


def extract_call(text: str) -> str | None:
    i = text.find(OPEN)
    if i < 0:
        return None
    body = text[i + len(OPEN) :]
    j = body.find(CLOSE)
    return (body if j < 0 else body[:j]).lstrip("\n ")


def parse_action(text: str, allowed: set[str] | None = None) -> Action | ActionError:
    try:
        return _parse_action(text, allowed)
    except Exception as e:  # noqa: BLE001 - nothing the agent writes raises: whatever slipped through is its error
        return ActionError(f"the tool call could not be parsed ({type(e).__name__})", text)


def _parse_action(text: str, allowed: set[str] | None) -> Action | ActionError:
    body = extract_call(text)
    if body is None:
        return ActionError(f"no tool call found: write {OPEN}TOOL ARGS{CLOSE}", text)
    if not body.strip():
        return ActionError("empty tool call", text)
    try:
        if len(body) > MAX_CALL_CHARS:
            raise BoundsError(f"the tool call is {len(body)} characters, more than {MAX_CALL_CHARS}")
        act = _parse_json(body) if body.lstrip().startswith("{") else _parse_compact(body)
        # every argument reaches a process (argv, stdin, a file name): NUL bytes and lone surrogates are refused
        # here, before anything is run
        for k, v in act.args.items():
            for x in (v if isinstance(v, list) else [v]):
                check_text(x, f"{act.tool}: argument {k}")
    except ValueError as e:
        return ActionError(str(e), text)
    if isinstance(act, ActionError):
        return act
    if allowed is not None and act.tool not in allowed:
        return ActionError(f"tool {act.tool!r} is not available here; available: {', '.join(sorted(allowed))}", text)
    act.raw = text
    return act


def _usage(tool: str, why: str) -> ValueError:
    return ValueError(f"{tool}: {why}. usage: {USAGE[tool]}")


def _parse_compact(body: str) -> Action:
    first, _, rest = body.partition("\n")
    first = first.strip()
    tool, _, tail = first.partition(" ")
    tool = tool.strip()
    if tool not in USAGE:
        raise ValueError(f"unknown tool {tool!r}; tools: {', '.join(USAGE)}")
    if tool in ("calc", "submit"):
        arg = (tail + ("\n" + rest if rest else "")).strip()
        if not arg:
            raise _usage(tool, "missing argument")
        return Action(tool, {"expr" if tool == "calc" else "answer": arg})
    try:
        argv = shlex.split(tail)
    except ValueError as e:
        raise _usage(tool, f"cannot split arguments ({e})") from None
    if tool == "ls":
        if len(argv) > 1:
            raise _usage(tool, "takes at most one path")
        return Action(tool, {"path": argv[0]} if argv else {})
    if tool == "read":
        if len(argv) != 1:
            raise _usage(tool, f"takes one path, got {len(argv)} arguments")
        return Action(tool, {"path": argv[0]})
    if tool == "write":
        if len(argv) != 1:
            raise _usage(tool, f"takes one path, got {len(argv)} arguments")
        return Action(tool, {"path": argv[0], "content": rest})
    if tool == "replace":
        if len(argv) != 3:
            raise _usage(tool, f"takes PATH OLD NEW, got {len(argv)} arguments")
        return Action(tool, {"path": argv[0], "old": argv[1], "new": argv[2]})
    if tool == "python":
        if not argv:
            if not rest.strip():
                raise _usage(tool, "give a file to run or code on the following lines")
            return Action(tool, {"code": rest})
        return Action(tool, {"path": argv[0], "argv": argv[1:]})
    if tool == "pytest":
        return Action(tool, {"argv": argv})
    if argv or rest.strip():
        raise _usage(tool, "takes no arguments")
    return Action(tool, {})


_JSON_ARGS = {
    "ls": {"path"}, "read": {"path"}, "write": {"path", "content"}, "replace": {"path", "old", "new"},
    "calc": {"expr"}, "python": {"path", "argv", "code"}, "pytest": {"argv"}, "submit": {"answer"}, "done": set(),
}
_REQUIRED = {"read": {"path"}, "write": {"path"}, "replace": {"path", "old", "new"}, "calc": {"expr"},
             "submit": {"answer"}}


def _parse_json(body: str) -> Action:
    try:
        obj = loads(body, MAX_CALL_CHARS)
    except BoundsError as e:
        raise ValueError(f"tool call is not valid JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('JSON tool call needs {"name": TOOL, "arguments": {...}}')
    tool = obj["name"]
    if tool not in USAGE:
        raise ValueError(f"unknown tool {tool!r}; tools: {', '.join(USAGE)}")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = loads(args, MAX_CALL_CHARS) if args.strip() else {}
        except BoundsError:
            raise _usage(tool, "arguments is not a JSON object") from None
    if not isinstance(args, dict):
        raise _usage(tool, "arguments must be an object")
    extra = set(args) - _JSON_ARGS[tool]
    if extra:
        raise _usage(tool, f"unknown argument(s) {sorted(extra)}")
    missing = _REQUIRED.get(tool, set()) - set(args)
    if missing:
        raise _usage(tool, f"missing argument(s) {sorted(missing)}")
    for k, v in args.items():
        if k == "argv":
            if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
                raise _usage(tool, "argv must be a list of strings")
        elif not isinstance(v, str):
            raise _usage(tool, f"{k} must be a string")
    if tool == "python" and not (args.get("path") or args.get("code")):
        raise _usage(tool, "give path or code")
    return Action(tool, dict(args))
