"""Containment of the sandboxes (bubblewrap and Docker, the same suite): every limit the issue names, tested by
trying to break it."""

import os
import socket
import threading
import time

import pytest

from envs import sandbox as sbmod
from envs.sandbox import Limits, SandboxUnavailable, make_sandbox


@pytest.fixture(scope="module")
def sandbox(each_sandbox):  # bwrap, then Docker (tests/envs/conftest.py)
    return each_sandbox


# files the engine itself puts in every container's /etc (no host secrets: the container's own names)
DOCKER_ETC = {"hostname", "hosts", "resolv.conf", "mtab"}


def py(sb, code, ws, **kw):
    return sb.run([sb.python(), "-c", code], ws, **kw)


def test_workspace_is_read_write_and_root_is_read_only(sandbox, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    ws.chmod(0o777)
    outside = tmp_path / "outside.txt"
    outside.write_text("original")
    code = (
        "import os\n"
        "open('inside.txt', 'w').write('ok')\n"
        f"for p in ['/etc/temper_probe', '/usr/temper_probe', {str(outside)!r}, '/work/../escape.txt']:\n"
        "    try:\n"
        "        open(p, 'w').write('pwned'); print('WROTE', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
    )
    r = py(sandbox, code, ws)
    assert r.returncode == 0, r.stderr
    assert (ws / "inside.txt").read_text() == "ok"
    assert outside.read_text() == "original"
    assert not os.path.exists("/etc/temper_probe") and not os.path.exists("/usr/temper_probe")
    # /tmp inside is a private tmpfs: the host's tmp_path is not even visible
    assert f"WROTE {outside}" not in r.stdout and "WROTE /etc" not in r.stdout


def test_network_is_refused(sandbox, tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    hits = []
    threading.Thread(target=lambda: hits.append(srv.accept()), daemon=True).start()
    try:
        code = ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\n"
                "except OSError as e:\n    print('refused', type(e).__name__)")
        r = py(sandbox, code, tmp_path)
        assert "refused" in r.stdout and "CONNECTED" not in r.stdout
        # the same connection works from the host: the sandbox, not the test, is what refuses
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        time.sleep(0.1)
        assert len(hits) == 1
    finally:
        srv.close()


def test_fork_bomb_is_contained(sandbox, tmp_path):
    lim = Limits(max_processes=32, wall_seconds=3, cpu_seconds=3)
    code = ("import os, time\nn = 0\nfor _ in range(5000):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n        n += 1\n    except OSError:\n        break\nprint('forked', n)")
    t = time.perf_counter()
    r = py(sandbox, code, tmp_path, limits=lim)
    assert time.perf_counter() - t < 10
    if sandbox.info()["process_limit_enforced"]:
        n = int(r.stdout.split()[-1])
        assert n < 32
    # the machine is fine afterwards
    assert py(sandbox, "print('alive')", tmp_path).stdout.strip() == "alive"


def test_memory_cap(sandbox, tmp_path):
    r = py(sandbox, "x = bytearray(2 << 30)\nprint('ALLOCATED')", tmp_path, limits=Limits(memory_bytes=512 << 20))
    assert "ALLOCATED" not in r.stdout and r.returncode != 0
    assert "MemoryError" in r.stderr or r.returncode < 0


def test_wall_clock_timeout_kills_the_process_tree(sandbox, tmp_path):
    t = time.perf_counter()
    r = py(sandbox, "import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)", tmp_path,
           limits=Limits(wall_seconds=1.0))
    assert r.timed_out and time.perf_counter() - t < 5


def test_cpu_time_limit(sandbox, tmp_path):
    r = py(sandbox, "while True:\n    pass", tmp_path, limits=Limits(cpu_seconds=1, wall_seconds=10))
    assert not r.timed_out and r.returncode != 0  # SIGXCPU / SIGKILL from RLIMIT_CPU, before the wall clock


def test_output_is_capped(sandbox, tmp_path):
    r = py(sandbox, "import sys\nfor _ in range(300):\n    sys.stdout.write('A' * 65536)", tmp_path,
           limits=Limits(output_bytes=10_000))
    assert r.truncated and len(r.stdout) == 10_000 and r.returncode == 0


def test_file_size_limit(sandbox, tmp_path):
    tmp_path.chmod(0o777)
    r = py(sandbox, "f = open('big', 'wb')\nf.write(b'x' * (4 << 20))\nprint('WROTE')", tmp_path,
           limits=Limits(file_size_bytes=1 << 20))
    assert "WROTE" not in r.stdout
    assert not (tmp_path / "big").exists() or (tmp_path / "big").stat().st_size <= 1 << 20


def test_own_pid_namespace(sandbox, tmp_path):
    r = py(sandbox, "import os\nprint(os.getpid(), len([p for p in os.listdir('/proc') if p.isdigit()]))", tmp_path)
    pid, nprocs = map(int, r.stdout.split())
    assert pid < 10 and nprocs < 5


def test_unsafe_backend_needs_explicit_opt_in(monkeypatch):
    monkeypatch.delenv(sbmod.UNSAFE_ENV, raising=False)
    with pytest.raises(SandboxUnavailable, match="opt in explicitly"):
        make_sandbox("unsafe-subprocess")
    assert make_sandbox("unsafe-subprocess", allow_unsafe=True).name == "unsafe-subprocess"
    monkeypatch.setenv(sbmod.UNSAFE_ENV, "1")
    assert make_sandbox("unsafe-subprocess").name == "unsafe-subprocess"


def test_no_sandbox_available_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sbmod.shutil, "which", lambda name: None)
    import sys
    import types

    fake = types.ModuleType("docker")

    def from_env():
        raise ConnectionError("no engine")

    fake.from_env = from_env
    monkeypatch.setitem(sys.modules, "docker", fake)
    with pytest.raises(SandboxUnavailable) as e:
        make_sandbox("auto")
    msg = str(e.value)
    assert "apt-get install bubblewrap" in msg and "Docker" in msg and sbmod.UNSAFE_ENV in msg
    with pytest.raises(ValueError, match="sandbox kind"):
        make_sandbox("chroot")


