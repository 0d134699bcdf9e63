"""Find processes by command line (Linux /proc), for tests that kill or watch Pipes children."""

import os
from pathlib import Path


def _parent(pid: int) -> int:
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state": the parent's pid


def descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = _parent(pid)
        if pid == ancestor:
            return True
    return False


def find(*needles: str) -> list[int]:
    """The processes below this one whose command line holds every needle. Only descendants: the suite runs in two
    xdist workers, and the other worker's test may be running a child with the same command line."""
    out = []
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmd for n in needles) and descends_from(int(d.name), me):
            out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
