"""`ShardedAdamW`: AdamW with its moments split over the data-parallel ranks (ZeRO stage 1), for
`trainer.megatron.distributed_optimizer`.

What Megatron's distributed optimizer does for memory, on torch's `ZeroRedundancyOptimizer`: each parameter's Adam
moments live on one rank of the group that holds that parameter identically, that rank updates it, and the step ends
by broadcasting every updated parameter from its owner. The groups are the ones gradients are summed over:

* dense weights (and each rank's tensor-parallel shard of them) over the data-parallel group;
* routed experts over the expert-data-parallel group (the ranks holding the same expert shard).

A group of one rank keeps a plain AdamW. The gradients are complete before `step` (the backend's
`all_reduce_grads` and model-wide clip run first), so the update is the unsharded one; the parameters each rank holds
are the same as without sharding, up to the broadcast's copy. The moments are in the parameters' dtype (no fp32
master copy, as the trainers' AdamW everywhere), and the partition is by whole tensors, so a rank's share of the
moments is about 1 / (group size) (`local_state_numel`), exactly that only for many similar tensors.

Checkpoints: `state_dict()` is this rank's part only (its local optimizers' states), which is what the sharded
training state's rank files hold (trainers/checkpoint.py); `load_state_dict` takes the same rank's part back.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer


class ShardedAdamW:
    """See the module docstring. `params`: the parameters to train; a parameter marked `routed_expert` (MegatronGLM
    marks its routed experts) goes to the expert group's optimizer, every other one to the dense group's."""

    def __init__(self, params, *, dense_group, expert_group, **adamw):
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]  # AdamW's two forms
        self.parts: list[torch.optim.Optimizer] = []
        dtypes = sorted({p.dtype for g in groups for p in g["params"]}, key=str)
        # one part per (group, dtype): ZeroRedundancyOptimizer takes one dtype, and a bf16 model keeps its routers and
        # the indexer's head weights in fp32 (backend.cast_like_temper)
        for (want, group), dt in itertools.product(((False, dense_group), (True, expert_group)), dtypes):
            mine = [{**g, "params": [p for p in g["params"]
                                     if getattr(p, "routed_expert", False) == want and p.dtype == dt]} for g in groups]
            mine = [g for g in mine if g["params"]]
            if not mine:
                continue
            if dist.get_world_size(group) > 1:
                self.parts.append(ZeroRedundancyOptimizer(mine, optimizer_class=torch.optim.AdamW, process_group=group,
                                                          **adamw))
            else:
                self.parts.append(torch.optim.AdamW(mine, **adamw))

    @property
    def param_groups(self) -> list[dict]:
        """Every part's groups (the trainers set each step's lr here; a sharded part passes it on at `step`)."""
        return [g for o in self.parts for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.parts:
            o.step()

    @staticmethod
    def _local(o: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return o.optim if isinstance(o, ZeroRedundancyOptimizer) else o

    def state_dict(self) -> dict:
        """This rank's part: each local optimizer's state (a sharded part's: the moments this rank owns)."""
        return {"sharded_adamw": [self._local(o).state_dict() for o in self.parts]}

    def load_state_dict(self, state: dict) -> None:
        parts = state.get("sharded_adamw") if isinstance(state, dict) else None
        if parts is None or len(parts) != len(self.parts):
            raise ValueError("ShardedAdamW: the state is not a sharded optimizer's of this layout (resume with the same "
                             "trainer.megatron.distributed_optimizer, trainer.megatron.dtype and layout)")
        for o, sd in zip(self.parts, parts, strict=True):
            self._local(o).load_state_dict(sd)
            if isinstance(o, ZeroRedundancyOptimizer):  # the exposed groups follow the restored local ones
                o._sync_param_groups(o.optim.param_groups, o.param_groups)

    def local_state_numel(self) -> int:
        """Elements of optimizer state (Adam's moments) this rank holds."""
        return sum(t.numel() for o in self.parts for st in self._local(o).state.values() for t in st.values()
                   if torch.is_tensor(t) and t.dim() > 0)
