"""The Docker sandbox: the same boundary as bubblewrap (envs/sandbox.py), through a Docker engine and its python
SDK. The image is an empty skeleton imported locally (no registry); the host's /usr and the few /etc files the
interpreter needs are bound read-only. Output is read from the attached stream as it comes, capped, never from the
engine's log. Registered with `make_sandbox` as "docker" (envs/__init__.py imports this module)."""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .sandbox import (
    BACKENDS,
    ETC_FILES,
    SANDBOX_SITE,
    SANDBOX_TOOLS,
    SANDBOX_UID,
    BwrapSandbox,
    Limits,
    RunResult,
    Sandbox,
    SandboxUnavailable,
    _MountedLayout,
    _refuse,
    staged,
)

SANDBOX_IMAGE = "temper-sandbox"
# runs first in the container: sets RLIMIT_AS (an engine ulimit would bind runc's own set-up too), makes the
# bound stdin file the process's stdin, then execs the command
_SHIM = ("import os, resource, sys\nm = int(sys.argv[1])\nresource.setrlimit(resource.RLIMIT_AS, (m, m))\n"
         "if sys.argv[2]:\n    fd = os.open(sys.argv[2], os.O_RDONLY)\n    os.dup2(fd, 0)\n    os.close(fd)\n"
         "os.execv(sys.argv[3], sys.argv[3:])")
SANDBOX_STDIN = "/opt/temper/stdin"


