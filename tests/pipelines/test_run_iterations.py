"""`temper run --iterations K`: K iterations in a row in one run root, each its own partition starting from what the one
before handed off, stopping at the first failure; `--iteration N` and `--iterations K` exclude each other. The Dagster
run is stubbed (a job that writes what an evaluated iteration leaves and logs through the logger `temper run` gives it)."""

import argparse
import json
import os
from pathlib import Path

import dagster as dg
import pytest

from pipelines.cli import main
from pipelines.progress import LOGGER
from pipelines.stale_runs import PID_TAG


def test_iteration_and_iterations_together_are_refused_when_parsed(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--iteration", "2", "--iterations", "3"])
    assert e.value.code == 2
    assert "argument --iterations: not allowed with argument --iteration" in capsys.readouterr().err
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as e:
            main(["run", "--iterations", bad])
        assert e.value.code == 2 and "is not a positive number of iterations" in capsys.readouterr().err


class StubJob:
    """Stands in for the iteration job: each run logs a stage's start, a step report and its success through the
    logger `temper run` attached, then (unless its partition is `fail_at`) leaves what an evaluated iteration
    leaves: evaluation.json, warm_start.json and the `policy` record the next iteration starts from."""

    loggers: dict = {}

    def __init__(self, root: Path, fail_at: str | None = None):
        self.root, self.fail_at, self.calls, self.run_ids = root, fail_at, [], []

    def with_logger_defs(self, logger_defs):
        self.logger = logger_defs[LOGGER].logger_fn(None)
        return self

    def execute_in_process(self, run_config, instance, partition_key, raise_on_error, tags=None, run_id=None):
        it = partition_key
        self.calls.append(it)
        assert tags[PID_TAG] == str(os.getpid())  # each run names the process executing it (pipelines/stale_runs.py)
        assert run_id and run_id not in self.run_ids  # its own id, known before it starts (to cancel it on Ctrl-C)
        self.run_ids.append(run_id)
        assert run_config["loggers"] == {LOGGER: {}}
        for kind, msg in (("STEP_START", None), (None, f"SFT step 3/6: loss {it}"), ("STEP_SUCCESS", None)):
            event = argparse.Namespace(event_type_value=kind, step_key="warm_start", event_specific_data=None)
            self.logger.info(msg or kind, extra={"dagster_meta": {
                "step_key": "warm_start", "orig_message": msg or kind, "dagster_event": event if kind else None}})
        run_dir = self.root / f"iteration-{int(it):04d}"
        run_dir.mkdir(parents=True, exist_ok=True)
        ok = it != self.fail_at
        if ok:
            (run_dir / "evaluation.json").write_text(json.dumps({"student": str(run_dir / "student"),
                                                                 "registered": {"champion_moved": True}}))
            (run_dir / "warm_start.json").write_text(json.dumps({"checkpoint": str(run_dir / "warm")}))
            instance.report_runless_asset_event(dg.AssetMaterialization("policy", metadata={
                "iteration": int(it), "checkpoint": str(run_dir / "student"), "run_root": str(self.root)}))
        return argparse.Namespace(success=ok, run_id=f"run-{it}", all_events=[])


def _run(tmp_path, monkeypatch, job, *argv):
    import pipelines.definitions as definitions

    monkeypatch.setattr(definitions, "defs", argparse.Namespace(resolve_job_def=lambda name: job))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "unused"))  # `temper run` points it at runs/dagster_home
    monkeypatch.delenv("TEMPER_DAGSTER_PG_URL", raising=False)
    monkeypatch.delenv("TEMPER_MLFLOW_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return main(["run", "--preset", "micro", "--run-root", str(job.root), *argv])


def test_iterations_run_in_a_row_each_from_the_one_before(tmp_path, monkeypatch, capsys):
    root = (tmp_path / "runs" / "pipeline").resolve()
    job = StubJob(root)
    assert _run(tmp_path, monkeypatch, job, "--iterations", "2") == 0
    said = " ".join(capsys.readouterr().out.split())
    assert job.calls == ["1", "2"]  # iteration 2 was allowed to start: 1 had been evaluated in this run root
    assert "iteration 1 of 2" in said and "iteration 2 of 2" in said and "2 iterations finished" in said
    assert said.count("stages") >= 2 and "Dagster run run-1 succeeded" in said and "Dagster run run-2 succeeded" in said
    assert "iteration 3 starts from what iteration 2 hands off" in said
    assert "warm_start done 3/6" not in said and "warm_start done SFT 6/6" in said  # a line per stage as it ends
    for it in ("1", "2"):  # each iteration's own log, named in the output
        log = root / f"iteration-000{it}" / "dagster.log"
        assert f"log: {log}" in said and f"SFT step 3/6: loss {it}" in log.read_text()
        assert json.loads((root / f"iteration-000{it}" / "summary.json").read_text())["success"] is True
    # the next `temper run` goes on from there
    job3 = StubJob(root)
    assert _run(tmp_path, monkeypatch, job3) == 0 and job3.calls == ["3"]


def test_iterations_stop_at_the_first_failure(tmp_path, monkeypatch, capsys):
    root = (tmp_path / "runs" / "pipeline").resolve()
    job = StubJob(root, fail_at="2")
    assert _run(tmp_path, monkeypatch, job, "--iterations", "3", "--log-level", "ERROR") == 1
    said = " ".join(capsys.readouterr().out.split())
    assert job.calls == ["1", "2"]
    assert "stopped: iteration 2 failed, so the 1 iteration(s) after it did not run (1 of 3 finished: 1)" in said
    assert "reruns iteration 2 from its last finished step" in said
    # a bad --log-level is refused before anything runs
    job = StubJob(root)
    assert _run(tmp_path, monkeypatch, job, "--log-level", "LOUD") == 2 and job.calls == []
    assert "--log-level 'LOUD' is not a level" in " ".join(capsys.readouterr().out.split())
