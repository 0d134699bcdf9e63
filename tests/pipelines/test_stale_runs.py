"""A run whose `temper run` process died keeps its `duckdb_writer` pool slot, and the next run then waits at
`rollout_batches` forever (seen: a chain killed with SIGTERM blocked the next `temper run` until its run was marked
failed by hand). `reap` finds such runs by their process tags and closes them; live ones and other hosts' are kept."""

import os
import subprocess
import sys
import uuid

import dagster as dg
from dagster._core.storage.dagster_run import DagsterRun

from pipelines.stale_runs import HOST_TAG, PID_TAG, START_TAG, alive, process_start, reap, run_tags

POOL = "duckdb_writer"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _run(instance, tags: dict) -> str:
    run_id = str(uuid.uuid4())
    instance.add_run(DagsterRun(job_name="iteration", run_id=run_id, status=dg.DagsterRunStatus.STARTED,
                                tags={"dagster/partition": "3", **tags}))
    return run_id


def _claimed(instance, run_id: str) -> bool:
    return instance.event_log_storage.claim_concurrency_slot(POOL, run_id, "rollout_batches").is_claimed


def test_a_dead_runs_slot_is_freed_and_live_or_foreign_runs_are_kept(tmp_path):
    mine = run_tags()
    assert mine[PID_TAG] == str(os.getpid()) and mine[START_TAG] == process_start(os.getpid()) != ""
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        instance.event_log_storage.set_concurrency_slots(POOL, 1)
        dead = _run(instance, {**mine, PID_TAG: str(_dead_pid())})
        reused = _run(instance, {**mine, START_TAG: "1"})  # our pid, but another process's start: the pid was reused
        live = _run(instance, mine)
        foreign = _run(instance, {**mine, HOST_TAG: "another-host", PID_TAG: str(_dead_pid())})
        daemon = _run(instance, {})  # launched by the Dagster daemon: not ours to judge
        assert _claimed(instance, dead)
        newcomer = str(uuid.uuid4())
        assert not _claimed(instance, newcomer)  # what the next run's rollout step saw: blocked
        said = []
        assert sorted(reap(instance, said.append)) == sorted([dead, reused])
        status = {r: instance.get_run_by_id(r).status for r in (dead, reused, live, foreign, daemon)}
        assert status == {dead: dg.DagsterRunStatus.FAILURE, reused: dg.DagsterRunStatus.FAILURE,
                          live: dg.DagsterRunStatus.STARTED, foreign: dg.DagsterRunStatus.STARTED,
                          daemon: dg.DagsterRunStatus.STARTED}
        assert any(f"run {dead} (iteration 3) lost its process" in s for s in said), said
        assert _claimed(instance, newcomer)  # the slot is free again
        assert reap(instance, said.append) == []  # nothing left to close


def test_alive_reads_the_process_table():
    assert alive(run_tags())
    assert not alive({PID_TAG: str(_dead_pid())})
    assert not alive({**run_tags(), START_TAG: "1"})
