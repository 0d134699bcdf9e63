"""Progress on the terminal: one line per stage of a Dagster run (`temper run`), and progress bars for long CLI work.

Stages report steps in their log lines — "SFT step 3/40: loss …", "math: SAO step 2/20 …", "rollouts: progress
12/240" (`stages.step.progress_reporter`) — and `parse_steps` reads them. `Board` turns a run's events (a step started,
succeeded, failed, was retried or skipped; a materialisation that reused an earlier result; a step's log lines) into
one row per stage: its state, step k of N, the elapsed time and an estimate of the time left, elapsed / k × (N − k)
over the current series of steps (a series restarts when the label changes or k goes back: SAO's next domain).
`RecordHandler` feeds a Board from the records of a Dagster logger and echoes messages at or above a level;
`execute_live` runs a job in process with both attached (the board live on a terminal, the full log in a file).
Only `execute_live` imports dagster: a record carries its Dagster event as an attribute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

STEP_RE = re.compile(r"^(?P<label>[^\n]{0,60}?)\b(?:step|progress)\s+(?P<k>\d+)\s*/\s*(?P<n>\d+)", re.IGNORECASE)
FINAL = ("done", "reused", "failed", "skipped")
STYLE = {"waiting": ("·", "dim"), "running": ("▶", "yellow"), "retrying": ("↻", "magenta"), "done": ("✓", "green"),
         "reused": ("↺", "cyan"), "failed": ("✗", "red"), "skipped": ("-", "dim")}


def parse_steps(message: str) -> tuple[str, int, int] | None:
    """(label, k, N) of a log line that reports "… step k/N …" or "… progress k/N …" (first line only), else None."""
    m = STEP_RE.search(str(message or "").split("\n", 1)[0])
    if not m:
        return None
    k, n = int(m["k"]), int(m["n"])
    if n <= 0 or k > n:
        return None
    return m["label"].strip().rstrip(":").strip(), k, n


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return ""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class Row:
    """One stage (a Dagster step) of the run."""

    name: str
    state: str = "waiting"  # waiting | running | retrying | done | reused | failed | skipped
    started: float | None = None
    ended: float | None = None
    label: str = ""
    k: int | None = None
    n: int | None = None
    series_start: float | None = None  # when the current series of k/N reports began
    mark: float | None = None  # where the next series starts from: the (re)start or the last report
    attempt: int = 1
    reused: bool = False
    error: str = ""
    shown: str = ""  # the name on screen (a check under its asset: indented, without the asset's name)

    def elapsed(self, now: float) -> float | None:
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else now) - self.started

    def eta(self, now: float) -> float | None:
        """elapsed / k × (N − k) over the current series, while running."""
        if self.state != "running" or not self.k or self.n is None or self.series_start is None:
            return None
        return max(0.0, now - self.series_start) / self.k * (self.n - self.k)

    def steps(self) -> str:
        if self.k is None:
            return ""
        return f"{self.label + ' ' if self.label else ''}{self.k}/{self.n}"


class Board:
    """The stages of a run and their state, fed with Dagster event types and step log lines (thread-safe: Pipes
    messages arrive on a reader thread). `on_final(row)` is called when a row reaches a final state."""

    def __init__(self, stages: list[str], clock: Callable[[], float] = time.time,
                 on_final: Callable[[Row], None] | None = None, title: str = ""):
        self.order = list(stages)
        self.rows = {s: Row(s) for s in stages}
        self.clock, self.on_final, self.title = clock, on_final, title
        self.run_error = ""
        self._lock = threading.RLock()

    def row(self, step: str) -> Row:
        """The row of `step`; a step not listed (an asset check, `verified_envs_triad_pass_rate`) goes after the
        longest listed name it starts with, else last."""
        with self._lock:
            if step not in self.rows:
                parent = max((s for s in self.order if step.startswith(s)), key=len, default=None)
                at = len(self.order) if parent is None else \
                    max(i for i, s in enumerate(self.order) if s.startswith(parent)) + 1  # after its siblings
                self.order.insert(at, step)
                self.rows[step] = Row(step, shown=f"  {step[len(parent):].lstrip('_')}" if parent else step)
            return self.rows[step]

    def event(self, kind: str, step: str | None, t: float, *, reused: bool = False, error: str = "") -> Row | None:
        """A Dagster event (its `event_type_value`) of `step` at time `t`."""
        if kind in ("RUN_FAILURE", "PIPELINE_FAILURE"):
            self.run_error = self.run_error or error
            return None
        if not step:
            return None
        with self._lock:
            r = self.row(step)
            if kind == "STEP_START":
                r.state, r.mark = "running", t
                r.started = t if r.started is None else r.started
            elif kind == "STEP_RESTARTED":
                r.state, r.mark, r.attempt = "running", t, r.attempt + 1
                r.k = r.n = r.series_start = None
                r.started = t if r.started is None else r.started
            elif kind == "STEP_UP_FOR_RETRY":
                r.state, r.error = "retrying", error or r.error
            elif kind == "ASSET_MATERIALIZATION":
                r.reused = r.reused or reused
                return r
            elif kind in ("STEP_SUCCESS", "STEP_FAILURE", "STEP_SKIPPED"):
                r.state = {"STEP_SUCCESS": "reused" if r.reused else "done", "STEP_FAILURE": "failed",
                           "STEP_SKIPPED": "skipped"}[kind]
                r.ended = t if r.started is not None else None
                r.error = error if kind == "STEP_FAILURE" else r.error
                if r.state == "done" and r.n is not None:
                    r.k = r.n
            else:
                return None
        if r.state in FINAL and self.on_final is not None:
            self.on_final(r)
        return r

    def message(self, step: str | None, text: str, t: float) -> Row | None:
        """A log line of `step`: a "step k/N" report moves its row; a reuse notice marks it reused."""
        if not step:
            return None
        got = parse_steps(text)
        with self._lock:
            r = self.row(step)
            if "reusing the result computed by run" in text:
                r.reused = True
            if got is None or r.state != "running":
                return r
            label, k, n = got
            if r.series_start is None or label != r.label or n != r.n or (r.k is not None and k < r.k):
                r.series_start = r.mark if r.mark is not None else t  # a new series: from the (re)start or last report
            r.label, r.k, r.n, r.mark = label, k, n, t
            return r

    def finish(self) -> None:
        """The run is over: a stage that never started did not run (Dagster logs no event for a step it leaves out
        after an upstream failure)."""
        with self._lock:
            left = [r for r in self.rows.values() if r.state == "waiting"]
            for r in left:
                r.state = "skipped"
        for r in left:
            if self.on_final is not None:
                self.on_final(r)

    def line(self, r: Row, now: float | None = None) -> str:
        """One plain line of a row: what a terminal without live display prints when a stage ends."""
        now = self.clock() if now is None else now
        parts = [f"{r.name:<16}", f"{r.state}{f' (attempt {r.attempt})' if r.attempt > 1 else ''}"]
        if r.steps():
            parts.append(r.steps())
        if r.elapsed(now) is not None:
            parts.append(fmt_seconds(r.elapsed(now)))
        if r.eta(now) is not None:
            parts.append(f"~{fmt_seconds(r.eta(now))} left")
        if r.error and r.state == "retrying":  # a failure's error: the caller reports it once the run is over
            parts.append(r.error.split("\n")[0][:200])
        return "  ".join(parts)

    def render(self, now: float | None = None):
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        now = self.clock() if now is None else now
        t = Table(title=self.title or None, box=None, pad_edge=False, title_justify="left", show_edge=False)
        for c, j in (("stage", "left"), ("state", "left"), ("steps", "right"), ("", "left"), ("elapsed", "right"),
                     ("left", "right")):
            t.add_column(c, justify=j, no_wrap=True)
        with self._lock:
            for name in self.order:
                r = self.rows[name]
                sym, style = STYLE.get(r.state, ("?", ""))
                state = r.state + (f" ({r.attempt})" if r.attempt > 1 else "")
                bar = ProgressBar(total=r.n, completed=r.k or 0, width=16) if r.n else Text("")
                t.add_row(r.shown or name, Text(f"{sym} {state}", style=style), r.steps(), bar, fmt_seconds(r.elapsed(now)),
                          fmt_seconds(r.eta(now)))
        return t

    def __rich__(self):  # rich.live re-renders this on every refresh, with the time then
        return self.render()


def _reused(event) -> bool:
    if getattr(event, "event_type_value", "") != "ASSET_MATERIALIZATION":
        return False
    mat = getattr(getattr(event, "event_specific_data", None), "materialization", None)
    v = (getattr(mat, "metadata", None) or {}).get("reused")
    return getattr(v, "value", v) is True


def error_text(event) -> str:
    """The innermost cause of a step failure's error: the exception the asset or the stage raised, not Dagster's
    wrapper, without its traceback."""
    err = getattr(getattr(event, "event_specific_data", None), "error", None)
    while getattr(err, "cause", None) is not None:
        err = err.cause
    return str(getattr(err, "message", "") or "").strip()


SKIP_NOTICE = "Dependencies for step "


class RecordHandler(logging.Handler):
    """Feeds `board` from a Dagster logger's records (each carries `dagster_meta`: the step key, the Dagster event
    or None for a user message, the original message), and passes each message at or above `echo_level` to `echo`
    as "step: message" — Dagster's own events (which the board shows) only when `echo_level` is DEBUG."""

    def __init__(self, board: Board, echo: Callable[[str], None] | None = None, echo_level: int = logging.WARNING):
        super().__init__(logging.DEBUG)
        self.board, self.echo, self.echo_level = board, echo, echo_level

    def emit(self, record: logging.LogRecord) -> None:
        meta = getattr(record, "dagster_meta", None) or {}
        event, step = meta.get("dagster_event"), meta.get("step_key")
        text = str(meta.get("orig_message") or record.getMessage())
        system = event is not None or text.startswith(SKIP_NOTICE)  # what the board shows already
        if event is not None:
            step = step or getattr(event, "step_key", None)
            kind = getattr(event, "event_type_value", "")
            self.board.event(kind, step, record.created, reused=_reused(event), error=error_text(event))
        elif text.startswith(SKIP_NOTICE):  # "Dependencies for step x failed: [...]. Not executing." (no event)
            self.board.event("STEP_SKIPPED", step, record.created)
        else:
            self.board.message(step, text, record.created)
        if self.echo is not None and record.levelno >= self.echo_level and (not system or self.echo_level <= logging.DEBUG):
            self.echo(f"{step}: {text}" if step else text)


