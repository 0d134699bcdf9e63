"""`temper run`'s live progress (pipelines/progress.py): the event → stage-line state machine, the step k/N reports the
stages make (stages/step.py), and a real Dagster job run through `execute_live` (its log file against the instance's
event log)."""

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from rich.console import Console

from pipelines.progress import Board, RecordHandler, execute_live, fmt_seconds, parse_steps
from stages.step import OUTPUT_ENV, progress_reporter, redirect_output

ROOT = Path(__file__).resolve().parents[2]


def test_step_reports_are_read_from_the_stages_log_lines():
    # the lines the stages write today (stages/warm.py, experts.py, distill.py, trainers/base.py, step.py's reporter)
    assert parse_steps("SFT step 3/40: loss 1.2345") == ("SFT", 3, 40)
    assert parse_steps("math: SAO step 1/20 reward 0.00 v1 mismatch 0.0e+00") == ("math: SAO", 1, 20)
    assert parse_steps("OPD step 2/5 reverse KL 0.0012") == ("OPD", 2, 5)
    assert parse_steps("base step 50/2500: loss 0.1 (12 s)") == ("base", 50, 2500)
    assert parse_steps("rollouts: progress 12/240") == ("rollouts", 12, 240)
    assert parse_steps("progress 0/8") == ("", 0, 8)
    for no in ("SAO: resumed from /x/state (step 5, policy v3)", "validated 4 environments: 4 accepted",
               "step 7/5", "step 1/0", "loaded 2/3 workers", "", None):
        assert parse_steps(no) is None, no
    assert parse_steps("first line\nSFT step 1/2") is None  # first line only (a traceback is not a report)


def test_the_board_follows_a_runs_events_and_estimates_the_time_left():
    finals = []
    b = Board(["env_specs", "warm_start", "sao_experts", "evaluation"], on_final=lambda r: finals.append(r.name))
    assert [b.rows[n].state for n in b.order] == ["waiting"] * 4

    b.event("STEP_START", "env_specs", 100.0)
    b.event("ASSET_MATERIALIZATION", "env_specs", 101.0, reused=True)
    b.event("STEP_SUCCESS", "env_specs", 101.5)
    assert b.rows["env_specs"].state == "reused" and b.rows["env_specs"].elapsed(999.0) == 1.5

    w = b.rows["warm_start"]
    b.event("STEP_START", "warm_start", 200.0)
    b.message("warm_start", "SFT data: 4 oracle trajectories", 205.0)
    assert (w.state, w.k, w.n, w.eta(210.0)) == ("running", None, None, None)
    b.message("warm_start", "SFT step 2/10: loss 1.0", 220.0)
    assert (w.label, w.k, w.n) == ("SFT", 2, 10)
    assert w.eta(230.0) == pytest.approx(30 / 2 * 8)  # elapsed since the step started / k × (N − k) = 120
    assert w.elapsed(230.0) == 30.0
    b.message("warm_start", "SFT step 5/10: loss 0.5", 250.0)
    assert w.eta(250.0) == pytest.approx(50 / 5 * 5)
    assert "SFT 5/10" in b.line(w, 250.0) and "50s" in b.line(w, 250.0) and "~50s left" in b.line(w, 250.0)
    b.event("STEP_SUCCESS", "warm_start", 260.0)
    assert (w.state, w.k, w.eta(300.0), w.elapsed(300.0)) == ("done", 10, None, 60.0)

    # SAO trains one expert after another: a new label starts a new series, timed from the last report
    s = b.rows["sao_experts"]
    b.event("STEP_START", "sao_experts", 300.0)
    b.message("sao_experts", "math: SAO step 2/2 reward 0.5", 340.0)
    b.message("sao_experts", "reasoning: SAO step 1/4 reward 0.0", 370.0)
    assert (s.label, s.k, s.n, s.series_start) == ("reasoning: SAO", 1, 4, 340.0)
    assert s.eta(380.0) == pytest.approx(40 / 1 * 3)
    # a retry: the row says so, the attempt restarts its series from the restart
    b.event("STEP_UP_FOR_RETRY", "sao_experts", 390.0, error="worker died")
    assert s.state == "retrying" and s.eta(395.0) is None and "worker died" in b.line(s, 395.0)
    b.event("STEP_RESTARTED", "sao_experts", 400.0)
    assert (s.state, s.attempt, s.k, s.started) == ("running", 2, None, 300.0)
    b.message("sao_experts", "reasoning: SAO step 1/4 reward 0.0", 410.0)
    assert s.series_start == 400.0 and s.eta(420.0) == pytest.approx(20 / 1 * 3)
    b.event("STEP_FAILURE", "sao_experts", 430.0, error="ValueError: kaput\nmore")
    assert (s.state, s.error, s.elapsed(999.0)) == ("failed", "ValueError: kaput\nmore", 130.0)
    assert "failed (attempt 2)" in b.line(s) and "kaput" not in b.line(s)  # the caller reports the error after the run

    b.event("STEP_SKIPPED", "evaluation", 431.0)
    assert b.rows["evaluation"].state == "skipped" and b.rows["evaluation"].elapsed(500.0) is None
    assert finals == ["env_specs", "warm_start", "sao_experts", "evaluation"]
    # a step the board was not given (an asset check) goes under its asset; unknown events change nothing
    b.event("STEP_START", "warm_start_some_check", 440.0)
    assert b.order.index("warm_start_some_check") == b.order.index("warm_start") + 1
    assert b.event("STEP_WORKER_STARTING", "evaluation", 441.0) is None and b.rows["evaluation"].state == "skipped"
    b.event("RUN_FAILURE", None, 450.0, error="the run failed")
    assert b.run_error == "the run failed"

    con = Console(record=True, width=150, file=io.StringIO())
    con.print(b.render(now=445.0))
    rows = {ln.split()[0]: " ".join(ln.split()) for ln in con.export_text().splitlines()[1:] if ln.strip()}
    assert list(rows) == [ "env_specs", "warm_start", "some_check", "sao_experts", "evaluation"]
    assert rows["env_specs"] == "env_specs ↺ reused 2s"
    assert rows["warm_start"].startswith("warm_start ✓ done SFT 10/10") and rows["warm_start"].endswith(" 1m00s")
    assert rows["some_check"] == "some_check ▶ running 5s"
    assert rows["sao_experts"].startswith("sao_experts ✗ failed (2) reasoning: SAO 1/4")
    assert rows["sao_experts"].endswith(" 2m10s") and rows["evaluation"] == "evaluation - skipped"


