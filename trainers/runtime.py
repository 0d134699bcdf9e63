"""The training runtime a `TrainerConfig` names, built: one process, torch data parallelism, or Megatron-core.
Apart from trainers/backends.py so that the backends' module imports no backend built on it (the Megatron
backend subclasses `TrainBackend`): no import circle."""

from __future__ import annotations

from trainers.backends import DDPBackend, TorchBackend, TrainBackend, training_device


def make_train_backend(cfg, rank: int = 0, world_size: int = 1) -> TrainBackend:
    """The training runtime a `TrainerConfig` names: one process (`TorchBackend`), torch data parallelism over
    `world_size` ranks (`DDPBackend`), or Megatron-core (`trainers.megatron.backend.MegatronBackend`)."""
    import torch as _torch

    device = training_device(cfg)
    kind = cfg.dist_backend if cfg.dist_backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if kind == "nccl" and device == "cpu":
        raise ValueError("trainer.dist_backend: nccl reduces CUDA tensors, but trainer.device is cpu here "
                         "(use gloo, or a CUDA device)")
    if cfg.kind == "megatron":
        from trainers.megatron.backend import MegatronBackend  # megatron-core only where it is asked for

        m = cfg.megatron
        be = MegatronBackend(m.tp, 1, m.ep, m.etp, dtype=getattr(_torch, m.dtype), dist_backend=kind,
                             timeout_s=cfg.timeout_s, experts=m.experts, distributed_optimizer=m.distributed_optimizer)
        be.fp32_main_weights = cfg.fp32_main_weights
        return be
    if world_size > 1:
        be = DDPBackend(rank, world_size, backend=kind, timeout_s=cfg.timeout_s, device=device,
                        distributed_optimizer=cfg.distributed_optimizer)
    else:
        be = TorchBackend(device)
    be.activation_checkpointing = cfg.activation_checkpointing
    be.fp32_main_weights = cfg.fp32_main_weights
    return be
