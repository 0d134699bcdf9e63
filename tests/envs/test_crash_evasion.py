"""An agent cannot turn a failure into a "crash". Trainers drop crashed episodes (SAOTrainer.select:
`dropped_crashed`), so a policy that learns to crash the verifier escapes its reward of 0. Each trick below once
did, in bwrap and in Docker; now every one ends at reward 0 with status "ok" (a failure the trainer learns from),
in every family it applies to and in both sandboxes:

* a tool call nested thousands deep (its JSON parse raised RecursionError on the host);
* NUL bytes and lone surrogates in a tool's arguments (`exec` and `str.encode` raised in the step);
* a directory 1,200 levels deep (the host's recursive copy of the workspace raised RecursionError);
* code under test that steals the check's nonce and prints a verdict nested thousands deep (the host's parse raised);
* code under test that floods 13 MiB of output (Docker's rotated log lost the `ready` line: an "infrastructure
  fault").
"""

import json

import pytest

from envs import FAMILIES, Action, run_script


@pytest.fixture(scope="module")
def sandbox(each_sandbox):  # bwrap, then Docker (tests/envs/conftest.py)
    return each_sandbox


DONE = Action("done", {}).render()
DEEP = 5000  # nesting far past Python's recursion limit (1,000)
# the nonce-theft forgery (envs/gate.py FORGERIES) with a verdict line nested DEEP levels
STEAL_NONCE = ("import sys, os\nf = sys._getframe()\nnonce = None\nwhile f is not None:\n"
               "    for v in list(f.f_locals.values()):\n"
               "        if isinstance(v, dict) and 'nonce' in v: nonce = v['nonce']\n"
               "        if isinstance(v, str) and len(v) == 32: nonce = nonce or v\n    f = f.f_back\n")


def _call(tool: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": tool, "arguments": args}) + "</tool_call>"


def nested_call(spec):
    body = '{"name": "read", "arguments": ' + "[" * DEEP + "]" * DEEP + "}"
    return [f"<tool_call>{body}</tool_call>", DONE]


def bad_encoding(spec):
    """The family's first tool, with a NUL byte in one call and a lone surrogate in the next (JSON escapes both)."""
    tool = spec.tools[0]
    key = {"read": "path", "ls": "path", "calc": "expr", "replace": "path", "write": "path"}.get(tool)
    calls = []
    for bad in ("x\x00y", "x\ud800y"):
        if "python" in spec.tools:
            calls.append(_call("python", path="a.py", argv=[bad]))
        if "pytest" in spec.tools:
            calls.append(_call("pytest", argv=[bad]))
        if key:
            args = {"path": "a", "old": "a", "new": "b"} if tool == "replace" else {}
            calls.append(_call(tool, **{**args, key: bad}))
    return calls + [DONE]


def deep_directory(spec):
    """1,200 levels, built as an agent can: one directory at a time in Python, or three writes (the write tool
    makes a file's missing parents recursively, 400 more levels each time)."""
    if "python" in spec.tools:
        code = "import os\nfor _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\nopen('f', 'w').write('x')"
        return [Action("python", {"code": code}).render(), DONE]
    if "write" in spec.tools:
        return [Action("write", {"path": "/".join(["d"] * k) + "/f", "content": "x"}).render()
                for k in (400, 800, 1200)] + [DONE]
    return None


def _packages(spec):
    return sorted({p.split("/")[0] for p in spec.files if p.endswith("__init__.py")})


def nested_verdict(spec):
    if "write" not in spec.tools or not _packages(spec):
        return None
    code = STEAL_NONCE + (f"print(f'\\n{{nonce}} ' + '[' * {DEEP} + ']' * {DEEP}, flush=True)\n"
                          f"print(f'\\n{{nonce}} ' + '{{\"a\":' * {DEEP} + '1' + '}}' * {DEEP}, flush=True)\n"
                          "os._exit(0)\n")
    return [Action("write", {"path": f"{p}/__init__.py", "content": code}).render() for p in _packages(spec)] + [DONE]


def flood(spec):
    if "write" not in spec.tools or not _packages(spec):
        return None
    code = "import sys\nfor _ in range(200):\n    sys.stdout.write('A' * 65536)\nsys.stdout.flush()\n"
    return [Action("write", {"path": f"{p}/__init__.py", "content": code}).render() for p in _packages(spec)] + [DONE]


TRICKS = {"nested-call": nested_call, "bad-encoding": bad_encoding, "deep-directory": deep_directory,
          "nested-verdict": nested_verdict, "flood": flood}
CASES = [(t, f) for t, make in TRICKS.items() for f in sorted(FAMILIES) if make(FAMILIES[f].make(0)) is not None]


def test_every_trick_applies_to_the_families_it_names():
    """The cases below cover every family for the parse and encoding tricks, and the code families for the rest."""
    by = {t: {f for tt, f in CASES if tt == t} for t in TRICKS}
    assert by["nested-call"] == by["bad-encoding"] == set(FAMILIES)
    assert {"fix-bug", "slow-stage"} <= by["deep-directory"] and "fix-bug" in by["nested-verdict"] & by["flood"]


@pytest.mark.parametrize("trick,family", CASES)
def test_a_trick_is_a_failure_never_a_crash(sandbox, trick, family):
    spec = FAMILIES[family].make(0)
    r, log, obs = run_script(spec, sandbox, TRICKS[trick](spec))
    assert r.status == "ok" and r.reward == 0.0 and r.attempts == 1, (trick, family, r.checks, obs)
    if trick in ("nested-call", "bad-encoding"):  # refused as the agent's error, before anything ran
        assert all(o.startswith("error:") for o in obs[:-1]) and len(obs) > 1, obs


def test_the_oracle_still_earns_the_reward_after_a_deep_directory(sandbox):
    """The deep tree is the agent's junk, not a verdict: next to a real fix, the verifier copies it and passes."""
    spec = FAMILIES["fix-bug"].make(0)
    r, _, obs = run_script(spec, sandbox, deep_directory(spec)[:-1] + spec.reference)
    assert r.status == "ok" and r.reward == 1.0, (r.checks, obs)
