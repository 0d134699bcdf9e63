"""One episode of a task: a private workspace, tool calls run in the sandbox, and the verifier.

    env = Environment(spec, sandbox)
    obs = env.reset()                      # the instruction
    step = env.step(assistant_text)        # parse → run the tool in the sandbox → observation
    reward = env.verify()                  # deterministic; see `verify` for failures and infrastructure faults
    env.close()

Malformed actions, unknown tools and tool errors come back as observations; nothing the agent writes
raises through `step`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .actions import Action, ActionError, parse_action
from .sandbox import Limits, RunResult, Sandbox
from .spec import Check, TaskSpec
from .tools.check import tag

VERIFY_ATTEMPTS = 3  # an infrastructure fault (the sandbox did not start) is retried this many times in all

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
    status: str  # "ok" (a verdict, pass or fail) | "crashed" (the verifier's infrastructure failed every attempt)
    checks: list[CheckResult] = field(default_factory=list)
    attempts: int = 1

    def to_dict(self) -> dict:
        return {"reward": self.reward, "status": self.status, "attempts": self.attempts,
                "checks": [c.__dict__ for c in self.checks]}


class WorkspaceError(Exception):
    """The workspace holds something a verifier will not read: a special file (FIFO, socket, device)."""


def _pinned_sha(path: Path) -> str | None:
    """sha256 of a regular file, read without following a link; None for a link, a special file or nothing."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def copy_workspace(src: Path, dst: Path, root: Path | None = None) -> None:
    """Copy the workspace for a verifier: directories and regular files as they are, links as links (never
    followed), and a special file refused with WorkspaceError (opening a FIFO would hang the verifier)."""
    root = root or src
    dst.mkdir()
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        to = dst / entry.name
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(entry.path), to)
        elif stat.S_ISDIR(st.st_mode):
            copy_workspace(Path(entry.path), to, root)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f, open(to, "wb") as g:
                shutil.copyfileobj(f, g)
        else:
            kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
            raise WorkspaceError(f"{os.path.relpath(entry.path, root)} is a {kind}")


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
        self._tmp.chmod(0o711)  # the sandbox runs as an unprivileged user: it may pass through, not list
        self.workspace = self._tmp / "work"
        self._quota = False  # whether the workspace is a size-limited mount (Sandbox.mount_quota)
        self.turns = 0
        self.answer: str | None = None
        self.done = False
        self.log: list[Action] = []

    # ---- episode -----------------------------------------------------------------------------------
    def reset(self) -> str:
        if self._quota:  # the workspace is its own size-limited filesystem: empty it, keep the mount
            for p in self.workspace.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        else:
            shutil.rmtree(self.workspace, ignore_errors=True)
            self.workspace.mkdir(parents=True)
            self._quota = self.sandbox.mount_quota(self.workspace, self.limits.workspace_bytes)
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
        """Run every check; reward 1.0 iff all pass. Never raises.

        What the agent left behind decides a failure (reward 0, status "ok", with the reason): wrong values, code
        that raised, exited or hung, a missing or garbled observation, a special file in the workspace. Only a
        fault of the verifier's own infrastructure (the sandbox did not start the check) is status "crashed":
        it is retried up to VERIFY_ATTEMPTS times, and `attempts` says how many were made."""
        for attempt in range(1, VERIFY_ATTEMPTS + 1):
            results: list[CheckResult] = []
            try:
                for check in self.spec.verifier.checks:
                    results.append(self._check(check))
            except Exception as e:  # noqa: BLE001 - the caller must never see a verifier crash
                results.append(CheckResult("verifier", False, f"{type(e).__name__}: {e}", crashed=True))
            if not any(r.crashed for r in results):
                ok = bool(results) and all(r.passed for r in results)
                return Reward(1.0 if ok else 0.0, "ok", results, attempt)
        return Reward(0.0, "crashed", results, VERIFY_ATTEMPTS)

    def _check(self, c: Check) -> CheckResult:
        if c.kind == "answer":
            if self.answer is None:
                return CheckResult(c.name, False, "no answer submitted")
            got, want = _normalise(self.answer, c.normalize), _normalise(c.expected or "", c.normalize)
            return CheckResult(c.name, got == want, "match" if got == want else "wrong answer")
        if c.kind == "unchanged":
            bad = [rel for rel, h in c.hashes.items() if _pinned_sha(self.workspace / rel) != h]
            return CheckResult(c.name, not bad, f"modified, replaced or not a regular file: {bad}" if bad else "unchanged")
        # python / calls: run on a private copy of the final workspace, in the sandbox
        vdir = Path(tempfile.mkdtemp(prefix="verify-", dir=self._tmp))
        vdir.chmod(0o711)
        try:
            work = vdir / "work"
            try:
                copy_workspace(self.workspace, work)
            except WorkspaceError as e:
                return CheckResult(c.name, False, f"refused: {e}")
            work.chmod(0o777)
            req = {"kind": c.kind, "nonce": secrets.token_hex(16), "work": self.sandbox.workdir(work)}
            if c.kind == "python":
                req["code"] = c.code
            else:
                req["calls"] = c.calls  # the expected values stay here
            sb = self.sandbox
            res = sb.run([sb.python(), "-I", f"{sb.tools_dir()}/check.py"], work, stdin=json.dumps(req) + "\n",
                         limits=self.limits)
            lines = [ln[len(req["nonce"]) + 1:] for ln in res.stdout.splitlines() if ln.startswith(req["nonce"] + " ")]
            if "ready" not in lines[:1]:  # the check never started: the sandbox failed, not the agent's code
                why = "timed out" if res.timed_out else f"exit {res.returncode}: {res.stderr.strip()[-200:]}"
                return CheckResult(c.name, False, f"verifier did not start ({why})", crashed=True)
            try:
                v = json.loads(lines[-1]) if len(lines) > 1 else None
            except ValueError:
                v = None
            if not isinstance(v, dict):  # the code under test killed or garbled the check: a failure
                why = "timed out" if res.timed_out else f"exit {res.returncode}"
                return CheckResult(c.name, False, f"no observation ({why})")
            if c.kind == "python":
                return CheckResult(c.name, v.get("pass") is True, str(v.get("detail", ""))[:500])
            return self._compare(c, v)
        finally:
            shutil.rmtree(vdir, ignore_errors=True)

    @staticmethod
    def _compare(c: Check, v: dict) -> CheckResult:
        """The observed return values against the expected ones, type-strictly, here on the host."""
        obs = v.get("observations")
        if not isinstance(obs, list) or len(obs) != len(c.calls):
            return CheckResult(c.name, False, f"garbled observations ({type(obs).__name__})")
        wrong = []
        for call, want, got in zip(c.calls, c.returns, obs):
            if not (isinstance(got, dict) and "value" in got and got["value"] == tag(want)):
                what = f"raised {got.get('raised')}" if isinstance(got, dict) and "raised" in got else "wrong value"
                wrong.append(f"{call['fn']}({', '.join(map(repr, call['args']))}): {what}")
        return CheckResult(c.name, not wrong, f"{len(c.calls) - len(wrong)}/{len(c.calls)} calls right"
                                               + (f"; {'; '.join(wrong[:3])}" if wrong else ""))

    def close(self) -> None:
        if self._quota:
            self.sandbox.unmount_quota(self.workspace)
            self._quota = False
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
