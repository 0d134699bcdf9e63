"""A tool session: one sandboxed tool runner per environment, kept for the episode.

A one-shot tool call starts bubblewrap and an interpreter, about 50–80 ms of CPU here, for a `read` that takes
microseconds. A session starts `tools/runner.py --serve` once in the same sandbox (same mounts, user, limits and
cgroup as a one-shot run) and sends it one JSON request per line. Only the built-in tools (ls, read, write,
replace, calc) go through it: they are the runner's own code, the workspace is data to them, and agent code (the
`python` and `pytest` tools) still runs in a sandbox of its own per call, in another PID namespace.

The reply is read with the one-shot limits: a wall-clock deadline per request and at most `output_bytes`. A request
past either, or a runner that died (a CPU or memory limit), ends the session like a killed one-shot process ends:
the call reports a failure (timed out, or exit −9), and the next call starts a new session.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import threading
import time
from pathlib import Path

from .sandbox import Limits, RunResult, Sandbox, kill_group


class ToolSession:
    def __init__(self, sandbox: Sandbox, workspace: Path, limits: Limits):
        self.sandbox, self.workspace, self.limits = sandbox, workspace, limits
        self._proc = self._cg = self._drain = None
        self._err = bytearray()
        self.started = 0  # sessions started (a failed request ends one; the next request starts another)

    def _start(self) -> RunResult | None:
        sb = self.sandbox
        got = sb.spawn([sb.python(), "-I", "-S", f"{sb.tools_dir()}/runner.py", "--serve",
                        str(self.limits.output_bytes)], self.workspace,
                       self.limits)
        if isinstance(got, RunResult):
            return got
        self._proc, self._cg = got
        self._err = bytearray()
        self._drain = threading.Thread(target=self._drain_err, args=(self._proc.stderr, self._err), daemon=True)
        self._drain.start()
        self.started += 1
        return None

    def _drain_err(self, pipe, keep: bytearray) -> None:
        cap = self.limits.output_bytes
        for chunk in iter(lambda: pipe.read1(65536), b""):
            keep += chunk[: max(0, cap - len(keep))]

    def call(self, tool: str, args: dict) -> RunResult:
        """Run one built-in tool; the result reads as a one-shot run of tools/runner.py would (exit code 0 or 2 with
        the observation on stdout, 1 with the error on stderr, −9 killed, or timed out)."""
        t0 = time.perf_counter()
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            failed = self._start()
            if failed is not None:
                return failed
        line = (json.dumps({"tool": tool, "args": args}) + "\n").encode()
        try:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except OSError:
            return self._ended(t0)
        raw, timed_out, over = self._read_line()
        if raw is None:
            if timed_out or over:
                self.close()
                return RunResult(-9, "", "", timed_out=timed_out, truncated=over, seconds=time.perf_counter() - t0)
            return self._ended(t0)
        reply = json.loads(raw)
        rc, out, cut = reply["rc"], reply["out"], bool(reply["truncated"])
        if rc == 1:
            return RunResult(1, "", out, truncated=cut, seconds=time.perf_counter() - t0)
        return RunResult(rc, out, "", truncated=cut, seconds=time.perf_counter() - t0)

    def _ended(self, t0: float) -> RunResult:
        """The runner died mid-request (a limit killed it): as a one-shot run killed by a signal reports it."""
        proc = self._proc
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        self._drain.join(timeout=5)  # (the runner is gone: its stderr ends)
        rc = proc.returncode if proc.returncode is not None else -9
        err = bytes(self._err).decode("utf-8", "replace")
        self.close()
        return RunResult(rc if rc not in (0, 2) else -9, "", err, seconds=time.perf_counter() - t0)

    def _read_line(self) -> tuple[bytes | None, bool, bool]:
        """(one reply line, timed out, over the output cap), within the limits' wall-clock deadline."""
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + self.limits.wall_seconds
        buf = bytearray()
        cap = self.limits.output_bytes * 6 + 1024  # JSON escapes a byte in at most 6 (\\uXXXX)
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, True, False
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None, False, False
                buf += chunk
                if buf.endswith(b"\n") or b"\n" in chunk:
                    return bytes(buf[: buf.index(b"\n")]), False, False
                if len(buf) > cap:
                    return None, False, True

    def close(self) -> None:
        """End the session: stdin closed, the process group killed, its cgroup removed."""
        proc, cg, self._proc, self._cg = self._proc, self._cg, None, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.stdin.close()
        if proc.returncode is None:  # (a reaped leader's pid may name another group by now: the cgroup kills the rest)
            kill_group(proc)
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        if cg is not None:
            cg.close()
        for f in (proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
