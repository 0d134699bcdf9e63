"""`GroupedExperts`: the routed experts of a Megatron MoE layer as two grouped GEMMs on temper's kernels.

Megatron's own expert modules do not fit here: `SequentialMLP` runs one `MLP` per local expert (a host sync on the
token counts, then 2·E small GEMMs and their launches per layer), `GroupedMLP` needs the `grouped_gemm` CUDA
extension and bf16, and `TEGroupedMLP` needs Transformer Engine. This module takes the same place in the layer spec
(`MoESubmodules.experts`) and the same call, `forward(permuted_hidden [M, H], tokens_per_expert [E_local],
permuted_probs [M])`, with the rows already sorted by local expert by Megatron's token dispatcher:

    h = grouped_linear(x, fc1_weight, ends)          fc1_weight [E_local, 2·I/etp, H]: each expert's [gate; up]
    y = grouped_linear(silu(g) · u · probs, fc2_weight, ends)   fc2_weight [E_local, H, I/etp]

`grouped_linear` is `torch._grouped_mm` on Hopper in bf16, temper's Triton grouped GEMM on other CUDA devices and
dtypes, and a per-expert loop (the twin) on the CPU. The weights are the local experts' `linear_fc1` /
`linear_fc2` weights stacked, so the converters move between the two layouts by stacking (`convert.py`); the
expert-tensor-parallel split of each expert is the one `SequentialMLP`'s experts use. As in Megatron's expert
linears, nothing here communicates: the dispatcher gathers the tokens over the expert-tensor-parallel ranks and
reduces the partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from temper_kernels import grouped_linear


class GroupedExperts(nn.Module):
    """See the module docstring. Built by Megatron's `build_module(spec, num_local_experts, config, pg_collection=)`."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, **_):
        super().__init__()
        self.config = config
        if config.add_bias_linear:
            raise ValueError("GroupedExperts: expert biases are not built (add_bias_linear must be False)")
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("GroupedExperts: the experts are SwiGLU (gated_linear_unit, activation_func=silu)")
        unsupported = [k for k in ("moe_apply_probs_on_input", "fp8", "fp4", "activation_func_clamp_value",
                                   "moe_latent_size", "delay_wgrad_compute") if getattr(config, k, None)]
        unsupported += ["glu_linear_offset"] if getattr(config, "glu_linear_offset", 0.0) else []
        if unsupported:
            raise ValueError(f"GroupedExperts: {', '.join(unsupported)} not supported (use experts=sequential)")
        if config.perform_initialization:
            raise ValueError("GroupedExperts: its weights are loaded, not drawn (perform_initialization=False; "
                             "MegatronBackend.wrap loads temper's weights into every shard)")
        self.num_local_experts = num_local_experts
        etp = pg_collection.expt_tp.size() if pg_collection is not None else config.expert_tensor_parallel_size
        if config.moe_ffn_hidden_size % etp:
            raise ValueError(f"moe_ffn_hidden_size={config.moe_ffn_hidden_size} does not split over {etp} ranks")
        i, h = config.moe_ffn_hidden_size // etp, config.hidden_size
        dev = None if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.fc1_weight = nn.Parameter(torch.empty(num_local_experts, 2 * i, h, dtype=config.params_dtype, device=dev))
        self.fc2_weight = nn.Parameter(torch.empty(num_local_experts, h, i, dtype=config.params_dtype, device=dev))
        for p in (self.fc1_weight, self.fc2_weight):  # what Megatron's expert parameters carry
            p.allreduce = config.expert_model_parallel_size == 1
            p.tensor_model_parallel = etp > 1

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        ends = torch.as_tensor(tokens_per_expert).long().cumsum(0)
        if ends.device != x.device:
            # Megatron's allgather and alltoall dispatchers hand the counts over on the host: a blocking copy to the
            # device would synchronise the stream once per layer; from pinned memory it is queued like a kernel
            ends = ends.to(torch.int32)
            ends = ends.pin_memory().to(x.device, non_blocking=True) if x.is_cuda else ends.to(x.device)
        g, u = grouped_linear(x, self.fc1_weight, ends).chunk(2, dim=-1)
        act = F.silu(g) * u
        act = (act * permuted_probs.unsqueeze(-1)).to(act.dtype)  # the routing weight before fc2, as Megatron's MLP
        return grouped_linear(act, self.fc2_weight, ends), None

    def extra_repr(self) -> str:
        e, i2, h = self.fc1_weight.shape
        return f"experts={e}, hidden={h}, intermediate={i2 // 2} (grouped GEMM)"
