"""The tool session (one sandboxed runner per episode) against its slow twin, a one-shot sandboxed run of
tools/runner.py per call: the same observations, exit codes, truncation and ownership, the same limits."""

import json
import os
import shutil

import pytest

from envs import FAMILIES, Environment
from envs.environment import run_script
from envs.sandbox import Limits
from envs.tool_session import ToolSession

# requests in order, each acting on the workspace the ones before it left (writes, replaces, errors of every kind)
REQUESTS = [
    ("ls", {}), ("read", {"path": "notes.txt"}), ("read", {"path": "missing.txt"}), ("read", {"path": "../x"}),
    ("write", {"path": "d/e/new.txt", "content": "naïve 漢字 line\n"}), ("read", {"path": "d/e/new.txt"}),
    ("replace", {"path": "notes.txt", "old": "b", "new": "B"}), ("replace", {"path": "notes.txt", "old": "a",
                                                                           "new": "z"}),
    ("replace", {"path": "notes.txt", "old": "zzz", "new": "q"}), ("read", {"path": "notes.txt"}),
    ("calc", {"expr": "(3 + 4) * 6 // 5"}), ("calc", {"expr": "1/0"}), ("calc", {"expr": "2 ** 999"}),
    ("calc", {"expr": "__import__('os')"}), ("calc", {"expr": "7 / 2"}), ("ls", {"path": "d"}),
    ("ls", {"path": "notes.txt"}), ("read", {"path": "big.txt"}), ("read", {}),  # the last raises KeyError
]


def _workspace(root, name):
    ws = root / name
    ws.mkdir()
    ws.chmod(0o777)
    (ws / "notes.txt").write_text("a a b\n")
    (ws / "big.txt").write_text("x" * 20_000)
    for f in ws.iterdir():
        f.chmod(0o666)
    return ws


def _one_shot(sb, ws, tool, args, limits):
    return sb.run([sb.python(), "-I", "-S", f"{sb.tools_dir()}/runner.py"], ws,
                  stdin=json.dumps({"tool": tool, "args": args}), limits=limits)


@pytest.mark.parametrize("cap", [64 << 10, 100])
def test_session_answers_as_one_shot_runs(sandbox, tmp_path, cap):
    lim = Limits(output_bytes=cap)
    a, b = _workspace(tmp_path, "a"), _workspace(tmp_path, "b")
    s = ToolSession(sandbox, b, lim)
    try:
        for tool, args in REQUESTS:
            want, got = _one_shot(sandbox, a, tool, args, lim), s.call(tool, args)
            assert (got.returncode, got.stdout) == (want.returncode, want.stdout), tool
            if want.returncode != 1:  # (a traceback's frames differ: one-shot's main, the session's serve)
                assert got.truncated == want.truncated, tool
            if want.returncode == 1 and cap > 1000:  # the tool raised: the same error's last line
                assert got.stderr.strip().splitlines()[-1] == want.stderr.strip().splitlines()[-1] == "KeyError: 'path'"
    finally:
        s.close()
    assert s.started == 1  # one runner answered every request
    for rel in ("notes.txt", "d/e/new.txt"):  # the same files, owned by the same (sandbox) user
        assert (a / rel).read_bytes() == (b / rel).read_bytes()
        assert os.stat(a / rel).st_uid == os.stat(b / rel).st_uid
    if os.geteuid() == 0:
        assert os.stat(b / "d/e/new.txt").st_uid != 0


def test_a_hung_call_times_out_and_the_next_call_starts_a_new_runner(sandbox, tmp_path):
    ws = _workspace(tmp_path, "w")
    os.mkfifo(ws / "pipe.txt")  # opening it to write blocks forever: no reader
    (ws / "pipe.txt").chmod(0o666)
    lim = Limits(wall_seconds=1.0)
    assert _one_shot(sandbox, ws, "write", {"path": "pipe.txt"}, lim).timed_out  # the twin times out too
    s = ToolSession(sandbox, ws, lim)
    try:
        r = s.call("write", {"path": "pipe.txt"})
        assert r.timed_out and not r.ok and r.stdout == ""
        r = s.call("read", {"path": "notes.txt"})
        assert (r.returncode, r.stdout) == (0, "a a b\n")
        assert s.started == 2
    finally:
        s.close()


