"""How a bwrap run starts (envs/launch.py): through the exec shim (`prlimit`, a cgroup join, `setpriv`: a plain vfork and
exec of this process) or, where those tools are missing, a forked child's `preexec`. Both must give the run the same
user, hard limits, session and cgroup; the shim must not fork this process."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from envs import sandbox as sbmod
from envs.sandbox import Limits

LIM = Limits(cpu_seconds=7, memory_bytes=700 << 20, file_size_bytes=3 << 20, max_processes=40)
SHOW = ("import os, resource\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
        "print([resource.getrlimit(getattr(resource, n)) for n in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', "
        "'RLIMIT_CORE')])")


@pytest.fixture(params=["shim", "forked"])
def started(request, sandbox, monkeypatch):
    if request.param == "forked":
        monkeypatch.setattr(sbmod, "exec_shim", lambda *a: None)
    return request.param


def test_the_run_has_the_sandbox_user_its_hard_limits_and_nothing_else(sandbox, tmp_path, started):
    r = sandbox.run([sandbox.python(), "-c", SHOW], tmp_path, limits=LIM)
    assert r.returncode == 0, r.stderr
    ids, limits = r.stdout.splitlines()
    if os.geteuid() == 0:
        assert ids == "65534 65534 []"
    assert eval(limits) == [(7, 7), (700 << 20, 700 << 20), (3 << 20, 3 << 20), (0, 0)]  # noqa: S307 - our print


def test_the_run_leads_its_own_session_in_its_own_cgroup(sandbox, tmp_path, started):
    proc, cg = sandbox.spawn(["sleep", "30"], tmp_path, LIM)
    try:
        assert os.getsid(proc.pid) == proc.pid != os.getsid(0)
        if cg is not None and cg.active:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the shim's shell joins, then becomes bwrap
                if all(str(proc.pid) in (p / "cgroup.procs").read_text().split() for p in cg.paths):
                    break
                time.sleep(0.01)
            for p in cg.paths:
                assert str(proc.pid) in (p / "cgroup.procs").read_text().split()
            assert (cg.paths[0] / "pids.max").read_text().strip() == "40"
        deadline = time.monotonic() + 10
        while b"bwrap" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] and time.monotonic() < deadline:
            time.sleep(0.01)  # the shim's tools exec one after the other; bwrap is the last
        status = Path(f"/proc/{proc.pid}/status").read_text()
        uid = status.split("Uid:")[1].split("\n")[0].split()
        if os.geteuid() == 0:  # real, effective, saved and filesystem uid all dropped: nothing to setuid(0) back to
            assert uid == ["65534"] * 4
    finally:
        if cg is not None:
            cg.close()
        sbmod.kill_group(proc)
        proc.wait()


def test_the_shim_starts_the_run_without_forking_this_process(sandbox, tmp_path, monkeypatch):
    """No preexec_fn (Python then forks, copying this process's page tables: ~8 ms of its CPU with a model loaded),
    so subprocess takes vfork; the shim's tools exec in front of bwrap."""
    seen = []
    real = subprocess.Popen

    def spy(cmd, **kw):
        seen.append((cmd, kw))
        return real(cmd, **kw)

    monkeypatch.setattr(subprocess, "Popen", spy)
    r = sandbox.run(["true"], tmp_path, limits=LIM)
    assert r.returncode == 0, r.stderr
    (cmd, kw), = seen
    assert kw.get("preexec_fn") is None and kw["start_new_session"] is True
    assert os.path.basename(cmd[0]) == "prlimit" and "--cpu=7:7" in cmd and any("bwrap" in c for c in cmd)


def test_a_run_that_cannot_join_its_cgroup_never_starts_and_is_the_hosts_fault(sandbox, tmp_path, monkeypatch):
    """The shim reports a failed join on a pipe the agent's code never holds: an exception (a host fault), not an exit
    code the agent's code could also give. The run does not go on outside its cgroup."""
    from envs.cgroup import Cgroup

    if not sandbox.uses_cgroup():
        pytest.skip("no per-run cgroups here (not root)")
    real = Cgroup.__init__

    def broken(self, lim):
        real(self, lim)
        self.paths.append(tmp_path / "no-such-cgroup")

    monkeypatch.setattr(Cgroup, "__init__", broken)
    marker = tmp_path / "ran"
    tmp_path.chmod(0o777)
    with pytest.raises(sbmod.SandboxStartError, match="could not join"):
        sandbox.run(["sh", "-c", "touch ran"], tmp_path, limits=LIM)
    assert not marker.exists()