def _skeleton_tar() -> tuple[bytes, str]:
    """A root filesystem with nothing in it but mount points and the host's /bin, /lib… links: the sandbox image.
    Everything it runs comes from the host's /usr, bound read-only (as bwrap does); no registry is needed."""
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        def add(name: str, kind: bytes = tarfile.DIRTYPE, link: str = "", mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode, info.mtime = kind, link, mode, 0
            tar.addfile(info)

        for d in ("usr", "etc", "tmp", "work", "proc", "dev", "sys", "opt", "opt/temper", "opt/temper/tools",
                  "opt/temper/site"):
            add(d, mode=0o1777 if d == "tmp" else 0o755)
        for link in ("bin", "lib", "lib64", "sbin"):
            host = Path("/" + link)
            if host.is_symlink():
                add(link, tarfile.SYMTYPE, os.readlink(host))
            elif host.is_dir():
                add(link)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()[:12]


def ensure_image(client) -> str:
    """Import the skeleton image once (tagged by its content hash); return its reference."""
    data, tag = _skeleton_tar()
    ref = f"{SANDBOX_IMAGE}:{tag}"
    try:
        client.images.get(ref)
    except Exception:  # noqa: BLE001 - docker's ImageNotFound
        client.api.import_image_from_data(data, repository=SANDBOX_IMAGE, tag=tag)
    return ref


class DockerSandbox(_MountedLayout, Sandbox):
    """A Docker engine through the python SDK, with the same boundary as bwrap: the image is an empty skeleton
    (imported locally, no registry) and the host's /usr, /lib… and the /etc files the interpreter needs are bound
    read-only; the root filesystem is read-only; it runs as the unprivileged uid 65534 with every capability
    dropped and no-new-privileges (so no user namespaces); no network; a sized /tmp; memory, process, CPU-quota,
    CPU-time and file-size limits set by the engine, where the process cannot lift them; the workspace is a sized
    tmpfs on the host (as root), bind-mounted at /work."""

    name = "docker"

    def wrap(self, argv, workspace, extra_ro, limits=None):
        return argv  # unused: run() talks to the engine directly

    def __init__(self, limits: Limits | None = None, image: str | None = None):
        super().__init__(limits)
        try:
            import docker  # type: ignore[import-not-found]

            self.client = docker.from_env()
            self.client.ping()
        except Exception as e:  # noqa: BLE001 - any failure means no usable engine
            raise SandboxUnavailable(f"no Docker engine answers ({type(e).__name__}: {e})") from None
        self.image = image or ensure_image(self.client)
        ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
        if not Path(f"/usr/bin/{ver}").exists():
            raise SandboxUnavailable(f"the docker sandbox runs the host's /usr/bin/{ver}: apt-get install {ver}")
        self._python = f"/usr/bin/{ver}"
        self._root = os.geteuid() == 0
        self._no_mount = False

    def python(self) -> str:
        return self._python

    def run_as(self) -> int | None:
        return SANDBOX_UID if self._root else None  # the workspace must be reachable for it

    def mount_quota(self, path: Path, size: int) -> bool:
        return BwrapSandbox.mount_quota(self, path, size)

    def info(self) -> dict:
        quota = self._root and self.probe_quota()
        return {"backend": self.name, "image": self.image, "process_limit_enforced": True, "cpu_quota": True,
                "workspace_quota": quota, "host_uid": SANDBOX_UID, "python": self._python}

    def _volumes(self, workspace: Path, extra_ro: dict) -> dict:
        vols = {"/usr": {"bind": "/usr", "mode": "ro"}}
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path("/" + link).is_dir() and not Path("/" + link).is_symlink():
                vols["/" + link] = {"bind": "/" + link, "mode": "ro"}
        for f in ETC_FILES:
            if Path("/etc", f).exists():
                vols[f"/etc/{f}"] = {"bind": f"/etc/{f}", "mode": "ro"}
        tools, site = staged()
        vols[str(tools)] = {"bind": SANDBOX_TOOLS, "mode": "ro"}
        vols[str(site)] = {"bind": SANDBOX_SITE, "mode": "ro"}
        for dest, src in extra_ro.items():
            vols[str(src)] = {"bind": dest, "mode": "ro"}
        vols[str(workspace)] = {"bind": "/work", "mode": "rw"}
        return vols

    def run(self, argv, workspace, stdin=None, limits=None, extra_ro=None, env=None) -> RunResult:
        from docker.types import Ulimit  # type: ignore[import-not-found]

        lim = limits or self.limits
        bad = _refuse(argv, stdin)
        if bad:
            return RunResult(126, "", bad)
        run_env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONHASHSEED": "0", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})}
        ulimits = [Ulimit(name=n, soft=v, hard=v) for n, v in (("cpu", lim.cpu_seconds), ("fsize", lim.file_size_bytes),
                                                              ("core", 0))]
        vols = self._volumes(Path(workspace), extra_ro or {})
        feed = writer = None
        if stdin is not None:
            # a named pipe, not a file: the shim reads it to the end before anything else runs, and nothing is left
            # for the code under test to read again (a check's request carries its nonce)
            feed = Path(tempfile.mkdtemp(prefix="stdin-", dir=_feed_root()))
            feed.chmod(0o755)
            os.mkfifo(feed / "stdin", 0o644)
            vols[str(feed / "stdin")] = {"bind": SANDBOX_STDIN, "mode": "ro"}
            writer = threading.Thread(target=_feed, daemon=True, args=(
                feed / "stdin", stdin.encode() if isinstance(stdin, str) else stdin, lim.wall_seconds + 30))
        argv = [self._python, "-I", "-S", "-c", _SHIM, str(int(lim.memory_bytes)), SANDBOX_STDIN if feed else "", *argv]
        t0 = time.perf_counter()
        try:
            c = self.client.containers.create(
                self.image, argv, working_dir="/work", volumes=vols,
                network_mode="none", read_only=True, tmpfs={"/tmp": f"size={int(lim.tmp_bytes)},mode=1777"},
                user=f"{SANDBOX_UID}:{SANDBOX_UID}", cap_drop=["ALL"], security_opt=["no-new-privileges"],
                mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes, pids_limit=lim.max_processes,
                nano_cpus=int(lim.cpu_quota * 1e9), ulimits=ulimits, environment=run_env, hostname="sandbox",
                log_config={"type": "none"})  # output is read from the attached stream, never from a log
        except Exception as e:  # noqa: BLE001 - an engine fault is an infrastructure fault, not the agent's
            if feed is not None:
                shutil.rmtree(feed, ignore_errors=True)
            return RunResult(127, "", f"sandbox failed to start: {type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        cap = lim.output_bytes
        out, err, flags = bytearray(), bytearray(), {}
        try:
            # attached before the start, read as it comes and capped here (as bwrap's pipes are): a log file the
            # engine rotates once lost the first lines (the check's `ready`) to a flood of output
            stream = c.attach(stdout=True, stderr=True, stream=True, logs=False, demux=True)
            pump = threading.Thread(target=_pump, args=(stream, cap, out, err, flags), daemon=True)
            pump.start()
            if writer is not None:
                writer.start()
            c.start()
            timed_out = False
            try:
                rc = c.wait(timeout=lim.wall_seconds)["StatusCode"]
            except Exception:  # noqa: BLE001 - requests' timeout types vary by version
                timed_out = True
                with contextlib.suppress(Exception):
                    c.kill()
                rc = -9
            pump.join(timeout=5)
            if writer is not None:
                writer.join(timeout=5)
            if rc == 137 and not timed_out:
                rc = -9  # killed (OOM or a limit): as a signalled process reports it
        finally:
            with contextlib.suppress(Exception):
                c.remove(force=True)
            if feed is not None:
                shutil.rmtree(feed, ignore_errors=True)
        return RunResult(rc, bytes(out).decode("utf-8", "replace"), bytes(err).decode("utf-8", "replace"),
                         timed_out, bool(flags.get("truncated")), time.perf_counter() - t0)


_feeds: Path | None = None


def _feed_root() -> str:
    """Where the stdin pipes are made: as root, a tmpfs of this process's own (so the bound path a container sees in
    its mountinfo names no host directory); otherwise the temp dir."""
    global _feeds
    if _feeds is None:
        d = Path(tempfile.mkdtemp(prefix="temper-feeds-"))
        if os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(d)],
                                                capture_output=True, check=False).returncode == 0:
            atexit.register(lambda: subprocess.run(["umount", "-l", str(d)], capture_output=True, check=False))
        _feeds = d
    return str(_feeds)


def _feed(path: Path, data: bytes, patience: float) -> None:
    """Write `data` into the named pipe `path` once the container opens it, then close it (the reader's EOF). Gives
    up after `patience` seconds without a reader (the container never started), or when the reader goes away."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() > deadline:
                return
            time.sleep(0.002)
    os.set_blocking(fd, True)
    with contextlib.suppress(OSError):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    os.close(fd)


def _pump(stream, cap: int, out: bytearray, err: bytearray, flags: dict) -> None:
    """Read a container's demultiplexed (stdout, stderr) frames to the end, keeping at most `cap` bytes of each."""
    with contextlib.suppress(Exception):  # the stream ends with an error when the container is removed under it
        for o, e in stream:
            for buf, chunk in ((out, o), (err, e)):
                if chunk:
                    room = cap - len(buf)
                    if room > 0:
                        buf += chunk[:room]
                    if len(chunk) > max(room, 0):
                        flags["truncated"] = True


BACKENDS["docker"] = DockerSandbox
