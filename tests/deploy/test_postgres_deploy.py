"""A shared deployment on real servers: a PostgreSQL server from Debian's package (started here, on 127.0.0.1, and
stopped by the test) holds the Dagster instance (runs, event log, schedules: dagster-postgres) and MLflow's tracking
store (its SQL store), and `temper run` runs a `micro` iteration against it. The embedded SQLite default is unchanged
when the variables are unset."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pg_server import PgServer, pg_bin

ROOT = Path(__file__).resolve().parents[2]
FAST = ["train.max_steps=6", "train.batch_size=4", "envs.n_train=4", "envs.n_eval=2", "envs.probes=false",
        "loop.steps=1", "opd.steps=1", "sao.value_pretrain_steps=1", "sao.min_domain_reward=0"]


@pytest.fixture
def pg():
    bin_dir = pg_bin()
    assert bin_dir is not None, "PostgreSQL is required: apt-get install postgresql (make postgres-deps)"
    server = PgServer(bin_dir).start()
    try:
        server.create_database("dagster")
        server.create_database("mlflow")
        yield server
    finally:
        server.close()
    assert server.pid() is None and not server.dir.exists()


def test_the_default_instance_and_tracking_store_are_still_sqlite(tmp_path):
    from pipelines.ui import dagster_home, instance_yaml
    from store.tracking import artifact_root, tracking_uri

    assert instance_yaml({}) == ROOT / "dagster.yaml"
    home = dagster_home(tmp_path, env={})
    assert (home / "dagster.yaml").read_text() == (ROOT / "dagster.yaml").read_text()
    assert "storage" not in yaml.safe_load((home / "dagster.yaml").read_text())  # SQLite files in DAGSTER_HOME
    uri = tracking_uri(tmp_path / "runs", env={})
    assert uri == f"sqlite:///{(tmp_path / 'runs').resolve() / 'mlflow.db'}"
    assert artifact_root(uri, env={}) == ((tmp_path / "runs").resolve() / "mlartifacts").as_uri()
    # set: Postgres for the instance, the database for MLflow, artifacts beside the run root unless told otherwise
    env = {"TEMPER_DAGSTER_PG_URL": "postgresql+psycopg2://temper@db/dagster",
           "TEMPER_MLFLOW_URI": "postgresql+psycopg2://t@db/mlflow"}
    assert instance_yaml(env) == ROOT / "deploy" / "dagster.yaml"
    assert tracking_uri(tmp_path, env=env) == "postgresql+psycopg2://t@db/mlflow"
    assert tracking_uri(tmp_path, "sqlite:////x/m.db", env=env) == "sqlite:////x/m.db"  # the resource's own wins
    assert artifact_root("postgresql://t@db/mlflow", "file:///runs/mlartifacts", env={}) == "file:///runs/mlartifacts"
    assert artifact_root("postgresql://t@db/mlflow", "file:///r", env={"TEMPER_MLFLOW_ARTIFACTS": "s3://b/a"}) == "s3://b/a"
    assert artifact_root("http://mlflow:5000", "file:///r", env={}) is None  # a tracking server keeps its own root
    # the Postgres instance config is the default's settings plus the storage
    base, pg = yaml.safe_load((ROOT / "dagster.yaml").read_text()), yaml.safe_load(instance_yaml(env).read_text())
    assert pg.pop("storage") == {"postgres": {"postgres_url": {"env": "TEMPER_DAGSTER_PG_URL"}}}
    assert pg == base


@pytest.mark.slow
def test_an_iteration_runs_against_postgres(pg, tmp_path, monkeypatch, capsys):
    import dagster as dg
    from mlflow.tracking import MlflowClient

    from pipelines.run_cli import cmd_run

    monkeypatch.setenv("TEMPER_DAGSTER_PG_URL", pg.url("dagster"))
    monkeypatch.setenv("TEMPER_MLFLOW_URI", pg.url("mlflow"))
    monkeypatch.setenv("PGPASSWORD", pg.password)  # not in the URLs: they are recorded in run tags
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "unused"))  # `temper run` sets it: restored after the test
    monkeypatch.chdir(tmp_path)
    run_root = tmp_path / "runs" / "pipeline"
    rc = cmd_run(argparse.Namespace(preset="micro", override=FAST, iteration=None, servers=0, run_root=str(run_root),
                                    log_level="ERROR"))
    out = capsys.readouterr().out
    log = run_root / "iteration-0001" / "dagster.log"
    assert rc == 0, out[-3000:] + (log.read_text()[-5000:] if log.exists() else "")
    home = tmp_path / "runs" / "dagster_home"
    assert yaml.safe_load((home / "dagster.yaml").read_text())["storage"]["postgres"]
    assert not list(home.rglob("*.db")), list(home.rglob("*.db"))  # no SQLite run, event or schedule storage
    assert not (run_root / "mlflow.db").exists()

    # the Dagster run, its events and the partition are rows in PostgreSQL
    (run_id, status), = pg.query("dagster", "SELECT run_id, status FROM runs")
    assert status == "SUCCESS"
    events = {t for (t,) in pg.query("dagster", "SELECT DISTINCT dagster_event_type FROM event_logs WHERE run_id = %s",
                                     (run_id,))}
    kinds = dg.DagsterEventType
    assert {kinds.RUN_START.value, kinds.STEP_SUCCESS.value, kinds.ASSET_MATERIALIZATION.value,
            kinds.ASSET_CHECK_EVALUATION.value, kinds.RUN_SUCCESS.value} <= events
    materialized = {k for (k,) in pg.query("dagster", "SELECT asset_key FROM asset_keys")}
    assert {'["evaluation"]', '["policy"]', '["opd_student"]'} <= materialized
    # iteration 1, and 2: the partition evaluation[1] hands off to (policy[2])
    assert sorted(pg.query("dagster", "SELECT partition FROM dynamic_partitions WHERE partitions_def_name = 'iteration'")) \
        == [("1",), ("2",)]
    (pol,) = pg.query("dagster", "SELECT partition FROM event_logs WHERE asset_key = %s AND dagster_event_type = %s",
                      ('["policy"]', kinds.ASSET_MATERIALIZATION.value))
    assert pol == ("2",)

    # a fresh instance from the deployment's dagster.yaml (what the webserver and daemon load) sees the same run
    deploy_home = tmp_path / "deploy_home"
    deploy_home.mkdir()
    (deploy_home / "dagster.yaml").write_text((ROOT / "deploy" / "dagster.yaml").read_text())
    with dg.DagsterInstance.from_config(str(deploy_home)) as inst:
        assert inst.get_run_by_id(run_id).status == dg.DagsterRunStatus.SUCCESS
        assert inst.get_dynamic_partitions("iteration") == ["1", "2"]
        mat = inst.get_latest_materialization_event(dg.AssetKey("evaluation"))
        assert mat is not None and mat.run_id == run_id

    # schedules storage: starting a sensor (as the UI's toggle does) records its state in PostgreSQL
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    r = subprocess.run([str(Path(sys.executable).parent / "dagster"), "sensor", "start", "next_iteration_on_evaluation",
                        "-w", str(ROOT / "workspace.yaml")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (status, body), = pg.query("dagster", "SELECT status, instigator_body FROM instigators")
    assert status == "RUNNING" and '"next_iteration_on_evaluation"' in body

    # MLflow: the iteration's run, its stage runs, metrics and the registered student are in PostgreSQL
    runs = dict(pg.query("mlflow", "SELECT name, status FROM runs"))
    assert runs["iteration-1"] == "FINISHED"
    assert {"env_specs", "verified_envs", "warm_start", "rollout_batches", "opd_student", "evaluation"} <= set(runs)
    (pass_at_1,) = pg.query("mlflow", "SELECT m.value FROM latest_metrics m JOIN runs r ON r.run_uuid = m.run_uuid "
                                      "WHERE r.name = 'iteration-1' AND m.key = 'pass_at_1_after'")
    assert 0.0 <= pass_at_1[0] <= 1.0
    assert pg.query("mlflow", "SELECT name, version FROM model_versions") == [("temper-student", 1)]
    (location,), = pg.query("mlflow", "SELECT artifact_location FROM experiments WHERE name = 'temper'")
    assert location == (run_root / "mlartifacts").resolve().as_uri()  # beside the run root, not ./mlruns
    client = MlflowClient(pg.url("mlflow"))
    it_run = client.search_runs([client.get_experiment_by_name("temper").experiment_id],
                                "tags.temper_kind = 'iteration'")[0]
    assert it_run.data.tags["dagster_run_id"] == run_id
    # the run-failure sensor finds the store through the run's tag: the database URL, with no password in it
    tags = dict(pg.query("dagster", "SELECT key, value FROM run_tags WHERE run_id = %s", (run_id,)))
    assert tags["temper/mlflow_uri"] == pg.url("mlflow") and pg.password not in str(tags)


def test_a_database_url_without_its_driver_is_refused_at_launch(tmp_path, monkeypatch, capsys):
    """SQLAlchemy 2.1 opens a bare `postgresql://` with psycopg 3; dagster-postgres brings psycopg2. A URL whose driver
    is missing is refused before anything exists, naming the variable and the fix, never the password."""
    import importlib.util

    from assets.launch import LaunchRefused, check_run_config
    from pipelines.run_cli import cmd_run
    from store.tracking import sql_url_problem

    assert sql_url_problem("postgresql+psycopg2://u@h:5432/d") is None
    assert sql_url_problem("sqlite:////x/mlflow.db") is None and sql_url_problem("http://mlflow:5000") is None
    why = sql_url_problem("postgres://u:s3cret@h/d")
    assert "postgresql+psycopg2://" in why and "s3cret" not in why
    bare = sql_url_problem("postgresql://u:s3cret@h/d")
    assert (bare is None) == (importlib.util.find_spec("psycopg") is not None)
    bad = "postgres://u:s3cret@h/d"
    monkeypatch.setenv("TEMPER_MLFLOW_URI", bad)
    with pytest.raises(LaunchRefused, match="the MLflow tracking URI: SQLAlchemy cannot open a `postgres://` URL"):
        check_run_config({"resources": {"temper": {"config": {"preset": "micro"}}}})
    monkeypatch.delenv("TEMPER_MLFLOW_URI")
    monkeypatch.setenv("TEMPER_DAGSTER_PG_URL", bad)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "unused"))
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(preset="micro", override=[], iteration=None, servers=0, log_level="ERROR",
                              run_root=str(tmp_path / "runs" / "pipeline"))
    assert cmd_run(args) == 2
    said = " ".join(capsys.readouterr().out.split())
    assert "$TEMPER_DAGSTER_PG_URL: SQLAlchemy cannot open a `postgres://` URL" in said and "s3cret" not in said
    assert not (tmp_path / "runs" / "pipeline").exists()
