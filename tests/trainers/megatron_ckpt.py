"""One rank of the sharded-checkpoint test (tests/trainers/test_megatron_checkpoint.py), under torchrun:

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/megatron_ckpt.py OUT TP EP [zero]

Every rank wraps the same `micro` model on the (tp, ep) layout with a critic, takes step A (policy and critic, AdamW
both), saves the sharded training state, takes step B: the continued run. Then a second model from other weights,
with fresh optimizers, restores the state and takes step B: the resumed run. Each rank writes its shard's weights,
both critics and the RNG draws of both runs to OUT/rank{R}.pt, and whether restoring on an unsharded backend, or on
the same ranks with Megatron's SequentialMLP experts in place of the grouped ones, was refused with the keys named.
With `zero` the optimizers are the backend's distributed one (fp32 main weights and Adam's moments split over the
data-parallel ranks), and
the same two steps are taken again with a whole AdamW on every rank, for comparison.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import configs  # noqa: E402
from model import Transformer  # noqa: E402
from model.checkpoint import to_hf_state  # noqa: E402
from trainers.checkpoint import load_training_state, restore, save_training_state  # noqa: E402
from trainers.megatron.backend import MegatronBackend  # noqa: E402
from trainers.megatron.convert import megatron_state  # noqa: E402
from trainers.megatron.parity import step_loss  # noqa: E402
from trainers.optim import grad_of  # noqa: E402
from trainers.sao import Critic  # noqa: E402


def main(out: Path, tp: int, ep: int, zero: bool = False) -> None:
    torch.set_num_threads(int(os.environ.get("TEMPER_TEST_THREADS") or 1))  # tests/conftest.py
    cfg = configs.load("micro").model
    be = MegatronBackend(tp, 1, ep, 1, distributed_optimizer=zero)
    try:
        g = torch.Generator().manual_seed(3)
        batch_a, batch_b = (torch.randint(0, 256, (4, 33), generator=g) for _ in range(2))

        def build(seed: int):
            torch.manual_seed(seed)  # the same full model on every rank, then this rank's shard of it
            m = be.wrap(Transformer(cfg))
            critic = Critic(m)
            return (m, be.optimizer(m.parameters(), lr=1e-2, weight_decay=0.0), critic,
                    be.optimizer([p for p in critic.parameters() if p.requires_grad], lr=1e-2))

        def step(m, opt, critic, copt, ids) -> None:
            rows = ids[be.rank :: be.world_size]  # data parallelism: each dp rank its rows
            loss, _, _ = step_loss(m, rows, ids.shape[0] * (ids.shape[1] - 1))
            loss.backward()
            be.all_reduce_grads(m)
            be.clip_grad_norm(m, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            v = critic(rows)
            (v - 1.0).pow(2).mean().backward()
            be.all_reduce_grads(critic)
            copt.step()
            copt.zero_grad(set_to_none=True)

        def shard(m, critic) -> dict:
            return {"policy": {k: v.detach().clone() for k, v in megatron_state(m).items()},
                    "critic": {k: v.detach().clone() for k, v in critic.state_dict().items() if torch.is_tensor(v)}}

        m, opt, critic, copt = build(0)
        init = shard(m, critic)
        step(m, opt, critic, copt, batch_a)
        after_a = {k: v.clone() for k, v in to_hf_state(be.export(m))}
        save_training_state(out / "state", policy=m, optimizer=opt, critic=critic, critic_optimizer=copt, step=1,
                            policy_version=2, data_cursor=1, backend=be)
        draw_continued = torch.rand(4)
        step(m, opt, critic, copt, batch_b)
        continued = shard(m, critic)

        m2, opt2, critic2, copt2 = build(1)  # other weights, fresh optimizers: everything must come from the state
        state = load_training_state(out / "state")
        refused = ""
        try:
            restore(state, m2, opt2, critic2, copt2)  # no backend: an unsharded restore of a sharded state
        except ValueError as e:
            refused = str(e)
        refused_experts = ""
        be.experts = "sequential"  # the same ranks with the other expert module: its parameters are not these
        try:
            restore(state, m2, opt2, critic2, copt2, backend=be)
        except ValueError as e:
            refused_experts = str(e)
        be.experts = "grouped"
        restore(state, m2, opt2, critic2, copt2, backend=be)
        draw_resumed = torch.rand(4)
        step(m2, opt2, critic2, copt2, batch_b)
        resumed = shard(m2, critic2)
        plain, state_numel = None, (opt.local_state_numel() if zero else None, None)
        main_numel = opt.local_shard_numel() if zero else None  # the elements this rank updates
        if zero:  # the same two steps from the same weights with a whole AdamW on every rank: the same weights
            be.distributed_optimizer = False
            m3, opt3, critic3, copt3 = build(0)
            step(m3, opt3, critic3, copt3, batch_a)
            step(m3, opt3, critic3, copt3, batch_b)
            plain = shard(m3, critic3)
            state_numel = (state_numel[0], sum(t.numel() for st in opt3.state.values() for t in st.values()
                                               if torch.is_tensor(t) and t.dim() > 0))
            be.distributed_optimizer = True
        bf16 = None
        if zero:  # a bf16 model keeps its routers and the indexer's head weights in fp32: a bucket per dtype
            be.dtype = torch.bfloat16
            torch.manual_seed(0)
            mb = be.wrap(Transformer(cfg))
            ob = be.optimizer(mb.parameters(), lr=1e-2, weight_decay=0.0)
            start = {k: v.float().clone() for k, v in megatron_state(mb).items() if ".mlp.experts." not in k}
            rows = batch_a[be.rank :: be.world_size]
            loss, _, _ = step_loss(mb, rows, batch_a.shape[0] * (batch_a.shape[1] - 1))
            loss.backward()
            be.all_reduce_grads(mb)
            norm = float(be.clip_grad_norm(mb, 1.0))
            # the gradients the step reads: fp32 sums in `main_grad` for the bf16 weights, `.grad` left empty
            grads = sorted({(str(p.dtype), str(grad_of(p).dtype), p.grad is None) for p in mb.parameters()
                            if grad_of(p) is not None})
            ob.step()
            dense = {k: v.float() for k, v in megatron_state(mb).items() if ".mlp.experts." not in k}
            moved: dict[str, bool] = {}  # per dtype of the dense weights: did any of them change
            for k, w in megatron_state(mb).items():
                if k in start:
                    moved[str(w.dtype)] = moved.get(str(w.dtype), False) or not torch.equal(dense[k], start[k])
            bf16 = {"buckets": sorted((b.world, str(b.params[0].dtype)) for bs in ob.buckets for b in bs),
                    "dense": dense, "moved": moved, "grads": grads, "norm": norm}
            be.dtype = torch.float32
        torch.save({"bf16": bf16, "main_numel": main_numel, "continued": continued, "resumed": resumed, "plain": plain,
                    "state_numel": state_numel,
                    "draws": (draw_continued, draw_resumed),
                    "refused": refused, "refused_experts": refused_experts,
                    "after_a": after_a if be.is_main else None, "layout": be.state_layout(),
                    "moved": any(not torch.equal(continued["policy"][k], v) for k, v in init["policy"].items())},
                   out / f"rank{torch.distributed.get_rank()}.pt")
    finally:
        be.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), len(sys.argv) > 4 and sys.argv[4] == "zero")
