"""A sharded training state (Megatron ranks, each with its own shard and optimizer moments): saved by every rank and
restored on the same layout, a resumed step equals the continued one bit for bit, the policy in the checkpoint is the
whole model, a missing rank file leaves the checkpoint incomplete, and another layout is refused with the keys named.
Two gloo ranks under torchrun (tests/trainers/megatron_ckpt.py), TP = 2 (sequence parallel) and EP = 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import configs
from model import load_checkpoint
from model.checkpoint import to_hf_state
from trainers.backends import free_port
from trainers.checkpoint import complete_checkpoints, load_training_state, rank_file, restore

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("tp, ep, zero", [(2, 1, False), (1, 2, False), (1, 2, True)])
def test_a_sharded_state_resumes_bit_for_bit_on_its_layout(tmp_path, tp, ep, zero):
    """With `zero` (trainer.megatron.distributed_optimizer at EP = 2: fp32 main weights and dense moments split over the
    two data-parallel ranks, each rank's experts whole) the steps also equal a whole AdamW's, and each rank holds half
    of the dense moments."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "megatron_ckpt.py"), str(tmp_path), str(tp), str(ep),
           *(["zero"] if zero else [])]
    r = subprocess.run(cmd, timeout=600, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2)]
    for i, got in enumerate(ranks):
        assert got["moved"], i  # the steps changed the shard, so equal shards are not untouched ones
        for part in ("policy", "critic"):
            want, have = got["continued"][part], got["resumed"][part]
            assert want.keys() == have.keys()
            for k in want:
                assert torch.equal(want[k], have[k]), (i, part, k)
        assert torch.equal(*got["draws"]), i  # each rank's RNG streams continue where they were saved
        assert "trainer.megatron" in got["refused"] and "trainer.world_size" in got["refused"], got["refused"]
        assert "'experts': 'grouped'" in got["refused_experts"] and "experts, " in got["refused_experts"]
        if zero:
            for part in ("policy", "critic"):  # the sharded optimizer's update is the whole AdamW's, bit for bit
                for k, v in got["plain"][part].items():
                    assert torch.equal(got["continued"][part][k], v), (i, part, k)
    if zero:
        # bf16: a bucket per dtype of the dense weights (fp32 routers and indexer heads beside bf16), split over the
        # two data-parallel ranks, the experts whole on each rank; after a step the dense weights are the same on both
        assert ranks[0]["bf16"]["buckets"] == [(1, "torch.bfloat16"), (2, "torch.bfloat16"), (2, "torch.float32")], \
            ranks[0]["bf16"]["buckets"]
        assert ranks[0]["bf16"]["moved"] == {"torch.bfloat16": True, "torch.float32": True}  # both buckets stepped
        # bf16 weights' gradients summed and reduced in fp32 (main_grad, `.grad` empty); fp32 weights' in `.grad`
        assert ranks[0]["bf16"]["grads"] == [("torch.bfloat16", "torch.float32", True),
                                             ("torch.float32", "torch.float32", False)], ranks[0]["bf16"]["grads"]
        assert ranks[0]["bf16"]["norm"] == ranks[1]["bf16"]["norm"] > 0  # the model-wide norm, the same everywhere
        d0, d1 = ranks[0]["bf16"]["dense"], ranks[1]["bf16"]["dense"]
        assert d0.keys() == d1.keys() and all(torch.equal(d0[k], d1[k]) for k in d0)
        # Adam's moments: a whole AdamW holds every dense element's and its rank's experts'; the sharded one its
        # experts' and an element-exact half of the dense ones (ceil(n / 2) per bucket), not a whole-tensor split
        (mine0, whole0), (mine1, whole1) = (r["state_numel"] for r in ranks)
        dense = (whole0 + whole1) - (mine0 + mine1)  # the dense elements' moments, counted once
        share0, share1 = mine0 - (whole0 - dense), mine1 - (whole1 - dense)
        assert dense > 0 and share0 > 0 and share1 > 0 and abs(share0 - share1) <= 2 * 2, (share0, share1, dense)
        # the scale plan's optimizer shard for this layout (dense / dp + local experts / edp) is what each rank holds,
        # up to the rounding of ceil(n / 2)
        from trainers.megatron.plan import Layout, count_params, estimate

        cfg = configs.load("micro").model
        want = estimate(cfg, count_params(cfg), Layout(1, 1, 2, 1, 2), "fp32 grads, fp32 Adam").detail["optimizer_shard"]
        assert [abs(r["main_numel"] - want) <= 1 for r in ranks] == [True, True], ([r["main_numel"] for r in ranks], want)
    if tp == 2:  # the ranks hold different halves of the attention, so their files must differ
        a, b = (r["continued"]["policy"] for r in ranks)
        assert any(not torch.equal(a[k], b[k]) for k in a if k in b and a[k].shape == b[k].shape)

    [(step, path)] = complete_checkpoints(tmp_path / "state")
    meta = json.loads((path / "meta.json").read_text())
    assert step == 1 and meta["ranks"] == 2
    assert sorted(meta["files"]) == [rank_file(0), rank_file(1), "trainer.pt"]  # every rank file's checksum recorded
    good = (path / rank_file(1)).read_bytes()
    (path / rank_file(1)).write_bytes(good[:-10] + bytes([good[-10] ^ 1]) + good[-9:])
    with pytest.raises(RuntimeError, match=f"{rank_file(1)}: its bytes do not match"):  # StateUnreadable: the only state
        load_training_state(tmp_path / "state")
    (path / rank_file(1)).write_bytes(good)
    state = load_training_state(tmp_path / "state")
    assert state.ranks == 2 and state.layout == ranks[0]["layout"] and state.layout["tp"] == tp
    assert state.optimizer is None  # the optimizers live in the rank files only
    # the policy is the whole model (what engines and evaluation load), as gathered after step A
    saved = dict(to_hf_state(load_checkpoint(state.policy_path)))
    after_a = ranks[0]["after_a"]
    assert saved.keys() == after_a.keys() and all(torch.equal(saved[k], after_a[k]) for k in saved)
    # an unsharded run cannot take the optimizers of a sharded state
    with pytest.raises(ValueError,
                       match=r"saved by 2 ranks .*trainer\.world_size, trainer\.distributed_optimizer and trainer\.megatron"):
        restore(state, load_checkpoint(state.policy_path), None)
    # a checkpoint missing one rank's file is not complete: nothing to resume from
    (path / rank_file(1)).unlink()
    assert complete_checkpoints(tmp_path / "state") == []
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        load_training_state(tmp_path / "state")
