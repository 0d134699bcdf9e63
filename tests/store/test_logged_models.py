"""The student and each SAO expert are MLflow 3 LoggedModels: metrics on the model tied to their dataset (name and
sha256), the datasets as the producing run's inputs, the student registered from `models:/<id>` with the `champion`
alias; and the MLflow UI's model page shows them (a real `mlflow server` on 127.0.0.1, read by headless Chromium)."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from store.tracking import Tracker, dataset_digest, pass_at_1_metrics

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SUMMARIES = {"code": {"pass@1": 0.5, "k": 2, "n": 4, "ci95": [0.15, 0.85]},
             "math": {"pass@1": 0.75, "k": 3, "n": 4, "ci95": [0.3, 0.95]},
             "all": {"pass@1": 0.625, "k": 5, "n": 8, "ci95": [0.31, 0.86]}}


def _dataset(path: Path, lines: list[str]) -> str:
    """An env dataset directory as envs/dataset.py writes it; returns the sha256 of its specs file."""
    path.mkdir(parents=True)
    data = "".join(line + "\n" for line in lines).encode()
    (path / "specs.jsonl").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    (path / "manifest.json").write_text(json.dumps({"n": len(lines), "sha256": digest}))
    return digest


def _checkpoint(path: Path, payload: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(payload)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def logged(tmp_path):
    """An iteration as evaluation logs it: the student (registered, champion) and one expert."""
    held_sha = _dataset(tmp_path / "envs" / "eval", ['{"id": "h1"}', '{"id": "h2"}'])
    rl_sha = _dataset(tmp_path / "verified" / "rl", ['{"id": "r1"}'])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tr = Tracker(uri)
    it_run = tr.start("iteration-1")
    opd_run = tr.start("opd_student", parent_run_id=it_run)
    sao_run = tr.start("sao_expert_code", parent_run_id=it_run)
    sets = {"iteration-1-held_out": (tmp_path / "envs" / "eval", "evaluation"),
            "iteration-1-rl": (tmp_path / "verified" / "rl", "training")}
    student = _checkpoint(tmp_path / "student", b"student weights")
    reg = tr.register_student("temper-student", it_run, str(student), 0.7, significant=True, p_value=0.01,
                              model_run_id=opd_run, datasets=sets,
                              metrics={"iteration-1-held_out": pass_at_1_metrics(SUMMARIES),
                                       "iteration-1-rl": {"train_reverse_kl_final": 0.125}})
    expert = _checkpoint(tmp_path / "expert_code", b"expert weights")
    expert_id = tr.log_model("temper-expert-code", sao_run, expert, datasets=sets, copy=False,
                             metrics={"iteration-1-held_out": pass_at_1_metrics({"code": SUMMARIES["code"]}),
                                      "iteration-1-rl": {"train_reward_final": 0.4}})
    return {"tr": tr, "uri": uri, "reg": reg, "expert_id": expert_id, "opd_run": opd_run, "sao_run": sao_run,
            "it_run": it_run, "held": held_sha, "rl": rl_sha, "expert": expert, "sets": sets, "tmp": tmp_path}


def test_student_is_a_logged_model_with_metrics_datasets_and_a_registered_version(logged):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(logged["uri"])  # a fresh client: what the store holds, not what the Tracker remembers
    mid, held, rl = logged["reg"]["model_id"], logged["held"][:36], logged["rl"][:36]
    lm = client.get_logged_model(mid)
    assert lm.name == "temper-student" and str(lm.status).endswith("READY")
    assert lm.source_run_id == logged["opd_run"] and lm.tags["temper_run"] == logged["it_run"]
    got = {(m.key, m.dataset_name, m.dataset_digest): m.value for m in lm.metrics}
    assert got == {
        ("pass_at_1", "iteration-1-held_out", held): 0.625,
        ("pass_at_1_ci95_lo", "iteration-1-held_out", held): 0.31,
        ("pass_at_1_ci95_hi", "iteration-1-held_out", held): 0.86,
        ("pass_at_1_code", "iteration-1-held_out", held): 0.5,
        ("pass_at_1_code_ci95_lo", "iteration-1-held_out", held): 0.15,
        ("pass_at_1_code_ci95_hi", "iteration-1-held_out", held): 0.85,
        ("pass_at_1_math", "iteration-1-held_out", held): 0.75,
        ("pass_at_1_math_ci95_lo", "iteration-1-held_out", held): 0.3,
        ("pass_at_1_math_ci95_hi", "iteration-1-held_out", held): 0.95,
        ("train_reverse_kl_final", "iteration-1-rl", rl): 0.125,
        ("champion_score", None, None): 0.7,
    }
    assert all(m.run_id == logged["opd_run"] and m.model_id == mid for m in lm.metrics)
    # the datasets are the producing run's inputs, by name and the sha256 their manifests record
    run = client.get_run(logged["opd_run"])
    inputs = {d.dataset.name: (d.dataset.digest, d.dataset.source, {t.key: t.value for t in d.tags})
              for d in run.inputs.dataset_inputs}
    assert inputs == {
        "iteration-1-held_out": (held, (logged["tmp"] / "envs" / "eval").resolve().as_uri(),
                                 {"mlflow.data.context": "evaluation"}),
        "iteration-1-rl": (rl, (logged["tmp"] / "verified" / "rl").resolve().as_uri(), {"mlflow.data.context": "training"}),
    }
    assert [o.model_id for o in run.outputs.model_outputs] == [mid]
    # the model's artifacts are a copy of the checkpoint
    where = Path(urlparse(lm.artifact_location).path)
    assert (where / "model.safetensors").read_bytes() == b"student weights"
    # registered from models:/<id>, linked both ways, with the champion alias
    mv = client.get_model_version("temper-student", str(logged["reg"]["version"]))
    assert mv.source == f"models:/{mid}" == logged["reg"]["model_uri"]
    # (MLflow's SQL registry keeps no model_id column: the version points at the model by its source and tag)
    assert mv.run_id == logged["opd_run"] and mv.tags["logged_model_id"] == mid
    assert json.loads(lm.tags["mlflow.modelVersions"]) == [{"name": "temper-student", "version": mv.version}]
    assert client.get_model_version_by_alias("temper-student", "champion").version == mv.version
    assert logged["reg"]["champion_moved"]


def test_expert_is_a_logged_model_referencing_its_checkpoint(logged):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(logged["uri"])
    lm = client.get_logged_model(logged["expert_id"])
    held, rl = logged["held"][:36], logged["rl"][:36]
    assert lm.name == "temper-expert-code" and lm.source_run_id == logged["sao_run"]
    got = {(m.key, m.dataset_name, m.dataset_digest): m.value for m in lm.metrics}
    assert got == {("pass_at_1_code", "iteration-1-held_out", held): 0.5,
                   ("pass_at_1_code_ci95_lo", "iteration-1-held_out", held): 0.15,
                   ("pass_at_1_code_ci95_hi", "iteration-1-held_out", held): 0.85,
                   ("train_reward_final", "iteration-1-rl", rl): 0.4}
    where = Path(urlparse(lm.artifact_location).path)
    assert sorted(p.name for p in where.iterdir()) == ["checkpoint.json"]  # referenced, not copied
    assert json.loads((where / "checkpoint.json").read_text())["checkpoint"] == str(logged["expert"].resolve())
    assert lm.params["checkpoint"] == str(logged["expert"].resolve())
    assert "mlflow.modelVersions" not in lm.tags  # experts are not registered
    assert {d.dataset.name for d in client.get_run(logged["sao_run"]).inputs.dataset_inputs} == set(logged["sets"])


def test_a_later_student_without_significance_is_registered_but_not_champion(logged):
    from mlflow.tracking import MlflowClient

    tr, tmp = logged["tr"], logged["tmp"]
    reg2 = tr.register_student("temper-student", logged["it_run"], str(_checkpoint(tmp / "student2", b"s2")), 0.9,
                               significant=False, p_value=0.2)
    client = MlflowClient(logged["uri"])
    mv2 = client.get_model_version("temper-student", str(reg2["version"]))
    assert reg2["version"] == logged["reg"]["version"] + 1 and mv2.source == f"models:/{reg2['model_id']}"
    assert mv2.run_id == logged["it_run"]  # no model_run_id: the model comes from the given run
    assert str(client.get_model_version_by_alias("temper-student", "champion").version) == str(logged["reg"]["version"])
    assert not reg2["champion_moved"]


def test_metrics_on_an_unknown_dataset_are_refused(logged):
    with pytest.raises(ValueError, match="not given"):
        logged["tr"].log_model("m", logged["it_run"], logged["expert"], metrics={"nope": {"x": 1.0}}, copy=False)


def test_dataset_digest_reads_the_manifest_else_hashes_the_files(tmp_path):
    sha = _dataset(tmp_path / "a", ['{"id": 1}'])
    assert dataset_digest(tmp_path / "a") == sha
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.txt").write_text("one")
    first = dataset_digest(tmp_path / "b")
    assert len(first) == 64 and first == dataset_digest(tmp_path / "b")
    (tmp_path / "b" / "x.txt").write_text("two")
    assert dataset_digest(tmp_path / "b") != first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_mlflow_ui_model_page_shows_metrics_datasets_and_version(logged, wait_for_http):
    from playwright.sync_api import sync_playwright

    tmp, port = logged["tmp"], _free_port()
    log = open(tmp / "mlflow_server.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", logged["uri"]], cwd=tmp,
                            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(proc, url + "/health", tmp / "mlflow_server.log", 120, "mlflow server")
        exp, mid = logged["tr"].experiment_id, logged["reg"]["model_id"]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            try:
                page = browser.new_page(viewport={"width": 1600, "height": 1200})
                page.goto(f"{url}/#/experiments/{exp}/models/{mid}", timeout=120_000)
                want = ["Metrics (11)", "pass_at_1_code_ci95_hi", "iteration-1-held_out", "iteration-1-rl",
                        "temper-student", f"v{logged['reg']['version']}"]
                deadline, text = time.time() + 90, ""
                while time.time() < deadline and not all(w in text for w in want):
                    text = page.inner_text("body")
                    time.sleep(0.5)
                page.screenshot(path=str(tmp / "model_page.png"), full_page=True)
            finally:
                browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    missing = [w for w in want if w not in text]
    assert not missing, f"the model page lacks {missing}:\n{text[:3000]}"
    assert "Not registered" not in text
