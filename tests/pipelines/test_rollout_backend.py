"""The rollout backend: two embedded servers behind temper's Router serve the rollout stage exactly as
SGLang URLs would (weights loaded through /update_weights_from_disk, trajectories into DuckDB)."""

import dagster as dg
import pytest
import torch

import configs
from assets import RolloutBackend
from model import Transformer, save_checkpoint
from pipelines import stages
from rollout.backend import embedded_servers
from store import TrajectoryStore


def test_rollouts_through_two_servers_by_url(tmp_path):
    cfg = configs.load("micro", ["envs.n_train=6", "envs.n_eval=1", "envs.probes=false"])
    specs = stages.env_specs(cfg, tmp_path / "envs")
    envs = stages.verified_envs(cfg, specs, tmp_path / "verified")
    torch.manual_seed(1)
    save_checkpoint(Transformer(cfg.model), tmp_path / "policy", policy_version=1)
    with embedded_servers(cfg.model, n=2, n_slots=4, max_len=cfg.agent.max_context + 8, seed=5) as urls:
        assert len(set(urls)) == 2
        out = stages.rollout_batches(cfg, str(tmp_path / "policy"), envs, tmp_path / "t.duckdb", iteration=7, urls=urls)
    assert out["trajectories"] == envs["accepted"] > 0 and out["workers"] == urls
    with TrajectoryStore(tmp_path / "t.duckdb", read_only=True) as st:
        trajs = st.read(iteration=7)
    assert len(trajs) == out["trajectories"]
    versions = {v for t in trajs for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m}
    assert versions == {7}  # every generated token came from the weights loaded for this iteration


def test_sglang_backend_needs_urls():
    cfg = configs.load("micro")
    with pytest.raises(dg.Failure, match="needs `urls`"), RolloutBackend(kind="sglang").serving(cfg):
        pass
    with RolloutBackend(kind="sglang", urls=["http://10.0.0.1:30000"], router_url="http://10.0.0.1:30001").serving(cfg) as (u, r):
        assert u == ["http://10.0.0.1:30000"] and r == "http://10.0.0.1:30001"
