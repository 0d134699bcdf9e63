"""`trainer.kind: megatron` through the pipeline's training stages: SFT (warm start), one SAO expert and OPD run
unchanged on the Megatron-core backend, the engines are served temper's model gathered from it, and each stage
ends where the torch backend ends on the same data."""


import pytest
import torch
from micro_rollouts import stored_rollouts

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
    with pytest.raises(ValueError, match="trainer.world_size"):
        _cfg("megatron", "trainer.world_size=2")
