"""How a sandbox run starts: the exec shim (`prlimit`, a cgroup join, `setpriv`) in front of the sandbox's own command, or
the forked child's `preexec` where the shim's tools are missing."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil

from .cgroup import Cgroup


def _join(fd: int) -> str:
    """The shim's cgroup step: join each of the run's cgroups (`$$` is this shell, which then becomes the command). A
    failure is written to descriptor `fd`, which the agent's code never holds (closed before the exec): its own
    output cannot pass for a host fault."""
    return (f'while [ "$1" != -- ]; do echo $$ > "$1" 2>/dev/null || {{ echo "$1" >&{fd}; exit 127; }}; shift; done; '
            f'shift; exec {fd}>&-; exec "$@"')


@functools.cache
def _shim_tools() -> dict[str, str] | None:
    tools = {t: shutil.which(t, path="/usr/bin:/bin:/usr/sbin:/sbin") for t in ("prlimit", "setpriv", "bash")}
    return tools if all(tools.values()) else None


def exec_shim(rl: list[tuple[int, int]], cg: Cgroup | None, drop: int | None, report_fd: int = -1
              ) -> list[str] | None:
    """The commands a sandbox run execs through before its own (util-linux's `prlimit` sets the hard limits, `sh`
    joins the run's cgroups, `setpriv` drops to the sandbox user), so the run starts with a plain vfork and exec:
    forking this process, with the model and the engine's cache mapped, costs ~8 ms of its CPU a run (and as much
    again to tear the copy down). None where a tool is missing (the caller forks with `preexec`). A limit this
    process may not raise is clamped to its hard limit (the child could not raise it either). `report_fd`: where
    a failed cgroup join is reported (see `_join`), when the run has a cgroup."""
    tools = _shim_tools()
    if tools is None:
        return None
    names = {resource.RLIMIT_CPU: "cpu", resource.RLIMIT_AS: "as", resource.RLIMIT_FSIZE: "fsize",
             resource.RLIMIT_CORE: "core", resource.RLIMIT_NPROC: "nproc"}
    shim = [tools["prlimit"]]
    for res, val in rl:
        hard = resource.getrlimit(res)[1]
        if os.geteuid() != 0 and hard != resource.RLIM_INFINITY:
            val = min(val, hard)
        shim.append(f"--{names[res]}={val}:{val}")
    shim.append("--")
    if cg is not None and cg.active:
        shim += [tools["bash"], "-c", _join(report_fd), "temper-join", *(str(p / "cgroup.procs") for p in cg.paths), "--"]
    if drop is not None:
        shim += [tools["setpriv"], f"--reuid={drop}", f"--regid={drop}", "--clear-groups", "--"]
    return shim


def preexec(rl: list[tuple[int, int]], cg: Cgroup | None, drop: int | None) -> None:
    """In the forked child, before exec (where the shim's tools are missing): what `exec_shim` does."""
    os.setsid()
    for res, val in rl:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(res, (val, val))  # hard limits: an unprivileged process cannot raise them
    if cg is not None and cg.active:
        cg.attach_self()
    if drop is not None:  # last: the cgroup and limits above need root
        os.setgroups([])
        os.setgid(drop)
        os.setuid(drop)