def test_fmt_seconds():
    assert [fmt_seconds(x) for x in (None, 0, 59.4, 60, 3599, 3600, 7325)] == \
        ["", "0s", "59s", "1m00s", "59m59s", "1h00m", "2h02m"]


def test_the_progress_reporter_throttles_but_always_says_the_first_and_the_last():
    said, now = [], [0.0]
    progress = progress_reporter(said.append, min_interval=2.0, clock=lambda: now[0])
    for t, k in ((0.0, 1), (1.0, 2), (1.9, 3), (2.5, 4), (3.0, 5), (3.1, 8)):
        now[0] = t
        progress(k, 8, "rollouts")
    assert said == ["rollouts: progress 1/8", "rollouts: progress 4/8", "rollouts: progress 8/8"]
    assert [parse_steps(x)[1:] for x in said] == [(1, 8), (4, 8), (8, 8)]


def test_a_stage_process_sends_its_own_output_and_its_childrens_to_the_log(tmp_path):
    log = tmp_path / "dagster.log"
    log.write_text("before\n")
    code = (f"from stages.step import redirect_output; redirect_output({str(log)!r}); print('to stdout'); "
            "import sys, subprocess; sys.stderr.write('to stderr\\n'); sys.stdout.flush(); "
            "subprocess.run(['echo', 'from a child'])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""
    assert log.read_text().splitlines() == ["before", "to stdout", "to stderr", "from a child"]
    redirect_output(None)  # unset: nothing changes


def _job(seen: list):
    @dg.asset
    def alpha(context):
        context.log.info("SFT step 1/2: loss 1.0")
        context.log.info("SFT step 2/2: loss 0.5")
        context.log.warning("the alpha warning")
        seen.append(os.environ.get(OUTPUT_ENV))  # what a stage process started here would inherit
        return dg.MaterializeResult(metadata={"reused": False})

    @dg.asset(deps=[alpha])
    def beta(context):
        context.log.info("beta: reusing the result computed by run abc: its inputs are unchanged")
        return dg.MaterializeResult(metadata={"reused": True})

    @dg.asset(deps=[beta])
    def gamma(context):
        raise ValueError("kaput: gamma cannot go on")

    @dg.asset(deps=[gamma])
    def delta(context):
        return None

    return dg.Definitions(assets=[alpha, beta, gamma, delta],
                          jobs=[dg.define_asset_job("j", selection="*")]).resolve_job_def("j")


def test_a_dagster_run_drives_the_board_and_its_whole_log_goes_to_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv(OUTPUT_ENV, raising=False)
    out = (tmp_path / "terminal.txt").open("w")
    con = Console(file=out, width=200)  # not a terminal: a line per stage as it ends, no live table
    log = tmp_path / "iteration-0001" / "dagster.log"
    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster2").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        seen = []
        res, board = execute_live(_job(seen), {}, inst, None, log_path=log, console=con,
                                  stages=["alpha", "beta", "gamma", "delta"])
        entries = inst.all_logs(res.run_id)
    assert not res.success
    rows = board.rows
    assert (rows["alpha"].state, rows["alpha"].k, rows["alpha"].n) == ("done", 2, 2)
    assert rows["beta"].state == "reused"
    assert rows["gamma"].state == "failed" and "kaput: gamma cannot go on" in rows["gamma"].error
    assert "Traceback" not in rows["gamma"].error  # the exception the asset raised, not Dagster's wrapper
    assert rows["delta"].state == "skipped"  # never ran
    assert rows["alpha"].elapsed(0) is not None and rows["alpha"].elapsed(0) >= 0

    said = (tmp_path / "terminal.txt").read_text()  # written through its own descriptor, not Dagster's capture
    ends = [ln.split()[:2] for ln in said.splitlines() if ln.split()[:1] in (["alpha"], ["beta"], ["gamma"])]
    assert ends[:3] == [["alpha", "done"], ["beta", "reused"], ["gamma", "failed"]]  # a line per stage as it ends
    assert "alpha: the alpha warning" in said and "SFT step" not in said  # WARNING and up are echoed, INFO is not
    assert "Not executing" not in said and "Execution of step" not in said  # Dagster's own: the board shows them

    text = log.read_text()
    assert os.environ.get(OUTPUT_ENV) is None  # restored after the run
    assert seen == [str(log.resolve())]  # the stage processes' own output goes to the log too
    # the whole event log, DEBUG events included, as Dagster's console logger writes it (but the planned
    # materialisations: the instance records them when it creates the run, before the run has loggers)
    entries = [e for e in entries if not e.dagster_event or e.dagster_event.event_type_value != "ASSET_MATERIALIZATION_PLANNED"]
    assert len(entries) > 20
    legacy = {"PIPELINE_START": "RUN_START", "PIPELINE_FAILURE": "RUN_FAILURE", "PIPELINE_SUCCESS": "RUN_SUCCESS"}
    for e in entries:
        want = e.dagster_event.event_type_value if e.dagster_event else e.user_message
        assert legacy.get(want, want) in text, want
    assert sum(res.run_id in ln for ln in text.splitlines()) >= len(entries)
    for kind in ("STEP_START", "STEP_SUCCESS", "STEP_FAILURE", "ASSET_MATERIALIZATION", "RUN_FAILURE"):
        assert f" - {kind} - " in text, kind
    assert "SFT step 2/2: loss 0.5" in text and "ValueError: kaput" in text and "Stack Trace:" in text

    # a second run appends to the same file (a repaired iteration keeps its first attempt's log)
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster2")) as inst:
        res2, _ = execute_live(_job([]), {}, inst, None, log_path=log, console=con, stages=["alpha"],
                               echo_level=logging.CRITICAL)
    after = log.read_text()
    assert after.startswith(text) and res2.run_id in after[len(text):]


def test_the_record_handler_echoes_from_the_level_asked(tmp_path):
    said = []
    b = Board(["a"])
    h = RecordHandler(b, said.append, echo_level=logging.INFO)
    lg = logging.Logger("t", logging.DEBUG)
    lg.addHandler(h)
    lg.debug("quiet", extra={"dagster_meta": {"step_key": "a", "orig_message": "quiet", "dagster_event": None}})
    lg.info("x", extra={"dagster_meta": {"step_key": "a", "orig_message": "SFT step 1/3", "dagster_event": None}})
    lg.warning("a plain record, no Dagster metadata")
    assert said == ["a: SFT step 1/3", "a plain record, no Dagster metadata"]
    assert b.rows["a"].k is None  # a step that has not started keeps no progress
    # Dagster's notice for a step it leaves out (no event comes with it) marks the row skipped, unechoed
    skip = "Dependencies for step a failed: ['z']. Not executing."
    lg.warning(skip, extra={"dagster_meta": {"step_key": "a", "orig_message": skip, "dagster_event": None}})
    assert b.rows["a"].state == "skipped" and len(said) == 2
    h.echo_level = logging.DEBUG  # DEBUG: everything, Dagster's own too
    lg.warning(skip, extra={"dagster_meta": {"step_key": "a", "orig_message": skip, "dagster_event": None}})
    assert said[-1] == f"a: {skip}"


def test_a_stage_that_never_started_did_not_run():
    ended = []
    b = Board(["a", "b"], on_final=lambda r: ended.append((r.name, r.state)))
    b.event("STEP_START", "a", 1.0)
    b.event("STEP_SUCCESS", "a", 2.0)
    b.finish()
    assert ended == [("a", "done"), ("b", "skipped")]


def test_step_log_prints_every_message_and_moves_its_bar():
    """`temper train base` passes this as the recipe's `log`: its "base step k/N" lines move a bar (on a terminal)."""
    from pipelines.progress import step_log

    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=120, color_system=None, highlight=False)
    with step_log(con, "base") as log:
        log("base data: 40 oracle segments")
        log("base step 50/200: loss 1.0")
        log("base step 100/200: loss 0.5")
    text = out.getvalue()
    assert "base data: 40 oracle segments" in text and "base step 100/200: loss 0.5" in text
    assert "100/200 " in text.replace("base step 100/200", "")  # the bar's k/N, drawn when it stops


def test_counting_bar_counts_every_item_from_many_threads():
    """The benches' bars: `Counter` is the `on_done` hook of episodes that finish on other threads; every call counts
    once (a lost update would leave the bar short), `advance(n)` moves it n on, and the bar ends at k/N."""
    import threading

    from pipelines.progress import counting

    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=140, color_system=None, highlight=False)
    with counting(con, "episodes", 410) as bar:
        def work():
            for _ in range(100):
                bar(object())  # a finished trajectory
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert bar.done == 400
        bar.advance(7)
        bar.note("dense")
    text = out.getvalue()
    assert bar.done == 407
    assert "407/410" in text and "dense" in text
