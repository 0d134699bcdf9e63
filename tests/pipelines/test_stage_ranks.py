"""`trainer.world_size > 1` in the pipeline: a training stage re-launches itself under torchrun (gloo on CPU).

The SAO expert's first step trains on the stored rollouts (`loop.warm_rollouts=train`), a batch fixed before the
stage starts, so one rank and two ranks must take the same step: rank 1 trains on its share of the batch and the
gradients are averaged. Their checkpoints agree to float rounding, the ranks agree with each other bit for bit,
and rank 0 alone writes the store.
"""

import torch
from micro_rollouts import stored_rollouts

import configs
import stages
from model import Transformer, load_checkpoint
from store import TrajectoryStore


def _update_gap(a: dict, b: dict, init: dict) -> tuple[float, float]:
    """(largest |update| of run a, share of the weights where the two runs' updates differ by more than 1% of that).
    Adam's first steps move each weight by about lr·g/(|g| + eps): an element whose gradient is within rounding of
    zero may land anywhere in ±lr on another reduction order (CI saw one 1.75e-5 off in a 1e-3 step), so the test
    counts such weights instead of taking the largest difference; ranks that did not share their gradients would
    differ almost everywhere."""
    moved = max(float((a[k] - init[k]).abs().max()) for k in a)
    off = sum(int(((a[k] - b[k]).abs() > moved / 100).sum()) for k in a)
    return moved, off / sum(v.numel() for v in a.values())


def test_sao_expert_under_torchrun_takes_the_one_rank_step(tmp_path):
    over = ["envs.n_train=8", "envs.n_eval=1", "envs.probes=false", "loop.steps=1", "sao.value_pretrain_steps=1",
            "loop.warm_rollouts=train", "sao.lr=1e-3", "sao.warmup_steps=0"]
    cfg = configs.load("micro", over)
    envs, store, ro = stored_rollouts(cfg, tmp_path, iteration=2)
    scored = stages.rewards(store, 2, ro["trajectory_ids"])
    dom = max(scored["domains"], key=lambda k: scored["domains"][k]["trajectories"])
    # a random policy earns nothing: copies of the stored rollouts with alternating rewards give the step a signal
    with TrajectoryStore(store) as st:
        trajs = st.read(2, ids=scored["domains"][dom]["ids"])
        for i, t in enumerate(trajs):
            t.trajectory_id, t.reward = f"{t.trajectory_id}-r", float(i % 2)
        st.write(trajs)
    warm = [t.trajectory_id for t in trajs]
    assert len(warm) >= 2

    lines, curves = [], []
    runs = {}
    for world in (1, 2):
        c = configs.load("micro", over + [f"trainer.world_size={world}"])
        runs[world] = stages.sao_expert(c, str(tmp_path / "policy"), envs, dom, tmp_path / f"w{world}",
                                        store_path=store, iteration=2, warm_rollouts=warm,
                                        log=lines.append, metrics=lambda v, s: curves.append((v, s)))
    one, two = runs[1], runs[2]
    assert "trainer_ranks" not in one and two["trainer_ranks"] == 2 and len(set(two["rank_checksums"])) == 1
    assert two["steps"] == one["steps"] == 1 and two["updates"] == 1
    # rank 0's progress reached the launching process's log and metrics
    assert any("2 trainer ranks under torchrun" in m for m in lines) and any("SAO step 1/1" in m for m in lines)
    assert len(curves) == 2 and curves[1][0]["batch_reward"] == curves[0][0]["batch_reward"]
    for k in ("entropy", "value_loss", "clip_frac", "kl"):  # the batch's figures, not rank 0's half of them
        assert abs(curves[1][0][k] - curves[0][0][k]) <= 1e-4 * max(1.0, abs(curves[0][0][k])), k
    assert curves[0][0]["entropy"] > 0 and curves[0][0]["value_loss"] > 0
    a, b = load_checkpoint(one["checkpoint"]).state_dict(), load_checkpoint(two["checkpoint"]).state_dict()
    init = load_checkpoint(str(tmp_path / "policy")).state_dict()
    moved, gap = _update_gap(a, b, init)
    assert moved > 1e-4 and gap < 1e-3, (moved, gap)  # half a batch per rank, averaged: the same step
    # the store got each consumption row once per run (rank 0 writes; the other rank never opens the store)
    with TrajectoryStore(store, read_only=True) as st:
        rows = [r for r in st.consumption("sao") if r["step"] == 1]
    assert len(rows) == 2 * len(warm)


def test_sft_warm_start_under_torchrun_takes_the_one_rank_steps(tmp_path):
    """Without a base checkpoint the warm start is SFT; with two ranks each trains on half of every (seeded, fixed)
    batch and the three steps land where one rank's do."""
    over = ["envs.n_train=6", "envs.n_eval=1", "envs.probes=false", "train.max_steps=3", "train.batch_size=4"]
    cfg = configs.load("micro", over)
    specs = stages.env_specs(cfg, tmp_path / "envs")
    envs = stages.verified_envs(cfg, specs, tmp_path / "verified")
    runs = {w: stages.warm_start(configs.load("micro", over + [f"trainer.world_size={w}"]), envs, tmp_path / f"w{w}",
                                 None) for w in (1, 2)}
    assert runs[2]["trainer_ranks"] == 2 and runs[1]["sft_steps"] == runs[2]["sft_steps"] == 3
    a = load_checkpoint(runs[1]["checkpoint"]).state_dict()
    b = load_checkpoint(runs[2]["checkpoint"]).state_dict()
    torch.manual_seed(cfg.seed)
    init = Transformer(cfg.model).state_dict()
    moved, gap = _update_gap(a, b, init)
    assert moved > 1e-3 and gap < 1e-3, (moved, gap)
