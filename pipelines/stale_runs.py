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
import sys
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
    except (ProcessLookupError, PermissionError):  # none, or someone else's process under that pid: ours is gone
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


def _interrupt(_signo, _frame) -> None:
    raise KeyboardInterrupt


def run_interruptibly(work, on_interrupt):
    """`work()` in a worker thread, so that Ctrl-C and SIGTERM reach this, the main, thread. Dagster's in-process
    execution captures both while it runs on the main thread and only checks for them at points an iteration's
    long steps never reach, then forgets them (seen: SIGTERM to a four-iteration `temper run` was ignored, and it went
    on into its next iteration). On either signal `on_interrupt()` runs and the process exits with status 130; the
    stage processes see their parent gone and kill their process groups (stages/step.py), and a killed step resumes
    from its checkpoints when the iteration runs again."""
    import signal
    import threading

    box: dict = {}

    def target() -> None:
        try:
            box["out"] = work()
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            box["err"] = e

    worker = threading.Thread(target=target, name="temper-run", daemon=True)
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
        try:
            on_interrupt()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
    finally:
        signal.signal(signal.SIGTERM, before)
    if "err" in box:
        raise box["err"]
    return box["out"]


def cancel(instance, run_id: str, why: str) -> bool:
    """Mark run `run_id` canceled (if it exists and has not ended) and free its pool slots."""
    run = instance.get_run_by_id(run_id)
    if run is None or run.is_finished:
        return False
    instance.report_run_canceled(run, why)
    instance.event_log_storage.free_concurrency_slots_for_run(run_id)
    return True
