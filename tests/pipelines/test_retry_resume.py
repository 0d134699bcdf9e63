"""A long step killed mid-training fails, is retried by Dagster, and resumes from its last checkpoint."""

import os
import signal
import threading
import time

import dagster as dg
import pytest
from procs import find

from assets import ALL_ASSETS, ITERATIONS, TemperResource
from pipelines.definitions import make_resources
from trainers.checkpoint import complete_checkpoints

FAST = ["train.max_steps=6", "train.batch_size=4", "envs.n_train=4", "envs.n_eval=2", "envs.probes=false",
        "loop.steps=3", "loop.save_every=1", "sao.value_pretrain_steps=1", "sao.min_domain_reward=0"]


@pytest.mark.slow
def test_killed_sao_step_is_retried_and_resumes(tmp_path):
    runs = tmp_path / "runs"
    state = runs / "iteration-0001" / "experts" / "math" / "state"
    killed: list[int] = []

    def killer():
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            if state.exists() and complete_checkpoints(state):
                for pid in find("stages.step", "sao_expert"):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        instance.add_dynamic_partitions(ITERATIONS.name, ["1"])
        res = dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.keys("sao_experts").upstream(), partition_key="1",
                             instance=instance, raise_on_error=False,
                             resources=make_resources(TemperResource(preset="micro", overrides=FAST, run_root=str(runs))))
    th.join(timeout=5)
    assert killed, "the SAO child never reached its first checkpoint"
    assert res.success
    retried = [e for e in res.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    assert [e.step_key for e in retried] == ["sao_experts"]
    meta = {e.asset_key.to_user_string(): e.materialization.metadata
            for e in res.get_asset_materialization_events()}["sao_experts"]
    resumed = meta["math_resumed_from_step"].value
    assert 1 <= resumed < 3  # continued from the checkpoint, not from scratch
    assert meta["math_steps"].value == 3  # the restored history plus the steps after the retry
