"""`trainer.kind: megatron` through the pipeline's training stages: SFT (warm start), one SAO expert and OPD run
unchanged on the Megatron-core backend, the engines are served temper's model gathered from it, and each stage
ends where the torch backend ends on the same data."""


import pytest
import torch
from micro_rollouts import alternating_warm_rollouts, stored_rollouts

import configs
import stages
from model import Transformer, load_checkpoint
from model.checkpoint import to_hf_state


def _weights(path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in to_hf_state(load_checkpoint(path))}


def _same_step(got: dict, want: dict, before: dict, tol: float = 2e-2) -> int:
    """Both runs took the same updates: per tensor, the two updates differ by at most `tol` of the update (L2).
    Returns how many tensors moved."""
    moved = 0
    for k, w in want.items():
        du = w - before[k]
        if du.any():
            moved += 1
            assert float((got[k] - w).norm() / du.norm()) <= tol, k
        else:
            assert torch.equal(got[k], w), k
    return moved


def _cfg(kind: str, *extra: str):
    return configs.load("micro", ["envs.n_train=8", "envs.n_eval=1", "envs.probes=false", "loop.mode=sync",
                                  f"trainer.kind={kind}", *extra])


def test_sft_sao_and_opd_stages_run_on_megatron(tmp_path):
    """The stages' wiring on the Megatron backend: SFT from scratch takes the same steps as the torch backend (its
    data stream is deterministic); one SAO step and one OPD step train, push the exported weights to the engine
    (each push checks the engine's checksum against the trainer's) and save temper checkpoints. (The rollout stages
    are not bit-reproducible between two runs — the engine batches concurrent episodes — so their steps are compared
    at the trainer level, in tests/trainers/test_megatron.py.)"""
    base = _cfg("torch")
    envs, store, ro = stored_rollouts(base, tmp_path, iteration=2)
    before = _weights(tmp_path / "policy")
    dom = envs["domains"][0]
    sft = {}
    for kind in ("torch", "megatron"):
        cfg = _cfg(kind, "train.max_steps=2")
        sft[kind] = stages.warm_start(cfg, envs, tmp_path / kind / "sft", None)
        assert sft[kind]["source"] == "sft" and sft[kind]["sft_steps"] == 2
    torch.manual_seed(base.seed)  # SFT from scratch starts from the same seeded init on both backends
    init = {k: v.detach().clone() for k, v in to_hf_state(Transformer(base.model))}
    assert _same_step(_weights(sft["megatron"]["checkpoint"]), _weights(sft["torch"]["checkpoint"]), init) \
        > len(init) // 2
    # OPD on `dom` alone (no warm-start anchor on the other domain): its one step must carry the teacher's signal
    cfg = _cfg("megatron", "loop.steps=1", "sao.value_pretrain_steps=1", "opd.steps=1", "loop.warm_rollouts=train",
               "opd.untaught=none")
    scored = stages.rewards(store, 2, ro["trajectory_ids"])
    sao = stages.sao_expert(cfg, str(tmp_path / "policy"), envs, dom, tmp_path / "expert", store_path=store,
                            iteration=2, domain_reward=0.5, warm_rollouts=scored["domains"][dom]["ids"])
    assert sao["steps"] == 1 and sao["warm_rollouts"] > 0
    load_checkpoint(sao["checkpoint"])  # a temper checkpoint
    opd = stages.opd_student(cfg, str(tmp_path / "policy"), {dom: sft["torch"]["checkpoint"]}, envs,
                             tmp_path / "opd", store_path=store, iteration=2)
    assert opd["steps"] == 1 and all(x > 0 for x in opd["reverse_kl"])
    after = _weights(opd["checkpoint"])
    assert sum(not torch.equal(after[k], before[k]) for k in before) > len(before) // 3  # moved (not MTP, indexer)


def test_megatron_layout_errors_name_the_key():
    with pytest.raises(ValueError, match="trainer.megatron.tp: 2 does not divide trainer.world_size=1"):
        _cfg("megatron", "trainer.megatron.tp=2")
    with pytest.raises(ValueError, match=r"trainer.megatron.ep: ep·etp = 4 does not divide trainer.world_size=2"):
        _cfg("megatron", "trainer.world_size=2", "trainer.megatron.ep=4")
    assert _cfg("megatron", "trainer.world_size=2", "trainer.megatron.tp=2").trainer.megatron.tp == 2  # sharded: allowed


