"""Sandboxes for untrusted code: agent tool calls and generated verifiers.

`Sandbox.run(argv, workspace)` runs one command with the workspace mounted read-write at /work and
returns a `RunResult` (exit code, truncated stdout/stderr, timed_out, wall seconds). Backends:

* `bwrap` (default): bubblewrap, run as an unprivileged host user when temper is root (never host uid 0
  inside), with a read-only root built from /usr, a few /etc files and the Python prefix, a sized private
  /tmp, no network (own net namespace, loopback down), own PID/IPC/UTS/user namespaces and no user
  namespaces inside (`--disable-userns`), `--die-with-parent`; hard rlimits on CPU seconds, address space and
  file size; a per-run cgroup with `pids.max`, a memory limit and a CPU quota when the controllers are
  writable; a wall-clock timeout that kills the whole process group; stdout/stderr capped.
* `docker`: the python `docker` SDK, network disabled, memory / pids / CPU limits, when an engine
  answers.
* `unsafe-subprocess`: a plain subprocess with the same rlimits and timeout but NO isolation. Only
  with an explicit opt-in (`allow_unsafe=True` or TEMPER_UNSAFE_NO_SANDBOX=1); it logs a warning.

`make_sandbox("auto")` picks bwrap, else docker, else raises `SandboxUnavailable` explaining how to get
one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from .cgroup import Cgroup
from .launch import exec_shim, preexec

log = logging.getLogger(__name__)

TOOLS_DIR = Path(__file__).parent / "tools"
SANDBOX_TOOLS = "/opt/temper/tools"  # where envs/tools is mounted inside the sandbox
SANDBOX_SITE = "/opt/temper/site"  # the host's site-packages (pytest), read-only
UNSAFE_ENV = "TEMPER_UNSAFE_NO_SANDBOX"


class SandboxUnavailable(RuntimeError):
    pass


class SandboxStartError(RuntimeError):
    """The sandbox could not set a run up as its limits require (a host fault: the run did not start)."""


@dataclass
class Limits:
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    file_size_bytes: int = 16 << 20
    wall_seconds: float = 20.0
    output_bytes: int = 64 << 10
    cpu_quota: float = 1.0  # cores (cgroup cpu controller); CPU seconds alone let a run take every core
    tmp_bytes: int = 64 << 20  # the sandbox's private /tmp (a sized tmpfs)
    workspace_bytes: int = 64 << 20  # an environment's workspace, all files together (a sized tmpfs, as root)


QUOTA_INODES = 16_384  # files and directories in a workspace (and in the verifier's copy of it)
SANDBOX_UID = 65534  # the unprivileged host user (nobody) that bwrap runs as when temper runs as root
# /etc entries the interpreter and the tools need (all of /etc once exposed /etc/shadow)
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "mime.types")


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _drain(pipe, cap: int, out: list, flags: dict) -> None:
    """Read a pipe to EOF keeping at most `cap` bytes (the rest is discarded, not buffered)."""
    kept = bytearray()
    while True:
        chunk = pipe.read(65536)
        if not chunk:
            break
        room = cap - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > max(room, 0):
            flags["truncated"] = True
    out.append(bytes(kept))


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (it was started in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _refuse(argv: list[str], stdin) -> str | None:
    """Why `argv` / `stdin` cannot be handed to a process (a NUL byte, a lone surrogate), checked before exec so
    that no argument an agent chose makes `run` raise; None when they can."""
    from .bounded import BoundsError, check_text

    try:
        for i, a in enumerate(argv):
            check_text(a, f"argument {i}")
        if isinstance(stdin, str):
            check_text(stdin.replace("\x00", ""), "stdin")  # NUL bytes are data on stdin
    except BoundsError as e:
        return f"refused before exec: {e}"
    return None


# what of the host's site-packages the sandbox sees: pytest (the `pytest` tool) and what it imports, nothing else
SITE_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py.py")
_stage: tuple[Path, Path] | None = None
_stage_lock = threading.Lock()


def staged() -> tuple[Path, Path]:
    """The host directories bound at SANDBOX_TOOLS and SANDBOX_SITE. As root: copies of envs/tools and of
    SITE_PACKAGES on a read-only tmpfs of their own, made once per process, so that nothing inside the sandbox names
    a host path (a bind mount's source shows in /proc/self/mountinfo as its path within its filesystem: here
    /tools and /site, not a checkout's or a virtualenv's path) and the rest of the host's packages stay out of
    sight. Without root, or where mounting fails: the originals."""
    global _stage
    with _stage_lock:
        if _stage is None:
            _stage = _make_stage()
        return _stage


def _make_stage() -> tuple[Path, Path]:
    import atexit

    site = Path(sysconfig.get_paths()["purelib"])
    if os.geteuid() != 0:
        return TOOLS_DIR, site
    d = Path(tempfile.mkdtemp(prefix="temper-stage-"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755,nosuid,nodev", "tmpfs", str(d)],
                      capture_output=True, check=False).returncode != 0:
        d.rmdir()
        return TOOLS_DIR, site
    atexit.register(lambda: (subprocess.run(["umount", "-l", str(d)], capture_output=True, check=False),
                             shutil.rmtree(d, ignore_errors=True)))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(TOOLS_DIR, d / "tools", ignore=ignore)
    (d / "site").mkdir()
    for name in SITE_PACKAGES:
        src = site / name
        if src.is_dir():
            shutil.copytree(src, d / "site" / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, d / "site" / name)
    subprocess.run(["chmod", "-R", "a+rX", str(d)], capture_output=True, check=False)
    subprocess.run(["mount", "-o", "remount,ro", str(d)], capture_output=True, check=False)
    return d / "tools", d / "site"


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_libc = None


def _c():
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _libc_mount_tmpfs(path: Path, opts: str) -> int:
    """mount(2) a tmpfs (nosuid, nodev) on `path`: 0, or the errno."""
    import ctypes

    rc = _c().mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode())
    return 0 if rc == 0 else (ctypes.get_errno() or 1)


def _libc_umount(path: Path) -> int:
    """umount2(2) `path`, detached (lazy): 0, or the errno."""
    import ctypes

    rc = _c().umount2(os.fsencode(path), _MNT_DETACH)
    return 0 if rc == 0 else (ctypes.get_errno() or 1)


def _joined(proc: subprocess.Popen, cg: Cgroup, report: tuple[int, int]) -> None:
    """Wait for the shim's cgroup join (its shell closes the report pipe before it execs the run, or writes the cgroup
    it could not join): a run outside its cgroup does not go on, and the failure is the host's (an exception, as a
    forked `preexec` raising), never an exit code the agent's own code could also give."""
    os.close(report[1])
    try:
        failed = os.read(report[0], 4096)
    finally:
        os.close(report[0])
    if failed:
        proc.wait()
        cg.close()
        raise SandboxStartError(f"sandbox failed to start: could not join the run's cgroup {failed.decode().strip()}")