def test_a_runner_that_died_is_replaced_before_the_next_request(sandbox, tmp_path):
    ws = _workspace(tmp_path, "w")
    s = ToolSession(sandbox, ws, Limits())
    try:
        assert s.call("ls", {}).ok
        os.killpg(s._proc.pid, 9)
        s._proc.wait()
        r = s.call("calc", {"expr": "6*7"})
        assert (r.returncode, r.stdout, s.started) == (0, "42", 2)
    finally:
        s.close()


@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if FAMILIES[f].tiny))
def test_an_episode_reads_the_same_with_and_without_sessions(sandbox, family, monkeypatch):
    """The oracle's episode of each tiny family: the same observations, reward and final workspace either way; the
    session's runner is gone once the environment closes."""
    spec = FAMILIES[family].make(3)
    with_session = run_script(spec, sandbox, spec.reference)
    with Environment(spec, sandbox) as env:
        env.reset()
        for a in spec.reference[:1]:
            env.step(a)
        proc = env._session._proc if env._session is not None else None
    assert (proc is not None) == sandbox.supports_sessions  # (as root with per-run cgroups: CI's and make test's)
    assert proc is None or proc.poll() is not None  # closed with the environment
    monkeypatch.setattr(sandbox, "supports_sessions", False)
    one_shot = run_script(spec, sandbox, spec.reference)
    assert with_session[0].reward == one_shot[0].reward == 1.0
    assert with_session[2] == one_shot[2]


def test_closing_kills_the_runner_and_removes_nothing_else(sandbox, tmp_path):
    ws = _workspace(tmp_path, "w")
    s = ToolSession(sandbox, ws, Limits())
    assert s.call("write", {"path": "kept.txt", "content": "k"}).ok
    proc = s._proc
    s.close()
    assert proc.poll() is not None and s._proc is None
    assert (ws / "kept.txt").read_text() == "k"
    s.close()  # twice is harmless
    shutil.rmtree(ws)


def test_sessions_only_where_each_run_has_its_own_cgroup(sandbox):
    """A session keeps its processes for the episode: only with a per-run pids controller, never against the
    RLIMIT_NPROC every run of the sandbox's uid shares; and a backend that isolates in its own `run` keeps none
    unless it says so."""
    from envs.cgroup import Cgroup
    from envs.sandbox import Sandbox

    probe = Cgroup(Limits())
    try:
        assert sandbox.supports_sessions == (os.geteuid() == 0 and probe.active)
    finally:
        probe.close()

    class OwnRun(Sandbox):
        def wrap(self, argv, workspace, extra_ro, limits=None):
            return argv

    assert OwnRun().supports_sessions is False


def test_a_session_that_cannot_start_is_the_hosts_fault_not_the_agents(sandbox, monkeypatch):
    """A runner the sandbox could not start is an infrastructure fault (`SandboxFault`: the episode is crashed), never
    an observation charged to the agent; a usage error the runner answers is the agent's (an observation)."""
    from envs.environment import SandboxFault
    from envs.sandbox import RunResult

    spec = FAMILIES["kv-lookup"].make(1)
    with Environment(spec, sandbox) as env:
        env.reset()
        monkeypatch.setattr(sandbox, "supports_sessions", True)
        assert "outside the workspace" in env.step("<tool_call>read ../../etc/hostname</tool_call>").observation
        env._end_session()
        monkeypatch.setattr(type(sandbox), "spawn", lambda *a, **k: RunResult(127, "", "sandbox failed to start: x"))
        with pytest.raises(SandboxFault):
            env.step("<tool_call>ls</tool_call>")