def test_sharded_megatron_stages_run_under_torchrun_and_resume(tmp_path):
    """`trainer.world_size=2` with `trainer.megatron.tp=2`: SFT, the SAO expert and OPD each run as two torchrun
    ranks holding halves of the model. SFT's two steps and the SAO expert's first step (on the stored rollouts, a batch
    fixed before the stage) land where the torch backend's one process lands; every rank saves its part of the
    training state; OPD stopped after one step resumes from that sharded state for its second."""
    from test_stage_ranks import _update_gap

    from store import TrajectoryStore
    from trainers.checkpoint import complete_checkpoints

    over = ["loop.steps=1", "sao.value_pretrain_steps=1", "loop.warm_rollouts=train", "sao.lr=1e-3",
            "sao.warmup_steps=0", "opd.untaught=none", "opd.gate_teachers=false"]
    sharded = ["trainer.world_size=2", "trainer.megatron.tp=2"]
    envs, store, ro = stored_rollouts(_cfg("torch"), tmp_path, iteration=2)
    dom, warm = alternating_warm_rollouts(store, 2, ro)  # rewards 0, 1, …: the random policy's step gets a signal

    sft = {kind: stages.warm_start(_cfg(kind, "train.max_steps=2", *(sharded if kind == "megatron" else [])),
                                   envs, tmp_path / kind / "sft", None) for kind in ("torch", "megatron")}
    assert sft["megatron"]["trainer_ranks"] == 2 and len(set(sft["megatron"]["rank_checksums"])) == 1
    torch.manual_seed(_cfg("torch").seed)
    init = {k: v.detach().clone() for k, v in to_hf_state(Transformer(_cfg("torch").model))}
    assert _same_step(_weights(sft["megatron"]["checkpoint"]), _weights(sft["torch"]["checkpoint"]), init) \
        > len(init) // 2

    sao = {kind: stages.sao_expert(_cfg(kind, *over, *(sharded if kind == "megatron" else [])),
                                   str(tmp_path / "policy"), envs, dom, tmp_path / kind / "expert", store_path=store,
                                   iteration=2, warm_rollouts=warm) for kind in ("torch", "megatron")}
    assert sao["megatron"]["trainer_ranks"] == 2 and sao["megatron"]["updates"] == 1
    before = _weights(tmp_path / "policy")
    moved, gap = _update_gap(_weights(sao["megatron"]["checkpoint"]), _weights(sao["torch"]["checkpoint"]), before)
    assert moved > 1e-4 and gap < 1e-2, (moved, gap)
    [(_, state)] = complete_checkpoints(tmp_path / "megatron" / "expert" / "state")  # every rank saved its part
    assert sorted(p.name for p in state.glob("rank-*.pt")) == ["rank-00000.pt", "rank-00001.pt"]

    cfg = _cfg("megatron", *over, *sharded, "opd.steps=1")
    first = stages.opd_student(cfg, str(tmp_path / "policy"), {dom: sft["torch"]["checkpoint"]}, envs,
                               tmp_path / "opd", store_path=store, iteration=2)
    assert first["steps"] == 1 and first["trainer_ranks"] == 2 and first["reverse_kl"][0] > 0
    after_one = _weights(first["checkpoint"])
    cfg = _cfg("megatron", *over, *sharded, "opd.steps=2")
    second = stages.opd_student(cfg, str(tmp_path / "policy"), {dom: sft["torch"]["checkpoint"]}, envs,
                                tmp_path / "opd", store_path=store, iteration=2)
    assert second["resumed_from_step"] == 1 and second["steps"] == 2 and second["reverse_kl"][0] == first["reverse_kl"][0]
    after_two = _weights(second["checkpoint"])  # the resumed run took a second step from the first one's weights
    assert sum(not torch.equal(after_two[k], after_one[k]) for k in after_one) > len(after_one) // 3
    with TrajectoryStore(store, read_only=True) as st:  # rank 0 alone wrote the store: each OPD step's rows once
        rows = st.consumption("opd")
    assert sorted({r["step"] for r in rows}) == [1, 2] and len(rows) == 2 * cfg.loop.batch_size
