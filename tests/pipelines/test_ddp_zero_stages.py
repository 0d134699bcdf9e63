"""`trainer.distributed_optimizer` (ZeRO-1 on the torch data-parallel backend) through the pipeline: the SAO expert
runs as two torchrun ranks, each saving its part of the optimizer in its own rank file, and a run stopped after its
first step resumes from those files: each rank's Adam state goes on from its saved part."""

import torch
from micro_rollouts import alternating_warm_rollouts, stored_rollouts

import configs
import stages
from model import load_checkpoint
from model.checkpoint import to_hf_state
from trainers.checkpoint import complete_checkpoints


def _cfg(*extra: str):
    return configs.load("micro", ["envs.n_train=8", "envs.n_eval=1", "envs.probes=false", "loop.mode=sync",
                                  "sao.value_pretrain_steps=1", "loop.warm_rollouts=train", "sao.lr=1e-3",
                                  "sao.warmup_steps=0", "trainer.world_size=2", "sao.min_domain_reward=0",
                                  "sao.max_domain_reward=1", *extra])


def _weights(path) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in to_hf_state(load_checkpoint(path))}


def test_a_zero_sao_expert_resumes_from_its_rank_files(tmp_path):
    envs, store, ro = stored_rollouts(_cfg(), tmp_path, iteration=2)
    dom, warm = alternating_warm_rollouts(store, 2, ro)

    def expert(steps: int):
        return stages.sao_expert(_cfg(f"loop.steps={steps}", "trainer.distributed_optimizer=true"),
                                 str(tmp_path / "policy"), envs, dom, tmp_path / "expert", store_path=store,
                                 iteration=2, warm_rollouts=warm)

    first = expert(1)
    assert first["trainer_ranks"] == 2 and len(set(first["rank_checksums"])) == 1 and first["updates"] == 1
    [(step, state)] = complete_checkpoints(tmp_path / "expert" / "state")
    assert step == 1 and sorted(p.name for p in state.glob("rank-*.pt")) == ["rank-00000.pt", "rank-00001.pt"]
    after_one = _weights(first["checkpoint"])  # (the second run writes the same place)
    second = expert(2)  # the same stage asked for two steps: resumes after the first
    assert second["resumed_from_step"] == 1 and second["updates"] == 2 and len(set(second["rank_checksums"])) == 1
    assert any(not torch.equal(w, after_one[k]) for k, w in _weights(second["checkpoint"]).items())
    # each rank's optimizer part went on from the saved one: its Adam step counts are 2 (a fresh optimizer after
    # the resume would count 1), and the two parts split the actor's weights between them
    states = dict(complete_checkpoints(tmp_path / "expert" / "state"))
    parts = [torch.load(states[2] / f"rank-0000{r}.pt", weights_only=False)["optimizer"] for r in range(2)]
    for part in parts:
        steps = {float(st["step"]) for st in part["inner"]["state"].values()}
        assert steps == {2.0}, steps
    held = [sum(hi - lo for bucket in part["layout"] for b in bucket for lo, hi in b[4]) for part in parts]
    total = sum(p.numel() for p in load_checkpoint(first["checkpoint"]).parameters())  # (not the router biases)
    assert sum(held) == total and abs(held[0] - held[1]) <= 2, (held, total)
