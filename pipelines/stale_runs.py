"""Runs whose process died before they ended, found and closed before the next launch.

`temper run` executes an iteration inside its own process. When that process dies without ending the run (SIGKILL,
the OOM killer, a reboot), Dagster never hears that the run ended: it stays STARTED, and it keeps the
`duckdb_writer` pool slot of the step it was in. The next `temper run` then waits at `rollout_batches` forever, with
only "blocked by limit for pool duckdb_writer" in its log. So `temper run` tags each run with the host and process it
runs in (`run_tags`), and before it launches it marks every run of this host whose process is gone as failed and
frees its pool slots (`reap`). A run whose process still lives (another `temper run` at work) is left alone, and so
are the runs the Dagster daemon launched (they carry no such tags; its run monitoring watches them).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

PID_TAG = "temper/pid"
HOST_TAG = "temper/host"
START_TAG = "temper/process_start"  # the process's start time since boot, in clock ticks: a reused pid differs


def process_start(pid: int) -> str:
    """The start time of process `pid` in clock ticks since boot ("" where /proc cannot say, or no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name (field 2) may hold spaces or ')'


def run_tags() -> dict[str, str]:
    """The tags that name this process as the one executing a run."""
    pid = os.getpid()
    return {PID_TAG: str(pid), HOST_TAG: socket.gethostname(), START_TAG: process_start(pid)}


def alive(tags) -> bool:
    """Whether the process `tags` name still runs (on this host)."""
    pid = int(tags[PID_TAG])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process under that pid: ours is gone
        return False
    want = tags.get(START_TAG, "")
    return not want or process_start(pid) in ("", want)


def reap(instance, log=print) -> list[str]:
    """Mark every unfinished run of this host whose `temper run` process is gone as failed and free its pool slots.
    Returns their run ids."""
    from dagster import DagsterRunStatus, RunsFilter

    host = socket.gethostname()
    unfinished = instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.STARTED, DagsterRunStatus.STARTING,
                                                                DagsterRunStatus.CANCELING]))
    reaped = []
    for run in unfinished:
        tags = run.tags
        if tags.get(HOST_TAG) != host or not str(tags.get(PID_TAG, "")).isdigit() or alive(tags):
            continue
        part = tags.get("dagster/partition", "?")
        instance.report_run_failed(run, f"temper run's process {tags[PID_TAG]} on {host} ended without ending this run "
                                        "(killed?); marked failed by the next `temper run`")
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
        log(f"run {run.run_id} (iteration {part}) lost its process {tags[PID_TAG]}: marked failed, its pool slots "
            "freed")
        reaped.append(run.run_id)
    return reaped