LOGGER = "temper_run"
LOG_FORMAT = "%(asctime)s - dagster - %(levelname)s - %(message)s"  # the format of Dagster's console logger


def logger_def(handlers: list[logging.Handler]):
    """A Dagster logger definition whose logger passes every record (DEBUG and up: all events) to `handlers`."""
    import dagster as dg

    @dg.logger(description="temper run: the live stage board and the run's log file")
    def temper_run(_init_context):
        lg = logging.Logger("dagster", logging.DEBUG)
        for h in handlers:
            lg.addHandler(h)
        return lg

    return temper_run


def execute_live(job, run_config: dict, instance, partition_key: str, *, log_path, console, stages: list[str],
                 echo_level: int = logging.WARNING, title: str = "", tags: dict | None = None,
                 run_id: str | None = None):
    """`job.execute_in_process` with its log going to `log_path` (appended: every record, DEBUG and up, as Dagster's
    console logger writes them, and the stage processes' own stdout and stderr) and to a `Board` of `stages` on
    `console` (a live table on a terminal; elsewhere one line per stage as it ends); records at or above
    `echo_level` are printed too; `tags` and `run_id` are the run's. Returns (the result, the board)."""
    from contextlib import nullcontext
    from pathlib import Path

    from rich.live import Live

    from stages.step import OUTPUT_ENV

    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    before = os.environ.get(OUTPUT_ENV)
    os.environ[OUTPUT_ENV] = str(log_path.resolve())  # the stage processes inherit it (stages/step.py)
    to_file = logging.FileHandler(log_path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    try:
        with _own_file(console) as con:
            live = con.is_terminal and not con.is_dumb_terminal

            def said(text: str) -> None:
                con.print(text, markup=False, highlight=False)

            board = Board(stages, title=title, on_final=None if live else (lambda r: said(board.line(r))))
            job = job.with_logger_defs({**job.loggers,
                                        LOGGER: logger_def([to_file, RecordHandler(board, said, echo_level)])})
            # (live, rich prints what this process writes to stdout / stderr above the table)
            with Live(board, console=con, transient=True, refresh_per_second=4) if live else nullcontext():
                res = job.execute_in_process(run_config={**run_config, "loggers": {LOGGER: {}}}, instance=instance,
                                             partition_key=partition_key, raise_on_error=False, tags=tags,
                                             run_id=run_id)
            board.finish()
    finally:
        if before is None:
            os.environ.pop(OUTPUT_ENV, None)
        else:
            os.environ[OUTPUT_ENV] = before
        to_file.close()
    return res, board


@contextlib.contextmanager
def _own_file(console):
    """A console like `console` on its own duplicate of `console`'s file descriptor (or `console` itself where its
    file has none): Dagster's in-process log capture points descriptors 1 and 2 at a file while the steps run and
    `tail -F`s it back, which would delay and reorder the live table's frames and copy each into the compute logs."""
    from rich.console import Console

    try:
        fd = os.dup(console.file.fileno())
    except (AttributeError, OSError, ValueError):
        yield console
        return
    with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
        yield Console(file=f, soft_wrap=console.soft_wrap)


def bar(console, transient: bool = True):
    """A rich progress bar: description, bar, k/N, elapsed, time left, and a `note` field (`add_task(..., note="")`)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("left"), TimeRemainingColumn(), TextColumn("{task.fields[note]}"), console=console,
                    transient=transient)


@contextlib.contextmanager
def step_log(console, description: str, total: int | None = None) -> Iterator[Callable[[str], None]]:
    """A `log(message)` for work that reports "step k/N" in its log lines: every message is printed (above the bar)
    and the bar follows the last k/N."""
    with bar(console) as prog:
        task = prog.add_task(description, total=total, note="")

        def log(message) -> None:
            console.print(message)
            got = parse_steps(str(message))
            if got is not None:
                prog.update(task, completed=got[1], total=got[2])

        yield log


class Counter:
    """What a `counting` bar's work calls: `advance(n)` moves it n items on (rich's Progress takes its own lock: episodes
    finish on the rollout loop's thread), `note(text)` sets its note; `done` is the count so far."""

    def __init__(self, prog, task):
        self._prog, self._task = prog, task

    def advance(self, n: int = 1) -> None:
        self._prog.advance(self._task, n)

    def __call__(self, *_args) -> None:  # an `on_done(trajectory)` hook: one item finished
        self.advance(1)

    def note(self, text: str) -> None:
        self._prog.update(self._task, note=text)

    @property
    def done(self) -> int:
        return int(next(t.completed for t in self._prog.tasks if t.id == self._task))


@contextlib.contextmanager
def counting(console, description: str, total: int | None = None) -> Iterator[Counter]:
    """A bar over countable work (episodes, runs, stages): k/N, elapsed and time left, moved by the `Counter` it
    yields. On a console that is not a terminal it draws nothing (rich's live display stays off) and the work's own
    printed lines are the record."""
    with bar(console) as prog:
        yield Counter(prog, prog.add_task(description, total=total, note=""))
