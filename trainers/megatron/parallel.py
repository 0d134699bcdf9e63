"""Megatron's parallel state for the trainer ranks: join (or create) the torch.distributed group, then carve it
into tensor-, pipeline-, expert- and data-parallel groups with `megatron.core.parallel_state`.

On a machine without CUDA (the CPU CI, the gloo tests) two shims let Megatron-core 0.16 build and run:
* a few constructors ask `torch.cuda.current_device()` for a device (the router's buffers); without CUDA it answers
  "cpu" instead of raising;
* `moe_utils` refers to Transformer Engine's `te_general_gemm` without defining it when TE is absent (a
  NameError in the router's gating); it is defined as None, which selects Megatron's own torch path;
* the model-parallel RNG tracker (which sequence-parallel blocks enter) keeps CUDA generator states; on the CPU it is
  a tracker whose `fork` changes nothing (this model has no dropout, so no random draw happens inside it).
None of them changes anything on a CUDA machine with Transformer Engine; there `initialize` seeds Megatron's CUDA
RNG tracker (`model_parallel_cuda_manual_seed`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def apply_shims() -> None:
    import megatron.core.transformer.moe.moe_utils as mu

    if not hasattr(mu, "te_general_gemm"):
        mu.te_general_gemm = None
    if not torch.cuda.is_available():
        import contextlib

        import megatron.core.tensor_parallel.random as mr

        torch.cuda.current_device = lambda: "cpu"

        class _CPUTracker(mr.CudaRNGStatesTracker):
            def fork(self, name: str = "model-parallel-rng"):  # noqa: D102
                return contextlib.nullcontext()

        mr._CUDA_RNG_STATE_TRACKER = _CPUTracker()
        mr._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


@dataclass(frozen=True)
class Layout:
    """This rank's place in the Megatron layout."""

    rank: int
    world_size: int
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int  # data-parallel size of the dense part: world / (tp · pp)
    tp_rank: int
    ep_rank: int
    dp_rank: int


def initialize(tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, *, backend: str | None = None,
               timeout_s: float = 600.0, seed: int = 0) -> Layout:
    """Join the default process group (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment, a
    1-rank group on 127.0.0.1 if unset) and initialise Megatron's model-parallel groups. Idempotent per layout."""
    from megatron.core import parallel_state as ps

    apply_shims()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if "MASTER_PORT" not in os.environ and int(os.environ.get("WORLD_SIZE", 1)) == 1:
            # one rank and no rendezvous given: an in-process store. A TCP store on a port picked here (and kept in
            # the environment for the next group) could find it taken by then: EADDRINUSE on a busy host
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            dist.init_process_group(backend, rank=int(os.environ.get("RANK", 0)),
                                    world_size=int(os.environ.get("WORLD_SIZE", 1)), timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    etp = tp if etp is None else etp
    if world % (tp * pp):
        raise ValueError(f"trainer.megatron: world size {world} is not a multiple of tp·pp = {tp * pp}")
    if world % (etp * ep * pp):
        raise ValueError(f"trainer.megatron: world size {world} is not a multiple of etp·ep·pp = {etp * ep * pp}")
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size()) != (tp, pp, ep):
            raise ValueError("Megatron's parallel state is already initialised with another layout")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        if torch.cuda.is_available():
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
    return Layout(rank=dist.get_rank(), world_size=world, tp=tp, pp=pp, ep=ep, etp=etp,
                  dp=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                  ep_rank=ps.get_expert_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank())


def destroy() -> None:
    """Tear down Megatron's groups and the default group."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
