"""`MegatronBackend`: the `TrainBackend` of `trainer.kind: megatron`.

The trainers above it are the same as on the torch backend. What changes is what a rank holds:

* `wrap(model)` turns temper's `Transformer` (the same weights on every rank) into a `MegatronGLM` holding this
  rank's tensor-, expert- and sequence-parallel shard;
* `rank` / `world_size` are the *data-parallel* coordinates (the trainers split rows over them); the ranks of one
  tensor-parallel group see the same rows. `is_main` is global rank 0;
* `all_reduce_grads` completes the gradients (`MegatronGLM.finish_backward`: sequence-parallel weights over tp,
  dense weights over data parallelism, experts over expert data parallelism, means over the dp size) and averages
  any other module's gradients (the critic's value head) over the data-parallel group;
* `clip_grad_norm` clips by the norm of the whole model: tensor-parallel shards summed over tp, replicated weights
  counted once, experts summed over the expert-parallel ranks;
* `export(model)` gathers the shards into an HF-layout state and returns temper's `Transformer`, which is what the
  weight sync pushes and what checkpoints save: the engines never see Megatron.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from model import Transformer
from model.checkpoint import from_hf_state, to_hf_state
from trainers.backends import TrainBackend
from trainers.optim import ShardedAdamW, grad_of, set_grad_of

from . import parallel
from .convert import from_megatron, is_routed_expert, load_into, megatron_state


def cast_like_temper(m: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast a MegatronGLM (before its weights are loaded) to `dtype` as Megatron's Float16Module does, every floating
    tensor, but keep float32 what temper's own model keeps float32 through `.to(dtype)`: the routers' weight and
    expert-bias state (Megatron's TopKRouter routes in fp32, `moe_router_dtype`, but stores its weight in
    `params_dtype`), the indexer's head weights (`weights_proj`, temper's FP32Linear) and temper's KeepFP32 modules
    (rotary). Megatron builds its own linears in `params_dtype` but temper's submodules (MLA's down-projections and
    norms, the indexer) and its torch-fallback norms in float32: without this a bf16 model mixes the two and fails."""
    if dtype == torch.float32:
        return m
    from megatron.core.transformer.moe.router import TopKRouter

    m.to(dtype)  # KeepFP32 modules restore their own float32 tensors
    for mod in m.modules():
        if isinstance(mod, TopKRouter):
            for t in [*mod._parameters.values(), *mod._buffers.values()]:
                if t is not None and t.is_floating_point():
                    t.data = t.data.float()
        wp = getattr(getattr(mod, "indexer", None), "weights_proj", None)
        if wp is not None:
            wp.weight.data = wp.weight.data.float()
    return m


