"""`make ui`: Dagster's UI (webserver + daemon for schedules/sensors) and MLflow's, on 127.0.0.1.

Both run as child process groups; Ctrl-C or SIGTERM stops them cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PG_URL_ENV = "TEMPER_DAGSTER_PG_URL"  # set: the instance keeps runs, events and schedules in this PostgreSQL database


def instance_yaml(env=None) -> Path:
    """The instance config: the project's dagster.yaml (SQLite files in DAGSTER_HOME, the default), or with
    $TEMPER_DAGSTER_PG_URL set deploy/dagster.yaml, the same settings with dagster-postgres storage at that URL."""
    env = os.environ if env is None else env
    repo = Path(__file__).resolve().parents[1]  # works from any cwd
    if not env.get(PG_URL_ENV):
        return repo / "dagster.yaml"
    from store.tracking import sql_url_problem

    if why := sql_url_problem(env[PG_URL_ENV]):
        raise ValueError(f"${PG_URL_ENV}: {why}")
    return repo / "deploy" / "dagster.yaml"


# The instance config's settings, for an installed temper: the wheel ships neither dagster.yaml (they sit in the
# repository, beside pyproject.toml and in deploy/, not in a package). tests/test_packaging.py checks that an installed
# temper writes what the checkout's two files say.
INSTANCE_SETTINGS = {"telemetry": {"enabled": False}, "nux": {"enabled": False},
                     "concurrency": {"pools": {"default_limit": 1}}}  # the duckdb_writer pool: one writer at a time
PG_STORAGE = {"postgres": {"postgres_url": {"env": PG_URL_ENV}}}


def instance_text(env=None) -> str:
    """The instance config's text: the checkout's file (`instance_yaml`), or where temper is installed from a wheel,
    which does not ship it, the same settings (`INSTANCE_SETTINGS`, plus `PG_STORAGE` with $TEMPER_DAGSTER_PG_URL)."""
    env = os.environ if env is None else env
    path = instance_yaml(env)  # checks $TEMPER_DAGSTER_PG_URL first
    if path.is_file():
        return path.read_text()
    import yaml

    cfg = {**INSTANCE_SETTINGS, **({"storage": PG_STORAGE} if env.get(PG_URL_ENV) else {})}
    return "# written by temper (pipelines/ui.py: INSTANCE_SETTINGS)\n" + yaml.safe_dump(cfg, sort_keys=False)


def dagster_home(root: Path, env=None) -> Path:
    """`runs/dagster_home` with the instance config (`instance_text`): the instance both `make ui` and `temper run`
    use."""
    home = root / "runs" / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(instance_text(env))
    return home


DAGSTER_PORT, MLFLOW_PORT = 3000, 5000  # `make ui`'s defaults (make ui DAGSTER_PORT=… MLFLOW_PORT=…)


def ui_urls(env=None) -> tuple[str, str]:
    """Where `make ui` serves Dagster and MLflow: $TEMPER_DAGSTER_UI and $TEMPER_MLFLOW_UI (`make ui` and `make run`
    set them from their DAGSTER_PORT and MLFLOW_PORT), else the defaults on 127.0.0.1."""
    env = os.environ if env is None else env
    return (env.get("TEMPER_DAGSTER_UI") or f"http://127.0.0.1:{DAGSTER_PORT}",
            env.get("TEMPER_MLFLOW_UI") or f"http://127.0.0.1:{MLFLOW_PORT}")


def commands(root: Path, host: str, dagster_port: int, mlflow_port: int) -> list[list[str]]:
    """The webserver, the daemon (sensors) and the MLflow server, on `host`; MLflow serves the store the runs
    track into (`runs/pipeline/mlflow.db`, or $TEMPER_MLFLOW_URI's database)."""
    from store.tracking import tracking_uri

    bin_ = Path(sys.executable).parent
    workspace = str(Path(__file__).resolve().parents[1] / "workspace.yaml")
    return [
        [str(bin_ / "dagster-webserver"), "-w", workspace, "-h", host, "-p", str(dagster_port)],
        [str(bin_ / "dagster-daemon"), "run", "-w", workspace],
        [str(bin_ / "mlflow"), "server", "--host", host, "--port", str(mlflow_port), "--workers", "1",
         "--backend-store-uri", tracking_uri(root / "runs" / "pipeline")],
    ]


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="make ui", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--dagster-port", type=int, default=DAGSTER_PORT)
    ap.add_argument("--mlflow-port", type=int, default=MLFLOW_PORT)
    args = ap.parse_args(argv)
    root = Path.cwd()
    try:
        home = dagster_home(root)
    except ValueError as e:  # $TEMPER_DAGSTER_PG_URL names a database SQLAlchemy cannot open
        print(f"error: {e}", file=sys.stderr)
        return 2
    (root / "runs" / "pipeline").mkdir(parents=True, exist_ok=True)
    mlflow_ui = f"http://{args.host}:{args.mlflow_port}"
    env = {**os.environ, "DAGSTER_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DAGSTER_DISABLE_TELEMETRY": "true",
           "TEMPER_MLFLOW_UI": mlflow_ui,  # run links in asset metadata point at this MLflow UI
           "TEMPER_DAGSTER_UI": f"http://{args.host}:{args.dagster_port}"}
    procs = [subprocess.Popen(c, env=env, start_new_session=True)
             for c in commands(root, args.host, args.dagster_port, args.mlflow_port)]
    print(f"Dagster UI: http://{args.host}:{args.dagster_port}  ·  MLflow UI: {mlflow_ui}  (Ctrl-C to stop)",
          flush=True)
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
