"""The shared-deployment recipe (deploy/): compose.yaml's services refer to each other consistently (the workspace's
gRPC server is the `code` service's port, every database URL names the `postgres` service, its role and a database
it creates, no password in a URL), the image's paths are the ones the resources assume, and Pipes into Kubernetes
can hand the stage pods the database password from a Secret. Where a compose tool is installed, `config` accepts the
file too."""

import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVICES = {"postgres", "mlflow", "code", "webserver", "daemon"}


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())  # anchors and `<<` merge keys resolved


def _opt(command: list[str], *names: str) -> str:
    for i, a in enumerate(command):
        if a in names:
            return command[i + 1]
    raise AssertionError(f"{names} not in {command}")


def test_services_refer_to_each_other_consistently():
    from store.tracking import sql_url_problem

    svc = _compose()["services"]
    assert set(svc) == SERVICES
    for name, s in svc.items():
        for dep in s.get("depends_on", {}):
            assert dep in svc, f"{name} depends on {dep}, which is not a service"
    for name in ("webserver", "daemon"):
        assert svc[name]["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                           "code": {"condition": "service_healthy"}}
        assert _opt(svc[name]["command"], "-w") == "/opt/temper/deploy/workspace.yaml"
    # the workspace's code location is the `code` service's gRPC server
    (loc,) = yaml.safe_load((DEPLOY / "workspace.yaml").read_text())["load_from"]
    grpc, code = loc["grpc_server"], svc["code"]["command"]
    assert grpc["host"] == "code" and str(grpc["port"]) == _opt(code, "-p") == "4000"
    assert grpc["location_name"] == _opt(code, "--location-name") and _opt(code, "-m") == "pipelines.definitions"
    assert svc["code"]["healthcheck"]["test"][-1] == _opt(code, "-p")
    # every database URL: the postgres service, its role, a database it creates, psycopg2, no password
    pg = svc["postgres"]["environment"]
    init = (DEPLOY / "postgres-init.sql").read_text()
    assert re.findall(r"CREATE DATABASE (\w+) OWNER (\w+);", init) == [("mlflow", pg["POSTGRES_USER"])]
    created = {pg["POSTGRES_DB"], "mlflow"}
    assert any(v.startswith("./postgres-init.sql:/docker-entrypoint-initdb.d/") for v in svc["postgres"]["volumes"])
    mlflow_cmd = svc["mlflow"]["command"]
    urls = {"dagster": [], "mlflow": [_opt(mlflow_cmd, "--backend-store-uri")]}
    for name in SERVICES - {"postgres"}:
        env = svc[name]["environment"]
        urls["dagster"].append(env["TEMPER_DAGSTER_PG_URL"])
        urls["mlflow"].append(env["TEMPER_MLFLOW_URI"])
        assert env["DAGSTER_HOME"] == "/opt/dagster_home"
        assert env["PGPASSWORD"] == pg["POSTGRES_PASSWORD"]  # the same ${TEMPER_PG_PASSWORD}
        assert "postgres" in svc[name]["depends_on"]
    for db, found in urls.items():
        assert len(set(found)) == 1, found  # every service uses the same store
        u = urlparse(found[0])
        assert u.scheme == "postgresql+psycopg2" and u.hostname == "postgres" and u.port == 5432
        assert u.username == pg["POSTGRES_USER"] and u.password is None and u.path == f"/{db}"
        assert db in created
        assert sql_url_problem(found[0]) is None  # its driver is installed
    assert urls["dagster"][0] != urls["mlflow"][0]
    # the run root volume, where runs write and where MLflow's server reads the artifacts
    for name in ("code", "mlflow"):
        assert "runs:/opt/temper/runs" in svc[name]["volumes"]
    assert set(_compose()["volumes"]) == {"pgdata", "runs"}
    for name, port in (("webserver", 3000), ("mlflow", 5000)):
        (published,) = svc[name]["ports"]
        assert published.startswith("127.0.0.1:") and published.endswith(f":{port}")
        assert _opt(svc[name]["command"], "-p", "--port") == str(port)


def test_the_image_holds_what_the_services_run():
    from assets import StageRunner, TemperResource

    docker = (DEPLOY / "Dockerfile").read_text()
    assert "WORKDIR /opt/temper" in docker and StageRunner().workdir == "/opt/temper"  # the k8s pods' repository
    assert "DAGSTER_HOME=/opt/dagster_home" in docker
    assert 'cp /opt/temper/deploy/dagster.yaml "$DAGSTER_HOME/dagster.yaml"' in docker
    assert not Path(TemperResource().run_root).is_absolute()  # runs/pipeline under WORKDIR: the `runs` volume
    # the instance config: the default's settings, storage in PostgreSQL at TEMPER_DAGSTER_PG_URL
    inst = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    assert inst["storage"] == {"postgres": {"postgres_url": {"env": "TEMPER_DAGSTER_PG_URL"}}}
    bin_ = Path(sys.executable).parent
    for name, s in _compose()["services"].items():
        if name != "postgres":
            assert s["image"].startswith("${TEMPER_IMAGE:-temper:")
            assert s["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
            assert (bin_ / s["command"][0]).is_file(), s["command"][0]  # the venv's console script
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "runs"} <= set(ignored) and "checkpoints" not in ignored  # the shipped base goes in


def test_compose_config_accepts_the_file_where_a_compose_tool_exists(tmp_path):
    """`docker compose config` (v2) or `docker-compose config` (1.29, Debian's package); CI's Debian image has
    neither, so there the structural checks above stand alone."""
    tools = []
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        tools.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        tools.append(["docker-compose"])
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "TEMPER_PG_PASSWORD": "x", "HOME": str(tmp_path)}
    for tool in tools:
        r = subprocess.run([*tool, "-f", str(DEPLOY / "compose.yaml"), "config"], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        assert set(yaml.safe_load(r.stdout)["services"]) == SERVICES
        r = subprocess.run([*tool, "-f", str(DEPLOY / "compose.yaml"), "config"], capture_output=True, text=True,
                           env={**env, "TEMPER_PG_PASSWORD": ""}, timeout=60)
        assert r.returncode != 0 and "TEMPER_PG_PASSWORD" in r.stderr  # no deployment without a password


def test_k8s_stage_pods_get_the_database_password_from_a_secret(tmp_path, monkeypatch):
    from assets import StageRunner
    from assets.resources import _libpq_env

    cmd = ["python", "-m", "stages.step", "sao_expert"]
    pod = StageRunner(kind="k8s", image="registry.example/temper:1", env_secret="temper-db").pod("sao_expert", cmd, {},
                                                                                               tmp_path)
    (src,) = pod.spec.containers[0].env_from
    assert src.secret_ref.name == "temper-db"
    assert "PGPASSWORD" not in str(pod.to_dict())
    assert StageRunner(kind="k8s", image="x").pod("sao_expert", cmd, {}, tmp_path).spec.containers[0].env_from is None
    for k in ("PGUSER", "PGSSLMODE", "PGSSLROOTCERT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PGPASSWORD", "pw")  # a stage container on this machine (kind docker) gets the parent's
    monkeypatch.setenv("TEMPER_UNRELATED", "x")
    assert _libpq_env() == {"PGPASSWORD": "pw"}