class MegatronBackend(TrainBackend):
    def __init__(self, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, *,
                 dtype: torch.dtype = torch.float32, dist_backend: str | None = None, timeout_s: float = 600.0,
                 experts: str = "grouped", distributed_optimizer: bool = False):
        self.layout = parallel.initialize(tp, pp, ep, etp, backend=dist_backend, timeout_s=timeout_s)
        self.experts = experts  # the routed experts' module: "grouped" (temper's GroupedExperts) or "sequential"
        self.distributed_optimizer = distributed_optimizer  # main weights and Adam's moments split over dp ranks
        self.rank, self.world_size = self.layout.dp_rank, self.layout.dp
        self.sharded_state = self.layout.world_size > 1  # each rank saves its shard's optimizer (and critic) state
        self.dtype = dtype
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.layout.rank == 0

    @property
    def lockstep(self) -> bool:
        """True when the data-parallel ranks must run the same forwards and backwards: the experts split over ep > 1
        ranks (each a data-parallel rank with its own rows) exchange tokens in every MoE layer, and with several
        data-parallel ranks `finish_backward` sums every gradient over them, so a rank without rows must still
        backpropagate (the trainers pad their rows to match; trainers/sao.py)."""
        return self.layout.ep > 1 or self.layout.dp > 1

    def close(self) -> None:
        parallel.destroy()

    def state_layout(self) -> dict:
        lay = self.layout
        return {"world": lay.world_size, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp,
                "dtype": str(self.dtype).removeprefix("torch."), "experts": self.experts,
                "distributed_optimizer": self.distributed_optimizer}

    def dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def optimizer(self, params, **adamw) -> torch.optim.Optimizer:
        """AdamW. With `distributed_optimizer`, `ShardedAdamW`: fp32 main weights and Adam's moments split over the
        data-parallel group (dense) and the expert-data-parallel group (routed experts). In bf16 without it, the same
        fp32 main weights kept whole on every rank, as Megatron's mixed-precision optimizer keeps them
        (trainers/optim.py)."""
        from megatron.core import parallel_state as ps

        if not self.distributed_optimizer:  # AdamW, or fp32 main weights below fp32 (trainer.fp32_main_weights)
            return super().optimizer(params, **adamw)
        return ShardedAdamW(params, dense_group=ps.get_data_parallel_group(),
                            expert_group=ps.get_expert_data_parallel_group(), **adamw)

    # ---- the model ------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """temper Transformer → MegatronGLM with this rank's shard (a MegatronGLM is returned as it is)."""
        from megatron.core import parallel_state as ps

        from .model import MegatronGLM, transformer_config

        if isinstance(model, MegatronGLM):
            return model
        cfg, lay = model.config, self.layout
        hf = {k: v.detach().to("cpu", torch.float32) for k, v in to_hf_state(model)}
        # every tensor is loaded below: no initialisation, and the caller's RNG streams are left as they were
        with torch.random.fork_rng(devices=[]):
            m = MegatronGLM(cfg, transformer_config(cfg, tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp,
                                                    dtype=self.dtype, perform_initialization=False),
                            experts=self.experts)
        cast_like_temper(m, self.dtype)  # before the load: the fp32 tensors get the exact fp32 values
        load_into(m, hf, tp=lay.tp, ep=lay.ep, etp=lay.etp, tp_rank=lay.tp_rank, ep_rank=lay.ep_rank,
                  etp_rank=ps.get_expert_tensor_parallel_rank())
        return m.to(self.device)

    def gather_hf(self, model) -> dict[str, torch.Tensor]:
        """Every rank's shard joined into the HF state (on every rank; float32 CPU tensors)."""
        from megatron.core import parallel_state as ps

        lay = self.layout
        mine = ((lay.tp_rank, lay.ep_rank, ps.get_expert_tensor_parallel_rank()),
                {k: v.detach().float().cpu() for k, v in megatron_state(model).items()})
        if lay.world_size == 1:
            shards = [mine]
        else:
            shards = [None] * lay.world_size
            dist.all_gather_object(shards, mine)
        return from_megatron(dict(shards), model.config, tp=lay.tp, ep=lay.ep, etp=lay.etp)

    def export(self, model) -> Transformer:
        """temper's Transformer with the MegatronGLM's current weights (what the engines and checkpoints get)."""
        cfg = model.config
        with torch.random.fork_rng(devices=[]):  # every weight is loaded below: the caller's RNG streams stay as they are
            t = Transformer(cfg)
        t.load_state_dict(from_hf_state(cfg, self.gather_hf(model)), strict=False)
        t.materialize_buffers()
        return t

    # ---- one step -------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def all_reduce_grads(self, model: nn.Module) -> None:
        from megatron.core import parallel_state as ps

        from .model import MegatronGLM

        done: set[int] = set()
        for m in model.modules():
            if isinstance(m, MegatronGLM):
                m.finish_backward(average=True)
                done.update(id(p) for p in m.parameters())
        dp_g, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
        for p in model.parameters():
            if id(p) in done or grad_of(p) is None or dp == 1:
                continue
            g = grad_of(p).contiguous()
            dist.all_reduce(g, group=dp_g)
            set_grad_of(p, g / dp)

    @torch.no_grad()
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        grads = []
        for name, p in model.named_parameters():
            g = grad_of(p)  # bf16 weights: the fp32 main gradient
            if g is None:
                continue
            grads.append(g)
            sq = g.double().pow(2).sum()
            if is_routed_expert(name):
                expert += sq  # distinct over the expert model-parallel ranks
            elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                dense += sq  # a tp shard, or a replicated weight counted on tp rank 0 only
        for t, group in ((dense, ps.get_tensor_model_parallel_group()),
                         (expert, ps.get_expert_tensor_and_model_parallel_group())):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(t, group=group)
        total = (dense + expert).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return total.float()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def barrier(self) -> None:
        dist.barrier()
