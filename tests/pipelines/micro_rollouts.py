"""A `micro` iteration up to its stored rollouts, for the pipeline tests that start from them."""

import torch

import stages
from model import Transformer, save_checkpoint
from rollout.backend import embedded_servers


def stored_rollouts(cfg, tmp_path, iteration: int):
    """Environments (gated), a random policy at `tmp_path/policy` and its rollouts in `tmp_path/t.duckdb`:
    (envs, store path, rollout_batches' result)."""
    specs = stages.env_specs(cfg, tmp_path / "envs")
    envs = stages.verified_envs(cfg, specs, tmp_path / "verified")
    torch.manual_seed(1)
    save_checkpoint(Transformer(cfg.model), tmp_path / "policy", policy_version=1)
    store = tmp_path / "t.duckdb"
    with embedded_servers(cfg.model, n=1, n_slots=4, max_len=cfg.agent.max_context + 8, seed=5) as urls:
        ro = stages.rollout_batches(cfg, str(tmp_path / "policy"), envs, store, iteration=iteration, urls=urls)
    return envs, store, ro


def alternating_warm_rollouts(store, iteration: int, ro) -> tuple[str, list[str]]:
    """The domain with the most stored rollouts, and the ids of copies of them stored with rewards 0, 1, 0, …: a
    random policy's SAO steps on them get a signal. Returns (domain, copy ids)."""
    from store import TrajectoryStore

    scored = stages.rewards(store, iteration, ro["trajectory_ids"])
    dom = max(scored["domains"], key=lambda k: scored["domains"][k]["trajectories"])
    with TrajectoryStore(store) as st:
        trajs = st.read(iteration, ids=scored["domains"][dom]["ids"])
        for i, t in enumerate(trajs):
            t.trajectory_id, t.reward = f"{t.trajectory_id}-r", float(i % 2)
        st.write(trajs)
    return dom, [t.trajectory_id for t in trajs]
