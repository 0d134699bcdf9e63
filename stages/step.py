"""One stage of an iteration in its own process, reporting to Dagster through Pipes.

The assets launch `python -m stages.step <stage>` with `dagster.PipesSubprocessClient`; the extras name the
stage, the preset and overrides, and the stage's arguments. The result comes back through Pipes: as a custom
message (`{"stage", "result"}`) and, when the extras ask for it (`materialize`), as the asset's materialisation,
with the result as its `result` JSON metadata beside the scalar fields; progress goes to the run's log via
`pipes.log`. A stage function that takes `progress` gets `progress(k, n, what)` (`progress_reporter`): a line
"<what>: progress k/n" in the run's log at most every few seconds, which `temper run` shows as the stage's k of N
(training stages report "… step k/N …" lines of their own). With `TEMPER_STAGE_OUTPUT` set (a file; `temper run`
sets it to the run's log) the child's own stdout and stderr, and its children's, are appended there instead of
reaching the terminal.

Cancellation: the child leads its own process group. On SIGINT or SIGTERM (what Dagster's Pipes client
forwards when a run is cancelled), or when its parent dies, it kills the whole group — itself, the
sandboxes and any server it started — so nothing outlives the run. Training stages save atomic
checkpoints, so a retried step resumes from the last one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

PATH_ARGS = ("out", "store_path")
OUTPUT_ENV = "TEMPER_STAGE_OUTPUT"


def _kill_group(*_args) -> None:
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(130)


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            _kill_group()
        time.sleep(0.5)


def progress_reporter(log, min_interval: float = 2.0, clock=time.monotonic):
    """`progress(k, n, what="")` → a log line "<what>: progress k/n", at most one every `min_interval` seconds
    (the first and the last, k = n, always)."""
    last: list[float] = []

    def progress(k: int, n: int, what: str = "") -> None:
        now = clock()
        if last and k < n and now - last[0] < min_interval:
            return
        last[:] = [now]
        log(f"{what + ': ' if what else ''}progress {k}/{n}")

    return progress


def redirect_output(path: str | None) -> None:
    """Append this process's stdout and stderr (file descriptors 1 and 2, inherited by its children) to `path`."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for std in (sys.stdout, sys.stderr):
        std.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_stage(stage: str, preset: str, overrides: list[str], kwargs: dict, log, metrics=None) -> dict:
    import configs
    import stages

    fn = getattr(stages, stage, None)
    if stage.startswith("_") or not callable(fn):
        raise ValueError(f"unknown stage {stage!r}")
    cfg = configs.load(preset, overrides)
    args = {k: (Path(v) if k in PATH_ARGS else v) for k, v in kwargs.items()}
    import inspect

    params = inspect.signature(fn).parameters
    if "log" in params:
        args["log"] = log
    if metrics is not None and "metrics" in params:
        args["metrics"] = metrics
    if "progress" in params:
        args["progress"] = progress_reporter(log)
    return fn(cfg, **args)


def live_metrics(spec: dict | None):
    """A `metrics(values, step)` callback that logs each training step to the stage's MLflow run as it happens
    (`spec`: {"uri", "run_id"} from the parent), or None."""
    if not spec:
        return None
    from store.tracking import Tracker

    tracker = Tracker(spec["uri"])
    return lambda values, step: tracker.log_step(spec["run_id"], values, step)


def main() -> int:
    from dagster_pipes import open_dagster_pipes

    redirect_output(os.environ.get(OUTPUT_ENV))
    if os.getpid() != os.getpgid(0):
        os.setpgid(0, 0)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _kill_group)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    with open_dagster_pipes() as pipes:
        stage = pipes.get_extra("stage")
        t0 = time.perf_counter()
        pipes.log.info(f"stage {stage} started in pid {os.getpid()}")
        out = run_stage(stage, pipes.get_extra("preset"), list(pipes.get_extra("overrides")), pipes.get_extra("kwargs"),
                        pipes.log.info, live_metrics(pipes.extras.get("mlflow")))
        out["seconds"] = round(time.perf_counter() - t0, 2)
        out = json.loads(json.dumps(out, default=str))  # plain JSON: paths and numpy scalars as text / numbers
        pipes.log.info(f"stage {stage} finished in {out['seconds']:.1f} s")
        pipes.report_custom_message({"stage": stage, "result": out})
        if pipes.get_extra("materialize"):
            pipes.report_asset_materialization(metadata=materialization_metadata(out))
    return 0


def materialization_metadata(out: dict) -> dict:
    """Pipes metadata of a stage result: every scalar field, and the whole result as `result` (JSON), which
    downstream assets read."""
    meta: dict = {"result": {"raw_value": out, "type": "json"}}
    for k, v in out.items():
        if isinstance(v, bool):
            meta[k] = {"raw_value": v, "type": "bool"}
        elif isinstance(v, int | float):
            meta[k] = {"raw_value": v, "type": "float" if isinstance(v, float) else "int"}
        elif isinstance(v, str):
            meta[k] = {"raw_value": v, "type": "path" if os.path.isabs(v) and os.path.exists(v) else "text"}
    return meta


if __name__ == "__main__":
    sys.exit(main())
