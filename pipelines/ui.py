"""`make ui`: Dagster's UI (webserver + daemon for schedules/sensors) and MLflow's, on 127.0.0.1.

Both run as child process groups; Ctrl-C or SIGTERM stops them cleanly.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def dagster_home(root: Path) -> Path:
    """`runs/dagster_home` with the project's dagster.yaml: the instance both `make ui` and `temper run` use."""
    home = root / "runs" / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "dagster.yaml", home / "dagster.yaml")  # works from any cwd
    return home


def main() -> int:
    root = Path.cwd()
    home = dagster_home(root)
    (root / "runs" / "pipeline").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DAGSTER_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DAGSTER_DISABLE_TELEMETRY": "true"}
    bin_ = Path(sys.executable).parent
    cmds = [
        [str(bin_ / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", "3000"],
        [str(bin_ / "dagster-daemon"), "run", "-w", "workspace.yaml"],
        [str(bin_ / "mlflow"), "server", "--host", "127.0.0.1", "--port", "5000", "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'runs' / 'pipeline' / 'mlflow.db'}"],
    ]
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in cmds]
    print("Dagster UI: http://127.0.0.1:3000  ·  MLflow UI: http://127.0.0.1:5000  (Ctrl-C to stop)", flush=True)
    stop = {"now": False}

    def handler(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    try:
        while not stop["now"] and all(p.poll() is None for p in procs):
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
