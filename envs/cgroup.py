"""A per-run cgroup (v1 `pids` / `memory` / `cpu`, or v2) for the limits rlimits cannot give a root-started sandbox."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sandbox import Limits


class Cgroup:
    """Per-run cgroup (v1 `pids`/`memory` or v2) for limits rlimits cannot give root."""

    def __init__(self, limits: Limits):
        self.paths: list[Path] = []
        self.cpu = False
        name = f"temper-{uuid.uuid4().hex[:12]}"
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        period = 100_000
        quota = max(1000, int(limits.cpu_quota * period))
        try:
            if Path("/sys/fs/cgroup/pids").is_dir():
                p = Path("/sys/fs/cgroup/pids") / name
                p.mkdir()
                (p / "pids.max").write_text(str(limits.max_processes))
                self.paths.append(p)
                mem = Path("/sys/fs/cgroup/memory")
                if mem.is_dir():
                    m = mem / name
                    m.mkdir()
                    (m / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                    self.paths.append(m)
                cpu = Path("/sys/fs/cgroup/cpu")
                if (cpu / "cpu.cfs_quota_us").exists():
                    c = cpu / name
                    c.mkdir()
                    (c / "cpu.cfs_period_us").write_text(str(period))
                    (c / "cpu.cfs_quota_us").write_text(str(quota))
                    self.paths.append(c)
                    self.cpu = True
            elif v2.exists() and "pids" in v2.read_text():
                p = Path("/sys/fs/cgroup") / name
                p.mkdir()
                (p / "pids.max").write_text(str(limits.max_processes))
                if "memory" in v2.read_text():
                    (p / "memory.max").write_text(str(limits.memory_bytes))
                if "cpu" in v2.read_text().split():
                    (p / "cpu.max").write_text(f"{quota} {period}")
                    self.cpu = True
                self.paths.append(p)
        except OSError:
            self.close()
            self.paths = []

    @property
    def active(self) -> bool:
        return bool(self.paths)

    def attach_self(self) -> None:  # runs in the child before exec
        for p in self.paths:
            (p / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        for p in self.paths:
            with contextlib.suppress(OSError):
                for pid in (p / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    p.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