class Sandbox(ABC):
    name = "base"

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()

    # -- subclass hooks --
    @abstractmethod
    def wrap(self, argv: list[str], workspace: Path, extra_ro: dict[str, Path], limits: Limits | None = None) -> list[str]:
        """The host command line that runs `argv` inside this sandbox."""

    def python(self) -> str:
        return sys.executable

    def tools_dir(self) -> str:
        return str(TOOLS_DIR)

    def site_dir(self) -> str:
        return sysconfig.get_paths()["purelib"]

    def workdir(self, workspace: Path) -> str:
        return str(workspace)

    def visible(self, dest: str, src: Path) -> str:
        """Where an `extra_ro` mount {dest: src} is seen by the sandboxed process."""
        return dest

    # -- common --
    def info(self) -> dict:
        return {"backend": self.name}

    # whether an episode may keep a live runner (envs/tool_session.py) through `spawn`: a backend says so itself (one
    # that isolates in its own `run` would otherwise be bypassed)
    supports_sessions = False

    def run(
        self,
        argv: list[str],
        workspace: str | Path,
        stdin: bytes | str | None = None,
        limits: Limits | None = None,
        extra_ro: dict[str, Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> RunResult:
        lim = limits or self.limits
        bad = _refuse(argv, stdin)
        if bad:
            return RunResult(126, "", bad)
        t0 = time.perf_counter()
        started = self.spawn(argv, Path(workspace), lim, extra_ro, env)
        if isinstance(started, RunResult):
            started.seconds = time.perf_counter() - t0
            return started
        proc, cg = started
        out: list[bytes] = []
        err: list[bytes] = []
        flags: dict = {}
        threads = [threading.Thread(target=_drain, args=(proc.stdout, lim.output_bytes, out, flags), daemon=True),
                   threading.Thread(target=_drain, args=(proc.stderr, lim.output_bytes, err, flags), daemon=True)]
        for t in threads:
            t.start()
        if stdin is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                proc.stdin.write(stdin.encode() if isinstance(stdin, str) else stdin)
        with contextlib.suppress(OSError):
            proc.stdin.close()
        timed_out = False
        try:
            rc = proc.wait(timeout=lim.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            rc = proc.wait()
        finally:
            if cg is not None:
                cg.close()
        for t in threads:
            t.join(timeout=5)
        return RunResult(
            returncode=rc,
            stdout=(out[0] if out else b"").decode("utf-8", "replace"),
            stderr=(err[0] if err else b"").decode("utf-8", "replace"),
            timed_out=timed_out,
            truncated=bool(flags.get("truncated")),
            seconds=time.perf_counter() - t0,
        )

    def spawn(self, argv: list[str], workspace: Path, lim: Limits, extra_ro: dict[str, Path] | None = None,
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Cgroup | None] | RunResult:
        """Start `argv` in this sandbox with piped stdin / stdout / stderr, in its own session (process group), its
        limits set and, where the controllers are writable, its own cgroup (closed by the caller, which kills what
        is left in it). A RunResult (exit 127) says why nothing started."""
        cmd = self.wrap(argv, workspace, extra_ro or {}, lim)
        cg = Cgroup(lim) if self.uses_cgroup() else None
        drop = self.run_as()
        per_run_pids = cg is not None and cg.active
        if drop is not None and not all(os.stat(d).st_mode & 0o001 for d in (workspace, *workspace.parents)):
            if cg is not None:
                cg.close()
            return RunResult(127, "", f"sandbox failed to start: the workspace {workspace} is not reachable for "
                                      f"the sandbox user (uid {drop}): a directory on its path is not searchable")

        rl = [(resource.RLIMIT_CPU, lim.cpu_seconds), (resource.RLIMIT_AS, lim.memory_bytes),
              (resource.RLIMIT_FSIZE, lim.file_size_bytes), (resource.RLIMIT_CORE, 0)]
        if not (per_run_pids and drop is not None):  # with a shared sandbox uid, RLIMIT_NPROC would count
            rl.append((resource.RLIMIT_NPROC, lim.max_processes))  # every run's processes: the cgroup does it
        run_env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONHASHSEED": "0", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})}
        cmd, fds = self.hide_options(cmd)
        joins = cg is not None and cg.active
        report = os.pipe() if joins else (-1, -1)
        shim = exec_shim(rl, cg, drop, report[1])
        try:
            if shim is not None:  # vfork + exec: no copy of this (large) process's page tables per run
                proc = subprocess.Popen(shim + cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True, env=run_env, cwd=self.host_cwd(workspace),
                                        pass_fds=fds + (report[1],) if joins else fds)
                if joins:
                    _joined(proc, cg, report)
            else:
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        preexec_fn=functools.partial(preexec, rl, cg, drop), env=run_env,
                                        cwd=self.host_cwd(workspace), pass_fds=fds)
        except OSError as e:
            if cg is not None:
                cg.close()
            return RunResult(127, "", f"sandbox failed to start: {e}")
        finally:
            for fd in fds + (report if joins and shim is None else ()):
                os.close(fd)
        return proc, cg

    def uses_cgroup(self) -> bool:
        return False

    def hide_options(self, cmd: list[str]) -> tuple[list[str], tuple[int, ...]]:
        """The command line to exec, and the descriptors it needs: as it is here (see BwrapSandbox)."""
        return cmd, ()

    def run_as(self) -> int | None:
        """The host uid the sandbox process runs as (None: temper's own)."""
        return None

    def mount_quota(self, path: Path, size: int) -> bool:
        """Make the empty directory `path` a filesystem of at most `size` bytes (a workspace's disk quota).
        True when it did; the base sandbox cannot (see BwrapSandbox)."""
        return False

    def probe_quota(self) -> bool:
        """Whether a workspace quota can be mounted here: mount one of 1 MiB on a scratch directory and undo it."""
        d = Path(tempfile.mkdtemp(prefix="temper-quota-probe-"))
        try:
            ok = self.mount_quota(d, 1 << 20)
            if ok:
                self.unmount_quota(d)
            return ok
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def unmount_quota(self, path: Path) -> None:
        if _libc_umount(path) != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)

    def host_cwd(self, workspace: Path) -> str | None:
        return None


class _MountedLayout:
    """Where the tools, site-packages and workspace appear inside an isolated sandbox (bwrap, docker)."""

    def tools_dir(self) -> str:
        return SANDBOX_TOOLS

    def site_dir(self) -> str:
        return SANDBOX_SITE

    def workdir(self, workspace: Path) -> str:
        return "/work"


class BwrapSandbox(_MountedLayout, Sandbox):
    """bubblewrap, never as host root. When temper runs as root, bwrap itself runs as the unprivileged SANDBOX_UID
    (its user namespace maps the sandbox's uid to that host uid, not to 0); the process inside cannot create user
    namespaces (`--disable-userns`), so it cannot mount a cgroup of its own or lift its limits; only the /etc
    files the interpreter needs are bound; /tmp is a sized tmpfs; CPU, memory and process limits sit in a per-run
    cgroup outside its namespaces, owned by root."""

    name = "bwrap"

    def __init__(self, limits: Limits | None = None, bwrap: str | None = None, uid: int = SANDBOX_UID):
        super().__init__(limits)
        self.bwrap = bwrap or shutil.which("bwrap")
        if not self.bwrap:
            raise SandboxUnavailable("bubblewrap (bwrap) not found: apt-get install bubblewrap")
        self._root = os.geteuid() == 0
        self._no_mount = False
        self.uid = uid if self._root else None
        self.prefix = self._interpreter_prefix()

    def _interpreter_prefix(self) -> str:
        """A Python prefix the sandbox user can reach: this interpreter's, or else the system's of the same
        version (pyenv installs under /root, which only root may enter)."""
        if self.uid is None or _reachable(Path(sys.base_prefix) / "bin" / "python3"):
            return sys.base_prefix
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        if Path(f"/usr/bin/{ver}").exists():
            return "/usr"
        raise SandboxUnavailable(f"the interpreter under {sys.base_prefix} is not reachable for the sandbox user "
                                 f"(uid {self.uid}), and there is no /usr/bin/{ver}: apt-get install {ver}, or make "
                                 f"{sys.base_prefix} world-traversable")

    def python(self) -> str:
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        return f"/usr/bin/{ver}" if self.prefix == "/usr" else str(Path(self.prefix) / "bin" / "python3")

    def uses_cgroup(self) -> bool:
        return self._root  # RLIMIT_NPROC is per host uid (shared by every run): use the pids controller

    @functools.cached_property
    def supports_sessions(self) -> bool:
        """Only where each run gets its own cgroup: a session keeps its processes for the episode, and without a
        per-run pids controller they would count against the RLIMIT_NPROC every run of the uid shares."""
        if not self._root:
            return False
        probe = Cgroup(Limits())
        try:
            return probe.active
        finally:
            probe.close()

    def hide_options(self, cmd: list[str]) -> tuple[list[str], tuple[int, ...]]:
        """bwrap's options (host paths: the workspace, the staged tools) read from a pipe (`--args FD`) instead of
        its command line, which the sandboxed processes can read in /proc/1/cmdline. What follows `--` is the
        command inside, which names only sandbox paths. The options are a few hundred bytes: written before the
        exec, they fit the pipe's buffer."""
        cut = cmd.index("--")
        r, w = os.pipe()
        try:
            os.write(w, b"".join(a.encode() + b"\0" for a in cmd[1:cut]))
        finally:
            os.close(w)
        return [cmd[0], "--args", str(r), *cmd[cut:]], (r,)

    def run_as(self) -> int | None:
        return self.uid

    def mount_quota(self, path: Path, size: int) -> bool:
        """As root: a tmpfs of `size` bytes on `path`. Without root (or where mounting is refused) the workspace
        has only the per-file RLIMIT_FSIZE, and `info()["workspace_quota"]` says so."""
        if not self._root or self._no_mount:
            return False
        # inodes capped too: extended attributes and empty files take kernel memory outside `size`
        opts = f"size={int(size)},nr_inodes={QUOTA_INODES},mode=0777"
        err = _libc_mount_tmpfs(path, opts)  # a syscall, not a `mount` process: once per workspace and per check
        if err:
            self._no_mount = True
            log.warning("no workspace disk quota: mounting a tmpfs failed (%s)", os.strerror(err))
        return not err

    def info(self) -> dict:
        probe = Cgroup(Limits()) if self._root else None
        enforced = (not self._root) or bool(probe and probe.active)
        cpu = bool(probe and probe.cpu)
        if probe:
            probe.close()
        quota = self._root and self.probe_quota()
        return {"backend": self.name, "bwrap": self.bwrap, "process_limit_enforced": enforced, "cpu_quota": cpu,
                "workspace_quota": quota,
                "host_uid": self.uid if self.uid is not None else os.geteuid(), "python": self.python()}

    def wrap(self, argv, workspace, extra_ro, limits=None):
        a = [self.bwrap, "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path("/" + link).is_symlink():
                a += ["--symlink", os.readlink("/" + link), "/" + link]
            elif Path("/" + link).is_dir():
                a += ["--ro-bind", "/" + link, "/" + link]
        for f in ETC_FILES:
            if Path("/etc", f).exists():
                a += ["--ro-bind", f"/etc/{f}", f"/etc/{f}"]
        if self.prefix != "/usr":
            a += ["--ro-bind", self.prefix, self.prefix]
        tools, site = staged()
        a += ["--ro-bind", str(tools), SANDBOX_TOOLS, "--ro-bind", str(site), SANDBOX_SITE]
        for dest, src in extra_ro.items():
            a += ["--ro-bind", str(src), dest]
        a += ["--bind", str(workspace), "/work", "--size", str((limits or self.limits).tmp_bytes), "--tmpfs", "/tmp",
              "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--unshare-all", "--unshare-user", "--disable-userns",
              "--uid", "65534", "--gid", "65534", "--hostname", "sandbox",
              "--die-with-parent", "--new-session", "--chdir", "/work", "--"]
        return a + argv


def _reachable(path: Path) -> bool:
    """Whether any user may reach `path`: every directory above it searchable by others, the file readable."""
    try:
        for d in path.parents:
            if not os.stat(d).st_mode & 0o001:
                return False
        return bool(os.stat(path).st_mode & 0o004)
    except OSError:
        return False


class UnsafeSubprocess(Sandbox):
    """NO ISOLATION: the agent's code runs as this user with this machine's files and network."""

    name = "unsafe-subprocess"

    def __init__(self, limits: Limits | None = None):
        super().__init__(limits)
        log.warning("temper: running agent code WITHOUT a sandbox (unsafe-subprocess backend)")

    def wrap(self, argv, workspace, extra_ro, limits=None):
        return argv

    def host_cwd(self, workspace: Path) -> str | None:
        return str(workspace)

    def visible(self, dest: str, src: Path) -> str:
        return str(src)


# the isolated backends by name, in the order "auto" tries them: envs/sandbox_docker.py adds "docker"
BACKENDS: dict[str, type[Sandbox]] = {}


def make_sandbox(kind: str = "auto", limits: Limits | None = None, allow_unsafe: bool = False) -> Sandbox:
    """Build a sandbox: "auto" (bwrap, else docker), "bwrap", "docker" or "unsafe-subprocess"."""
    if kind == "unsafe-subprocess":
        if not (allow_unsafe or os.environ.get(UNSAFE_ENV) == "1"):
            raise SandboxUnavailable(
                f"the unsafe-subprocess backend runs agent code without isolation; opt in explicitly with "
                f"allow_unsafe=True or {UNSAFE_ENV}=1"
            )
        return UnsafeSubprocess(limits)
    if kind in BACKENDS:
        return BACKENDS[kind](limits)
    if kind != "auto":
        raise ValueError(f"sandbox kind {kind!r}: expected auto, bwrap, docker or unsafe-subprocess")
    reasons = []
    for cls in BACKENDS.values():
        try:
            return cls(limits)
        except SandboxUnavailable as e:
            reasons.append(f"{cls.name}: {e}")
    raise SandboxUnavailable(
        "no sandbox available (" + "; ".join(reasons) + "). Install bubblewrap (apt-get install bubblewrap) or "
        f"start a Docker engine; to run agent code unsandboxed anyway set {UNSAFE_ENV}=1."
    )


BACKENDS["bwrap"] = BwrapSandbox
