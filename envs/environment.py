"""One episode of a task: a private workspace, tool calls run in the sandbox, and the verifier.

    env = Environment(spec, sandbox)
    obs = env.reset()                      # the instruction
    step = env.step(assistant_text)        # parse → run the tool in the sandbox → observation
    reward = env.verify()                  # deterministic; see `verify` for failures and infrastructure faults
    env.close()

Malformed actions, unknown tools and tool errors come back as observations; nothing the agent writes
raises through `step`.

One rule decides outcomes: whatever goes wrong while handling what the agent produced (its actions, its files, its
output, what the verifier observes) is the agent's failure (reward 0, status "ok", the reason recorded). Only a
verifier sandbox that could not start the check (no `ready` line before any agent code ran), or a host fault before
it ran, is an infrastructure fault: retried, then "crashed". It holds by construction, not by a list of caught
exceptions: the host never walks a tree the agent made (the verifier's copy is made inside the sandbox; trees are
removed with `rm`, mounts by unmounting), every parse of agent output is bounded in size and depth
(envs/bounded.py), and arguments are validated before anything is run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .actions import Action, ActionError, parse_action
from .bounded import BoundsError, loads
from .sandbox import Limits, RunResult, Sandbox
from .spec import Check, TaskSpec
from .tool_session import ToolSession
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
    """The workspace could not be set up from the spec (a path the set-up refused)."""


class SandboxFault(RuntimeError):
    """The sandbox raised instead of running a tool call (it could not start): an infrastructure fault."""


class _Infrastructure(Exception):
    """A fault of the verifier's own machinery, before any agent code ran: retried, then "crashed"."""


VERDICT_DEPTH = 96  # a type-tagged value nests at most 32 levels (tools/check.py), two JSON levels each, plus wrappers


def _pinned_sha(root: Path, rel: str) -> str | None:
    """sha256 of the regular file `rel` under `root`, opened one component at a time without following a link at
    any level (a linked directory on the way is as much a replacement as a linked file); None for a link, a special
    file, a missing file or a bad path."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        return None
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for d in parts[:-1]:
            nxt = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        os.close(fd)
        return None
    os.close(fd)
    with os.fdopen(f, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None
        h = hashlib.sha256()
        while chunk := fh.read(1 << 20):
            h.update(chunk)
        return h.hexdigest()


def printable(s: str) -> str:
    """`s` with what cannot be encoded, stored or shown (lone surrogates from undecodable file names, NUL bytes,
    control characters) escaped: a verdict's detail quotes what the agent made."""
    s = s.encode("utf-8", "backslashreplace").decode("utf-8")
    return "".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in s)


def remove_tree(path: Path, *empty: Path) -> None:
    """Remove a tree an agent may have made (any depth, links not followed) without walking it in this process:
    coreutils `rm` walks it iteratively; a deep tree once made `shutil.rmtree` raise RecursionError. `empty`: the
    directories the tree should hold and nothing else (unmounted tmpfs mount points): removed with rmdir, and `rm`
    runs only if something else is there."""
    try:
        for d in empty:
            d.rmdir()
        path.rmdir()
        return
    except OSError:
        pass
    if os.path.lexists(path):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, check=False)