# ---- the boundary: one test per claimed limit, each an honest attempt to break it --------------------------
def test_never_host_root_inside(sandbox, tmp_path):
    """Files the sandbox writes belong to an unprivileged host user, and the process inside is not uid 0."""
    tmp_path.chmod(0o777)
    r = py(sandbox, "import os\nopen('mine', 'w').write('x')\nprint(os.getuid(), os.geteuid())", tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["65534", "65534"]
    owner = (tmp_path / "mine").stat().st_uid
    assert owner != 0 and (os.geteuid() != 0 or owner == sandbox.info()["host_uid"] == 65534)


def test_only_the_needed_etc_files_are_visible(sandbox, tmp_path):
    r = py(sandbox, "import os\nprint(sorted(os.listdir('/etc')))\n"
                    "for p in ['/etc/shadow', '/etc/passwd', '/etc/gshadow', '/root']:\n"
                    "    try:\n        open(p).read(); print('READ', p)\n"
                    "    except OSError as e:\n        print('denied', p, type(e).__name__)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "READ" not in r.stdout
    listed = eval(r.stdout.splitlines()[0])  # noqa: S307 - our own print of a list of names
    allowed = set(sbmod.ETC_FILES) | (DOCKER_ETC if sandbox.name == "docker" else set())
    assert "shadow" not in listed and "passwd" not in listed and set(listed) <= allowed


def test_no_user_namespaces_inside(sandbox, tmp_path):
    """A user namespace once let code inside mount its own cgroup and lift its limits: creating one is refused."""
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "for name, flag in [('user', 0x10000000), ('mount', 0x00020000), ('user+mount', 0x10020000)]:\n"
            "    rc = libc.unshare(flag)\n"
            "    print(name, rc, os.strerror(ctypes.get_errno()) if rc else 'CREATED')")
    r = py(sandbox, code, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "CREATED" not in r.stdout and len(r.stdout.splitlines()) == 3


def test_limits_cannot_be_lifted_from_inside(sandbox, tmp_path):
    code = ("import resource\n"
            "for name in ['RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE']:\n"
            "    res = getattr(resource, name)\n    soft, hard = resource.getrlimit(res)\n"
            "    try:\n        resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)); print('LIFTED', name)\n"
            "    except (ValueError, OSError) as e:\n        print('kept', name, hard)\n"
            "import os\nprint('cgroupfs', os.path.exists('/sys/fs/cgroup'))\n"
            "for f in ['pids.max', 'memory.max', 'cpu.max']:\n    try:\n"
            "        open('/sys/fs/cgroup/' + f, 'w').write('max'); print('RAISED', f)\n"
            "    except OSError as e:\n        print('cg-held', f)\n"
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nos.makedirs('/tmp/cg', exist_ok=True)\n"
            "print('mount', libc.mount(b'none', b'/tmp/cg', b'cgroup2', 0, None))")
    r = py(sandbox, code, tmp_path, limits=Limits(memory_bytes=512 << 20))
    assert r.returncode == 0, r.stderr
    assert "LIFTED" not in r.stdout and r.stdout.count("kept") == 3
    assert "mount -1" in r.stdout and "RAISED" not in r.stdout
    # bwrap shows no cgroupfs at all; Docker's is its own cgroup namespace, read-only to the process
    assert "cgroupfs False" in r.stdout or (sandbox.name == "docker" and r.stdout.count("cg-held") == 3)


def test_cpu_quota_holds_with_many_busy_processes(sandbox, tmp_path):
    """Four processes spin for 1.5 s of wall time under a quota of half a core: together they get at most
    about half of that in CPU time. (A busier machine only lowers it: the bound cannot fail by load.)"""
    assert sandbox.info()["cpu_quota"], "the cgroup cpu controller is not writable: no CPU quota here"
    code = ("import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
            "        t = time.monotonic()\n        while time.monotonic() - t < 1.5:\n            pass\n        os._exit(0)\n"
            "    kids.append(pid)\nt0 = time.monotonic()\nfor p in kids:\n    os.waitpid(p, 0)\n"
            "wall = time.monotonic() - t0\nt = os.times()\nprint(t.children_user + t.children_system, wall)")
    r = py(sandbox, code, tmp_path, limits=Limits(cpu_quota=0.5, wall_seconds=30, cpu_seconds=30))
    assert r.returncode == 0, r.stderr
    cpu, wall = map(float, r.stdout.split())
    assert cpu <= 0.5 * wall + 0.25, (cpu, wall)


def test_private_tmp_has_a_size(sandbox, tmp_path):
    r = py(sandbox, "n = 0\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        for _ in range(64):\n"
                    "            f.write(b'x' * (1 << 20)); f.flush(); n += 1\nexcept OSError as e:\n"
                    "    print('full', type(e).__name__)\nprint(n)", tmp_path,
           limits=Limits(tmp_bytes=8 << 20, file_size_bytes=1 << 30))
    assert r.returncode == 0, r.stderr
    assert "full" in r.stdout and int(r.stdout.split()[-1]) <= 8


def test_workspace_disk_quota(sandbox):
    """The agent's workspace is a filesystem of `workspace_bytes`: writing past it fails inside, and the host
    holds no more than that (256 MiB were once written in 0.2 s)."""
    from envs import FAMILIES
    from envs.environment import Environment

    assert sandbox.info()["workspace_quota"], "mounting a sized tmpfs was refused: no workspace quota here"
    spec = FAMILIES["fix-bug"].make(1)
    lim = Limits(workspace_bytes=8 << 20, file_size_bytes=1 << 30)
    with Environment(spec, sandbox, lim) as env:
        env.reset()
        code = ("n = 0\ntry:\n    for i in range(8):\n        with open(f'f{i}', 'wb') as f:\n"
                "            for _ in range(8):\n                f.write(b'x' * (1 << 20)); f.flush(); n += 1\n"
                "except OSError as e:\n    print('full', type(e).__name__)\nprint('MiB', n)")
        from envs import Action
        obs = env.step(Action("python", {"code": code}).render()).observation
        used = sum(p.stat().st_size for p in env.workspace.rglob("*") if p.is_file())
        assert "full OSError" in obs and used <= 8 << 20, obs
        env.reset()  # a new episode starts empty, on the same quota
        assert sorted(p.name for p in env.workspace.iterdir()) == sorted({f.split("/")[0] for f in spec.files})
    assert not env.workspace.exists()
