"""A run whose `temper run` process died keeps its `duckdb_writer` pool slot, and the next run then waits at
`rollout_batches` forever (seen: a chain killed with SIGTERM blocked the next `temper run` until its run was marked
failed by hand). `reap` finds such runs by their process tags and closes them; live ones and other hosts' are kept."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

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


def test_sigterm_stops_temper_run_cancels_its_run_and_its_stage(tmp_path):
    """SIGTERM (or Ctrl-C) to `temper run` mid-stage: it exits 130 naming the command that resumes, the Dagster run
    ends CANCELED with its slots freed, and the stage process is gone. (Before, Dagster's in-process execution
    captured the signal and the iteration went on.)"""
    import signal
    import time

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "DAGSTER_HOME": ""}
    log = tmp_path / "runs" / "pipeline" / "iteration-0001" / "dagster.log"
    cmd = [sys.executable, "-m", "pipelines.cli", "run", "--preset", "micro", "--run-root", "runs/pipeline",
           "-o", "train.max_steps=400", "-o", "envs.n_train=4", "-o", "envs.n_eval=2", "-o", "envs.probes=false"]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stage_pid = None
        for _ in range(1200):  # until the warm start's SFT (400 steps) is under way in its stage process
            text = log.read_text() if log.exists() else ""
            found = [line for line in text.splitlines() if "stage warm_start started in pid" in line]
            if found:
                stage_pid = int(found[-1].rsplit(" ", 1)[1])
                break
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.25)
        assert stage_pid is not None, "the warm start never started"
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    said = " ".join(out.split())
    assert p.returncode == 130, said[-2000:]
    assert "interrupted: iteration 1 stopped" in said and "temper run --preset micro" in said, said[-2000:]
    for _ in range(40):  # the stage sees its parent gone within half a second and kills its group
        if not Path(f"/proc/{stage_pid}").exists():
            break
        time.sleep(0.25)
    assert not Path(f"/proc/{stage_pid}").exists()
    with dg.DagsterInstance.from_config(str(tmp_path / "runs" / "dagster_home")) as instance:
        (run,) = instance.get_runs()
        assert run.status == dg.DagsterRunStatus.CANCELED
        assert instance.event_log_storage.get_concurrency_info(POOL).claimed_slots == []
