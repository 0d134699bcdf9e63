"""Faults: SIGKILL the pipeline's child process once during each long stage — validation, SFT, rollouts, SAO,
OPD — in one iteration. Dagster retries each killed step, each resumes from what the killed attempt kept
(cached verdicts, the SFT and RL checkpoints, the rollouts stored so far), and the trajectory store ends with
every row once: no trajectory lost, none duplicated, no training step's consumption counted twice.
"""

import json
import os
import signal
import threading
import time
from collections import Counter

import dagster as dg
import pytest
from procs import find

from assets import ALL_ASSETS, ITERATIONS, TemperResource
from pipelines.definitions import make_resources
from store import TrajectoryStore
from trainers.checkpoint import complete_checkpoints

OVER = ["train.max_steps=60", "train.batch_size=4", "envs.n_train=4", "envs.n_rl=40", "envs.n_eval=2",
        "envs.probes=false", "loop.steps=3", "loop.save_every=1", "opd.steps=3", "sao.value_pretrain_steps=1",
        "sao.min_domain_reward=0"]


@pytest.mark.slow
def test_sigkill_during_each_long_stage_loses_and_duplicates_nothing(tmp_path):
    runs = tmp_path / "runs"
    it = runs / "iteration-0001"

    def rollouts_half_stored() -> bool:
        p = runs / "rollouts-0001.progress.json"
        if not p.exists():
            return False
        try:
            prog = json.loads(p.read_text())
        except ValueError:
            return False
        return 0 < prog["stored"] < prog["total"]

    # stage name in the child's command line -> the moment it is killed (something kept, not yet finished)
    when = {
        "verified_envs": lambda: len(list((it / "verified" / "reports").glob("*.json"))) >= 2,
        "warm_start": lambda: complete_checkpoints(it / "warm_start" / "state"),
        "rollout_batches": rollouts_half_stored,
        "sao_expert": lambda: any(complete_checkpoints(p / "state") for p in (it / "experts").glob("*")),
        "opd_student": lambda: complete_checkpoints(it / "student" / "state"),
    }
    killed: dict[str, int] = {}
    stop = threading.Event()

    def killer():
        while not stop.is_set():
            for stage, ready in when.items():
                if stage in killed:
                    continue
                mine = find("stages.step", f" {stage}")
                if mine and ready():
                    for pid in mine:
                        os.kill(pid, signal.SIGKILL)
                    killed[stage] = mine[0]
            time.sleep(0.02)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    (tmp_path / "dagster").mkdir()
    try:
        with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
            instance.add_dynamic_partitions(ITERATIONS.name, ["1"])
            res = dg.materialize(ALL_ASSETS, partition_key="1", instance=instance, raise_on_error=False,
                                 resources=make_resources(TemperResource(preset="micro", overrides=OVER,
                                                                         run_root=str(runs))))
    finally:
        stop.set()
        th.join(timeout=5)
    assert set(killed) == set(when), f"stages never caught mid-way: {set(when) - set(killed)}"
    assert res.success
    retried = Counter(e.step_key for e in res.all_events if e.event_type_value == "STEP_UP_FOR_RETRY")
    assert retried == Counter({"verified_envs": 1, "warm_start": 1, "rollout_batches": 1, "sao_experts": 1,
                               "opd_student": 1})
    mats = {e.asset_key.to_user_string(): e.materialization.metadata for e in res.get_asset_materialization_events()}
    ve, ws, ro = (mats[k]["result"].value for k in ("verified_envs", "warm_start", "rollout_batches"))
    assert ve["verdicts_reused"] >= 2 and ws["resumed_from_step"] >= 20 and ro["resumed_with"] >= 16
    assert mats["opd_student"]["result"].value["resumed_from_step"] >= 1

    with TrajectoryStore(runs / "trajectories.duckdb", read_only=True) as st:
        trajs = st.read(1)
        rows = st.consumption()
    ids = [t.trajectory_id for t in trajs]
    assert len(ids) == len(set(ids))
    # rollouts: exactly one per admitted RL environment, whichever attempt generated it
    rollouts = [t for t in trajs if t.trajectory_id.startswith("rollout-1-")]
    assert len(rollouts) == ve["accepted_rl"] == len({t.env_id for t in rollouts}) == ro["trajectories"]
    # training: every step of every consumer once, each with its whole batch, and every consumed trajectory stored
    have = set(ids)
    assert all(r["trajectory_id"] in have for r in rows)
    per_step = Counter((r["consumer"], r["step"]) for r in rows if r["step"] is not None)
    consumers = {c for c, _ in per_step}
    assert "opd" in consumers and any(c.startswith("sao:") for c in consumers)
    for c in consumers:
        steps = sorted(s for cc, s in per_step if cc == c)
        assert steps == [1, 2, 3], (c, steps)
        assert all(per_step[(c, s)] == 4 for s in steps), (c, [per_step[(c, s)] for s in steps])
    assert not [k for k, n in Counter((r["trajectory_id"], r["consumer"], r["outcome"]) for r in rows).items() if n > 1]

