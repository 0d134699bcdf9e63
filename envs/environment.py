"""One episode of a task: a private workspace, tool calls run in the sandbox, and the verifier.

    env = Environment(spec, sandbox)
    obs = env.reset()                      # the instruction
    step = env.step(assistant_text)        # parse → run the tool in the sandbox → observation
    reward = env.verify()                  # deterministic; a crashing check → reward 0, status "crashed"
    env.close()

Malformed actions, unknown tools and tool errors come back as observations; nothing the agent writes
raises through `step`.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .actions import Action, ActionError, parse_action
from .sandbox import Limits, RunResult, Sandbox
from .spec import Check, TaskSpec

OBS_CHARS = 4000


@dataclass
class StepResult:
    observation: str
    done: bool
    action: Action | None = None
    error: str | None = None
    seconds: float = 0.0
    truncated: bool = False


@dataclass
class CheckResult:
    name: str
    passed: bool
    detail: str = ""
    crashed: bool = False


@dataclass
class Reward:
    reward: float
    status: str  # "ok" | "crashed"
    checks: list[CheckResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"reward": self.reward, "status": self.status,
                "checks": [c.__dict__ for c in self.checks]}


def _normalise(s: str, how: str) -> str:
    if how == "exact":
        return s
    s = s.strip()
    if how == "casefold":
        return " ".join(s.casefold().split())
    if how == "number":
        t = s.replace(",", "").removeprefix("$").strip()
        try:
            v = float(t)
        except ValueError:
            return s
        return str(int(v)) if v.is_integer() else repr(round(v, 6))
    return s


class Environment:
    def __init__(self, spec: TaskSpec, sandbox: Sandbox, limits: Limits | None = None,
                 workdir: str | Path | None = None):
        self.spec, self.sandbox = spec, sandbox
        self.limits = limits or sandbox.limits
        self._tmp = Path(tempfile.mkdtemp(prefix=f"temper-{spec.family}-", dir=workdir))
        self.workspace = self._tmp / "work"
        self.turns = 0
        self.answer: str | None = None
        self.done = False
        self.log: list[Action] = []

    # ---- episode -----------------------------------------------------------------------------------
    def reset(self) -> str:
        shutil.rmtree(self.workspace, ignore_errors=True)
        self.workspace.mkdir(parents=True)
        for rel, content in self.spec.files.items():
            p = self.workspace / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(content)
        self.workspace.chmod(0o777)
        for p in self.workspace.rglob("*"):
            p.chmod(0o777 if p.is_dir() else 0o666)
        self.turns, self.answer, self.done, self.log = 0, None, False, []
        return self.spec.instruction

    def step(self, text: str) -> StepResult:
        if self.done:
            return StepResult("error: the episode is over", True, error="episode over")
        t0 = time.perf_counter()
        self.turns += 1
        act = parse_action(text, set(self.spec.tools) | {"submit", "done"})
        if isinstance(act, ActionError):
            self._out_of_turns()
            return StepResult(f"error: {act.message}", self.done, error=act.message,
                              seconds=time.perf_counter() - t0)
        self.log.append(act)
        if act.tool == "submit":
            self.answer, self.done = act.args["answer"], True
            return StepResult("submitted", True, act, seconds=time.perf_counter() - t0)
        if act.tool == "done":
            self.done = True
            return StepResult("done", True, act, seconds=time.perf_counter() - t0)
        obs, truncated = self._run_tool(act)
        self._out_of_turns()
        return StepResult(obs, self.done, act, seconds=time.perf_counter() - t0, truncated=truncated)

    def _out_of_turns(self) -> None:
        if self.turns >= self.spec.max_turns:
            self.done = True

    def _run_tool(self, act: Action) -> tuple[str, bool]:
        sb = self.sandbox
        if act.tool in ("ls", "read", "write", "replace", "calc"):
            req = json.dumps({"tool": act.tool, "args": act.args})
            res = sb.run([sb.python(), "-I", "-S", f"{sb.tools_dir()}/runner.py"], self.workspace, stdin=req,
                         limits=self.limits)
            if res.timed_out:
                return f"error: {act.tool} timed out", False
            if res.returncode not in (0, 2):
                return f"error: {act.tool} failed: {res.stderr.strip()[-300:]}", res.truncated
            return res.stdout[:OBS_CHARS], res.truncated
        if act.tool == "python":
            argv = ([sb.python(), "-c", act.args["code"]] if act.args.get("code") is not None
                    else [sb.python(), act.args["path"], *act.args.get("argv", [])])
        else:  # pytest
            boot = (f"import sys; sys.path.append({sb.site_dir()!r}); sys.path.insert(0, {sb.workdir(self.workspace)!r});"
                    " import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))")
            argv = [sb.python(), "-I", "-c", boot, *act.args.get("argv", [])]
        return self._format(sb.run(argv, self.workspace, limits=self.limits))

    @staticmethod
    def _format(res: RunResult) -> tuple[str, bool]:
        text = res.stdout + (("\n" + res.stderr) if res.stderr.strip() else "")
        notes = []
        if res.timed_out:
            notes.append("[killed: wall-clock timeout]")
        elif res.returncode != 0:
            notes.append(f"[exit {res.returncode}]")
        truncated = res.truncated or len(text) > OBS_CHARS
        if truncated:
            text = text[:OBS_CHARS]
            notes.append("[output truncated]")
        return (text.rstrip("\n") + ("\n" + " ".join(notes) if notes else "")).strip("\n"), truncated

    # ---- verification ------------------------------------------------------------------------------
    def verify(self) -> Reward:
        """Run every check; reward 1.0 iff all pass. Never raises: a crash is reward 0, status crashed."""
        results: list[CheckResult] = []
        try:
            for check in self.spec.verifier.checks:
                results.append(self._check(check))
        except Exception as e:  # noqa: BLE001 - the caller must never see a verifier crash
            results.append(CheckResult("verifier", False, f"{type(e).__name__}: {e}", crashed=True))
            return Reward(0.0, "crashed", results)
        crashed = any(r.crashed for r in results)
        ok = bool(results) and all(r.passed for r in results)
        return Reward(1.0 if ok and not crashed else 0.0, "crashed" if crashed else "ok", results)

    def _check(self, c: Check) -> CheckResult:
        if c.kind == "answer":
            if self.answer is None:
                return CheckResult(c.name, False, "no answer submitted")
            got, want = _normalise(self.answer, c.normalize), _normalise(c.expected or "", c.normalize)
            return CheckResult(c.name, got == want, "match" if got == want else "wrong answer")
        if c.kind == "unchanged":
            bad = []
            for rel, h in c.hashes.items():
                p = self.workspace / rel
                cur = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
                if cur != h:
                    bad.append(rel)
            return CheckResult(c.name, not bad, f"modified: {bad}" if bad else "unchanged")
        # python / pytest: run on a private copy of the final workspace, in the sandbox
        vdir = Path(tempfile.mkdtemp(prefix="verify-", dir=self._tmp))
        try:
            work = vdir / "work"
            shutil.copytree(self.workspace, work, symlinks=True)
            work.chmod(0o777)
            extra = {}
            req = {"kind": c.kind, "nonce": secrets.token_hex(16)}
            if c.kind == "python":
                req["code"] = c.code
            else:
                tests = vdir / "tests"
                for rel, content in c.files.items():
                    p = tests / rel
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_text(content)
                extra["/verify/tests"] = tests
                req.update(tests=self.sandbox.visible("/verify/tests", tests), site=self.sandbox.site_dir(),
                           work=self.sandbox.workdir(work), expect_passed=c.expect_passed)
            sb = self.sandbox
            res = sb.run([sb.python(), "-I", f"{sb.tools_dir()}/check.py"], work, stdin=json.dumps(req) + "\n",
                         limits=self.limits, extra_ro=extra)
            for line in reversed(res.stdout.splitlines()):
                if line.startswith(req["nonce"] + " "):
                    v = json.loads(line[len(req["nonce"]) + 1 :])
                    return CheckResult(c.name, bool(v["pass"]), v.get("detail", ""), bool(v.get("crashed")))
            why = "timed out" if res.timed_out else f"exit {res.returncode}: {res.stderr.strip()[-200:]}"
            # no verdict: the code under test killed the check process (os._exit, timeout, OOM) — a failed
            # check, not a verifier crash, unless the check could not even start
            return CheckResult(c.name, False, f"no verdict ({why})", crashed=res.returncode == 127)
        finally:
            shutil.rmtree(vdir, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Environment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_script(spec: TaskSpec, sandbox: Sandbox, actions: list[str], limits: Limits | None = None):
    """Play a fixed list of tool calls (oracle, prefix, probe), then verify. Returns (Reward, log, obs)."""
    with Environment(spec, sandbox, limits) as env:
        env.reset()
        observations = []
        for a in actions:
            if env.done:
                break
            observations.append(env.step(a).observation)
        return env.verify(), list(env.log), observations