def _set_up(workspace: Path, files: dict[str, str], uid: int | None) -> str | None:
    """Write a spec's files into the fresh `workspace` (tools/setup.py: relative paths only, no link followed), as
    `uid` when temper is root: in a forked child that drops to it first (no interpreter to start: a fork costs about
    a millisecond where a `python` process took 20). None, or why it refused."""
    from .tools.setup import write_all

    if uid is None:  # not root: nothing to drop, and the writer's own checks hold
        return write_all(files, str(workspace))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls and the writer, then _exit (nothing of the parent's runs on)
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            why = write_all(files, str(workspace))
            if why:
                os.write(w, why.encode("utf-8", "backslashreplace")[:2000])
            else:
                code = 0
        except BaseException as e:  # noqa: BLE001 - reported to the parent, whatever it was
            os.write(w, f"{type(e).__name__}: {e}".encode("utf-8", "backslashreplace")[:2000])
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else (said or f"the set-up exited {status}")


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
        # (the family names the directory: only characters every backend takes in a path, Docker's binds included)
        self._tmp = Path(tempfile.mkdtemp(prefix=f"temper-{re.sub(r'[^A-Za-z0-9._-]', '-', spec.family)}-",
                                          dir=workdir))
        self._tmp.chmod(0o711)  # the sandbox runs as an unprivileged user: it may pass through, not list
        self.workspace = self._tmp / "work"
        self._quota = False  # whether the workspace is a size-limited mount (Sandbox.mount_quota)
        self.turns = 0
        self.answer: str | None = None
        self.done = False
        self.log: list[Action] = []
        self._session: ToolSession | None = None  # the built-in tools' sandboxed runner, started at the first call

    # ---- episode -----------------------------------------------------------------------------------
    def reset(self) -> str:
        """A fresh workspace holding the spec's files. The files are written by tools/setup.py as the sandbox's
        unprivileged user (never root), which refuses any path that is not plainly inside the workspace and never
        opens through a link."""
        self._end_session()  # it holds the old workspace's mount
        if self._quota:  # the workspace is its own size-limited filesystem: a fresh one, not an emptied one
            self.sandbox.unmount_quota(self.workspace)
            self._quota = False
        if os.path.lexists(self.workspace):
            remove_tree(self.workspace)
        self.workspace.mkdir(parents=True)
        self._quota = self.sandbox.mount_quota(self.workspace, self.limits.workspace_bytes)
        self.workspace.chmod(0o777)
        why = _set_up(self.workspace, self.spec.files, self.sandbox.run_as())
        if why:
            raise WorkspaceError(f"{self.spec.id}: the workspace could not be set up: {why[-300:]}")
        self.turns, self.answer, self.done, self.log = 0, None, False, []
        return self.spec.instruction

    def step(self, text: str) -> StepResult:
        """One tool call. Whatever goes wrong handling the agent's text is its error (an observation); a sandbox that
        raises instead of running the tool is the infrastructure's (`SandboxFault`, the episode `crashed`): a result
        the sandbox returns, whatever its exit code or text, is the agent's doing (it could print anything)."""
        t0 = time.perf_counter()
        try:
            return self._step(text)
        except SandboxFault:
            raise
        except Exception as e:  # noqa: BLE001 - the agent's text is handled here: what goes wrong is its failure
            self._out_of_turns()
            why = f"the tool call could not be run ({type(e).__name__}: {str(e)[:200]})"
            return StepResult(f"error: {why}", self.done, error=why, seconds=time.perf_counter() - t0)

    def _step(self, text: str) -> StepResult:
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
            res = self._builtin(act)
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
        return self._format(self._sandboxed(argv))

    def _builtin(self, act: Action) -> RunResult:
        """A built-in tool through the episode's tool session (one sandboxed runner kept for the episode), or a
        one-shot sandboxed runner where the backend keeps no session."""
        sb = self.sandbox
        if not sb.supports_sessions:
            return self._sandboxed([sb.python(), "-I", "-S", f"{sb.tools_dir()}/runner.py"],
                                   stdin=json.dumps({"tool": act.tool, "args": act.args}))
        if self._session is None:
            self._session = ToolSession(sb, self.workspace, self.limits)
        try:
            res = self._session.call(act.tool, act.args)
        except Exception as e:  # noqa: BLE001 - the session failed to run anything: not the agent's doing
            raise SandboxFault(f"the {sb.name} sandbox's tool session failed: {type(e).__name__}: {e}") from e
        if res.returncode == 127 and res.stderr.startswith("sandbox failed to start"):
            raise SandboxFault(f"the {sb.name} sandbox could not run a tool: {res.stderr[:300]}")
        return res

    def _end_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def _sandboxed(self, argv: list[str], stdin: str | None = None) -> RunResult:
        try:
            return self.sandbox.run(argv, self.workspace, stdin=stdin, limits=self.limits)
        except Exception as e:  # noqa: BLE001 - the sandbox failed to run anything: not the agent's doing
            raise SandboxFault(f"the {self.sandbox.name} sandbox could not run a tool: {type(e).__name__}: {e}") from e

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
        that raised, exited or hung, a missing, garbled, over-long or over-deep observation, a special file or a
        tree that cannot be copied. Only a fault of the verifier's own infrastructure (the sandbox did not start
        the check) is status "crashed": it is retried up to VERIFY_ATTEMPTS times, and `attempts` says how many
        were made."""
        for attempt in range(1, VERIFY_ATTEMPTS + 1):
            results = [self._check(check) for check in self.spec.verifier.checks]
            if not any(r.crashed for r in results):
                ok = bool(results) and all(r.passed for r in results)
                return Reward(1.0 if ok else 0.0, "ok", results, attempt)
        return Reward(0.0, "crashed", results, VERIFY_ATTEMPTS)

    def _check(self, c: Check) -> CheckResult:
        try:
            r = self._run_check(c)
        except _Infrastructure as e:
            r = CheckResult(c.name, False, str(e)[:500], crashed=True)
        except Exception as e:  # noqa: BLE001 - past the sandbox's start, what goes wrong is the agent's doing
            r = CheckResult(c.name, False, f"the agent's work could not be checked: {type(e).__name__}: "
                                           f"{str(e)[:300]}")
        r.detail = printable(r.detail)  # it quotes what the agent made: stored, logged and shown downstream
        return r

    def _run_check(self, c: Check) -> CheckResult:
        if c.kind == "answer":
            if self.answer is None:
                return CheckResult(c.name, False, "no answer submitted")
            got, want = _normalise(self.answer, c.normalize), _normalise(c.expected or "", c.normalize)
            return CheckResult(c.name, got == want, "match" if got == want else "wrong answer")
        if c.kind == "unchanged":
            bad = [rel for rel, h in c.hashes.items() if _pinned_sha(self.workspace, rel) != h]
            return CheckResult(c.name, not bad, f"modified, replaced or not a regular file: {bad}" if bad else "unchanged")
        # python / calls: run in the sandbox on a private copy of the final workspace, which the sandbox makes
        # itself (tools/check.py) in a directory as large as the workspace's quota
        sb = self.sandbox
        try:
            vdir = Path(tempfile.mkdtemp(prefix="verify-", dir=self._tmp))
            vdir.chmod(0o711)
            work = vdir / "work"
            work.mkdir()
            quota = sb.mount_quota(work, self.limits.workspace_bytes)
            work.chmod(0o777)
        except OSError as e:
            raise _Infrastructure(f"verifier did not start (its directory: {e})") from None
        try:
            nonce = secrets.token_hex(16)
            req = {"kind": c.kind, "nonce": nonce, "work": sb.workdir(work), "src": sb.visible("/src", self.workspace)}
            if c.kind == "python":
                req["code"] = c.code
            else:
                req["calls"] = c.calls  # the expected values stay here
            res = sb.run([sb.python(), "-I", f"{sb.tools_dir()}/check.py"], work, stdin=json.dumps(req) + "\n",
                         limits=self.limits, extra_ro={"/src": self.workspace})
            lines = [ln[len(nonce) + 1:] for ln in res.stdout.splitlines() if ln.startswith(nonce + " ")]
            if "ready" not in lines[:1]:  # the check never started: the sandbox failed, not the agent's code
                why = "timed out" if res.timed_out else f"exit {res.returncode}: {res.stderr.strip()[-200:]}"
                raise _Infrastructure(f"verifier did not start ({why})")
        finally:
            if quota:
                sb.unmount_quota(work)
            remove_tree(vdir, work)
        try:
            v = loads(lines[-1], max(self.limits.output_bytes, 1 << 16), VERDICT_DEPTH) if len(lines) > 1 else None
        except BoundsError as e:
            return CheckResult(c.name, False, f"garbled observation ({e})")
        if not isinstance(v, dict):  # the code under test killed or garbled the check: a failure
            why = "timed out" if res.timed_out else f"exit {res.returncode}"
            return CheckResult(c.name, False, f"no observation ({why})")
        if "refused" in v:
            return CheckResult(c.name, False, f"refused: {v['refused']}")
        if c.kind == "python":
            return CheckResult(c.name, v.get("pass") is True, str(v.get("detail", ""))[:500])
        return self._compare(c, v)

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
        self._end_session()
        if self._quota:
            self.sandbox.unmount_quota(self.workspace)
            self._quota = False
            remove_tree(self._tmp, self.workspace)  # (the workspace was its own tmpfs: gone with the unmount)
        else:
            remove_tree(self._tmp)

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
