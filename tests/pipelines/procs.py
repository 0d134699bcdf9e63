"""Find processes by command line (Linux /proc), for tests that kill or watch Pipes children."""

import os
from pathlib import Path


def find(*needles: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmd for n in needles):
            out.append(int(d.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
