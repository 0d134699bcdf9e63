"""The running Dagster UI: a headless Chromium finds every asset of the iteration in the graph, and a run
launched and cancelled through the webserver kills its Pipes child.

One `dagster-webserver` (127.0.0.1, a free port, a throwaway DAGSTER_HOME) serves both tests and is stopped
at the end of the module.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from procs import alive, find

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ["env_specs", "verified_envs", "warm_start", "rollout_batches", "rewards", "sao_experts", "opd_student",
          "evaluation", "policy"]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def webserver(tmp_path_factory, wait_for_http):
    home = tmp_path_factory.mktemp("dagster_home")
    (home / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\nnux:\n  enabled: false\n"
        "run_coordinator:\n  module: dagster.core.run_coordinator\n  class: DefaultRunCoordinator\n"
        "concurrency:\n  pools:\n    default_limit: 1\n")
    port = _free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    log = open(home / "webserver.log", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen([sys.executable, "-m", "dagster_webserver", "-h", "127.0.0.1", "-p", str(port),
                             "-m", "pipelines.definitions", "-d", str(ROOT)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(proc, url + "/server_info", home / "webserver.log", 180, "dagster-webserver")
        yield {"url": url, "port": port, "home": home}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_browser_finds_every_asset(webserver, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(webserver["url"] + "/asset-groups/iteration", timeout=120_000)
            nodes = page.locator('[class*="AssetNode_assetName"]')
            deadline = time.time() + 120
            names: set[str] = set()
            while time.time() < deadline and not set(ASSETS) <= names:
                names = {t.strip() for t in nodes.all_inner_texts()}
                time.sleep(0.5)
            page.screenshot(path=str(tmp_path / "asset_graph.png"), full_page=True)
        finally:
            browser.close()
    assert set(ASSETS) <= names, f"asset graph shows {sorted(names)}"
    assert (tmp_path / "asset_graph.png").stat().st_size > 10_000
    # the edge the graph draws from one iteration to the next: policy[N] (what evaluation[N−1] hands off) → warm_start[N]
    q = ("{ assetNodes { assetKey { path } partitionDefinition { name } "
         "dependencies { asset { assetKey { path } } partitionMapping { className } } } }")
    nodes = httpx.post(webserver["url"] + "/graphql", json={"query": q}, timeout=60).json()["data"]["assetNodes"]
    deps = {"/".join(n["assetKey"]["path"]): {"/".join(d["asset"]["assetKey"]["path"]): d["partitionMapping"]
                                              for d in n["dependencies"]} for n in nodes}
    parts = {"/".join(n["assetKey"]["path"]): (n["partitionDefinition"] or {}).get("name") for n in nodes}
    assert deps["policy"] == {} and parts["policy"] == parts["warm_start"] == "iteration"
    # both on the iteration partitions, and the served graph keeps no other mapping (none: the identity, which
    # test_definitions checks on the definitions): warm_start[N] depends on policy[N]
    assert deps["warm_start"]["policy"] in (None, {"className": "IdentityPartitionMapping"})
    assert deps["env_specs"]["policy"] in (None, {"className": "IdentityPartitionMapping"})


def test_browser_walks_from_a_warm_start_to_the_evaluation_that_handed_it_off(webserver, tmp_path):
    """policy[2] as evaluation[1] records it (reported into the webserver's instance): its partition page names the
    evaluation partition and the run it came from, and warm_start[2]'s upstream in the graph is policy."""
    import dagster as dg
    from playwright.sync_api import sync_playwright

    os.environ["DAGSTER_HOME"] = str(webserver["home"])
    try:
        with dg.DagsterInstance.get() as instance:
            instance.add_dynamic_partitions("iteration", ["1", "2"])
            instance.report_runless_asset_event(dg.AssetMaterialization("policy", partition="2", metadata={
                "iteration": 1, "for_iteration": 2, "checkpoint": dg.MetadataValue.path(str(tmp_path / "student")),
                "source_partition": dg.MetadataValue.text("evaluation[1]"), "hand_off": "its student, the new champion"}))
    finally:
        del os.environ["DAGSTER_HOME"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.goto(webserver["url"] + "/assets/policy?view=partitions&partition=2", timeout=120_000)
            deadline, text = time.time() + 120, ""
            while time.time() < deadline and "evaluation[1]" not in text:
                text = page.inner_text("body")
                time.sleep(0.5)
            page.screenshot(path=str(tmp_path / "policy_partition.png"), full_page=True)
            page.goto(webserver["url"] + "/assets/warm_start?view=lineage&lineageScope=upstream", timeout=120_000)
            nodes = page.locator('[class*="AssetNode_assetName"]')
            deadline, names = time.time() + 120, set()
            while time.time() < deadline and "policy" not in names:
                names = {t.strip() for t in nodes.all_inner_texts()}
                time.sleep(0.5)
            page.screenshot(path=str(tmp_path / "warm_start_lineage.png"), full_page=True)
        finally:
            browser.close()
    assert "evaluation[1]" in text and "its student, the new champion" in text, text[:2000]
    assert {"policy", "verified_envs", "warm_start"} <= names, sorted(names)  # its parents


@pytest.mark.slow
def test_cancelling_a_run_kills_the_pipes_child(webserver, tmp_path):
    from dagster import DagsterInstance, DagsterRunStatus
    from dagster_graphql import DagsterGraphQLClient

    os.environ["DAGSTER_HOME"] = str(webserver["home"])
    try:
        with DagsterInstance.get() as instance:
            instance.add_dynamic_partitions("iteration", ["1"])
    finally:
        del os.environ["DAGSTER_HOME"]
    client = DagsterGraphQLClient("127.0.0.1", port_number=webserver["port"])
    overrides = ["train.max_steps=100000", "train.max_seconds=600", "train.batch_size=4", "envs.n_train=4",
                 "envs.n_eval=2", "envs.probes=false"]
    run_id = client.submit_job_execution(
        "iteration", tags={"dagster/partition": "1"},
        run_config={"resources": {"temper": {"config": {"preset": "micro", "overrides": overrides,
                                                        "run_root": str(tmp_path / "runs")}}}})
    deadline, child = time.time() + 240, []
    while time.time() < deadline and not child:
        child = find("stages.step", "warm_start")
        status = client.get_run_status(run_id)
        assert status not in (DagsterRunStatus.FAILURE, DagsterRunStatus.SUCCESS), f"run ended early: {status}"
        time.sleep(0.5)
    assert child, "the warm_start Pipes child never started"
    time.sleep(2)  # let it get into training
    client.terminate_run(run_id)
    deadline = time.time() + 60
    while time.time() < deadline and any(alive(p) for p in child):
        time.sleep(0.5)
    assert not any(alive(p) for p in child), "the Pipes child outlived the cancelled run"
    deadline = time.time() + 60
    while time.time() < deadline and client.get_run_status(run_id) != DagsterRunStatus.CANCELED:
        time.sleep(0.5)
    assert client.get_run_status(run_id) == DagsterRunStatus.CANCELED
    assert not (tmp_path / "runs" / "iteration-0001" / "warm_start.json").exists()  # the stage never finished
