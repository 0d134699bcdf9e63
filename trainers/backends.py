"""Training backends: the few collective operations a trainer needs, behind one interface.

A trainer written against `TrainBackend` runs unchanged on one process (`TorchBackend`), on several
CPU/GPU processes with torch.distributed (`DDPBackend`), and later on a Megatron-core backend that
implements the same methods with its own parallel state (TP/PP/EP/CP). One step reads::

    model = backend.wrap(model)          # same weights on every rank
    loss = ...                           # this rank's share of the global batch
    backend.backward(loss)
    backend.all_reduce_grads(model)      # every rank now holds the global-batch mean gradient
    clip_grad_norm_(model.parameters(), c)   # identical on every rank
    backend.step(optimizer)
    if backend.is_main: save_training_state(...)

`DDPBackend` averages gradients by hand with `all_reduce` instead of wrapping the model in
`torch.nn.parallel.DistributedDataParallel`, for two reasons:

* DDP hooks only `module.forward`; the trainers call `model.run(...)` and `model.mtp(...)` (losses on
  hidden states, MTP drafts, indexer statistics), which would bypass DDP's bookkeeping.
* MoE routing, DSA (the indexer gets no gradient from the LM loss) and MTP make the set of parameters
  that receive a gradient differ between steps and between ranks. The manual reduction handles that
  exactly like a single process on the whole batch would: a gradient that exists on any rank is
  averaged over all ranks with zeros where a rank had none (its contribution to the batch mean is zero);
  a parameter no rank touched keeps `grad is None`, so the optimizer skips it as it would on one
  process (AdamW would otherwise decay its moments and move it).

It also sums the MoE expert-load counters over ranks, so the aux-loss-free router-bias update after
the step sees the global load and keeps the router biases identical on every rank.

The average over ranks equals the global-batch mean only when every rank's loss is a mean over the
same number of tokens; with uneven masks, scale each rank's loss by
`local_tokens * world_size / global_tokens` first.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from model.layers import MoE

from .optim import ShardedAdamW, grad_of


class TrainBackend(ABC):
    """What a trainer asks of its parallel runtime. `rank` / `world_size` describe the data-parallel
    group; `is_main` is the rank that writes checkpoints and logs."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    activation_checkpointing = False  # set from `trainer.activation_checkpointing` by make_train_backend
    fp32_main_weights = True  # `trainer.fp32_main_weights`: weights below fp32 step through fp32 copies (optimizer)
    device = torch.device("cpu")  # where `wrap` puts the model (`trainer.device`)
    # True where ranks hold different parts of the training state (Megatron's shards and their optimizer moments):
    # every rank then saves and restores its own part (trainers/checkpoint.py); else the main rank saves it whole
    sharded_state = False

    def state_layout(self) -> dict:
        """The layout a sharded training state was saved on, and must be restored on."""
        return {"world": self.world_size}

    def _prepare(self, model: nn.Module) -> nn.Module:
        """What every torch backend's `wrap` does to the model: moves it to the backend's device and sets its
        activation checkpointing switch."""
        model = model.to(self.device)
        if self.activation_checkpointing and hasattr(model, "activation_checkpointing"):
            model.activation_checkpointing = True
        return model

    @abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Prepare a model for training (same initial weights on every rank); returns the module to use."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate this rank's loss."""

    @abstractmethod
    def all_reduce_grads(self, model: nn.Module) -> None:
        """Make every rank's gradients the mean over ranks (see the module docstring for None grads)."""

    @abstractmethod
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the optimizer step (after `all_reduce_grads`)."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank gets here."""

    def close(self) -> None:  # noqa: B027 - optional: most backends have nothing to leave
        """Leave whatever process groups this backend joined."""

    def export(self, model: nn.Module) -> nn.Module:
        """temper's `Transformer` with the trained weights: what weight pushes and checkpoints take. A collective
        where ranks hold shards (every rank must call it); here the model itself."""
        return model

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's mean over the data-parallel ranks, a value a rank lacks counting as 0 (one collective; every
        rank calls it). What turns a rank's share of a batch statistic into the batch's: the trainers weight each
        rank's share so that the mean over ranks is the whole batch's figure."""
        if self.world_size == 1:
            return dict(values)
        got = self.gather_over_ranks(dict(values))
        keys = sorted({k for g in got for k in g})
        return {k: sum(float(g.get(k, 0.0)) for g in got) / self.world_size for k in keys}

    lockstep = False  # True where the data-parallel ranks must run the same forwards and backwards (MegatronBackend)

    def optimizer(self, params, **adamw) -> torch.optim.Optimizer:
        """The trainers' AdamW over `params` (tensors or param groups). Weights below fp32 (a bf16 checkpoint) are
        updated through fp32 main weights and their gradients summed in fp32 (`ShardedAdamW`, unsharded; see
        trainers/optim.py). The Megatron backend with `trainer.megatron.distributed_optimizer` splits them over the
        data-parallel ranks."""
        params = list(params)
        if params and isinstance(params[0], dict):  # each group's parameters read once (a generator would be used up)
            params = [{**g, "params": list(g["params"])} for g in params]
        flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
        if self.fp32_main_weights and any(p.dtype != torch.float32 for p in flat):
            return ShardedAdamW(params, shard=False, **adamw)
        return torch.optim.AdamW(params, **adamw)

    def gather_over_ranks(self, value) -> list:
        """Every data-parallel rank's `value` (a picklable object), in rank order (one collective; every rank calls
        it)."""
        if self.world_size == 1:
            return [value]
        got: list = [None] * self.world_size
        dist.all_gather_object(got, value, group=self.dp_group())
        return got

    def dp_group(self):
        """The process group of the data-parallel ranks (None: the default group)."""
        return None

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients to a total L2 norm of `max_norm`; returns the norm before clipping. A backend whose
        ranks hold different shards of the model (Megatron) computes the norm over the whole model. Weights with an
        fp32 main gradient (trainers/optim.py) are clipped there."""
        params = list(model.parameters())
        if not any(getattr(p, "main_grad", None) is not None for p in params):
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        grads = [g for g in map(grad_of, params) if g is not None]
        total = torch.nn.utils.get_total_norm(grads)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ rule
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, dtype), gs in groups.items():  # one foreach kernel per device and dtype
            torch._foreach_mul_(gs, coef.to(device, dtype))
        return total


class TorchBackend(TrainBackend):
    """One process: plain autograd, reductions are no-ops."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.rank, self.world_size = 0, 1
        self.device = torch.device(device)

    def wrap(self, model: nn.Module) -> nn.Module:
        return self._prepare(model)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def all_reduce_grads(self, model: nn.Module) -> None:
        return None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def barrier(self) -> None:
        return None


class DDPBackend(TrainBackend):
    """Data parallelism over a torch.distributed process group (gloo by default: CPU, no extra deps).

    Joins the default process group if none exists (reading MASTER_ADDR / MASTER_PORT from the
    environment, as `launch` sets them); `close()` leaves it again if this object created it.
    Gradients are averaged with one flag reduction plus bucketed `all_reduce` calls (flat buffers of at
    most `bucket_bytes`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        bucket_bytes: int = 32 << 20,
        device: torch.device | str | None = None,
        distributed_optimizer: bool = False,
    ):
        self.rank, self.world_size = rank, world_size
        self.bucket_bytes = bucket_bytes
        # ZeRO-1: fp32 main weights and Adam's moments split over the ranks (trainers/optim.py); each rank then saves
        # its own part of the training state
        self.distributed_optimizer = distributed_optimizer
        # nccl reduces CUDA tensors: each rank on its own GPU (its LOCAL_RANK, as torchrun sets it); gloo on the host
        # unless told otherwise ("cuda": this rank's GPU, gloo reducing CUDA tensors)
        if device is None:
            device = "cuda" if backend == "nccl" else "cpu"
        if device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank)) % max(1, torch.cuda.device_count())}"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, not {rank} of {world_size}"
            )

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def sharded_state(self) -> bool:  # each rank holds its own part of the optimizer
        return self.distributed_optimizer and self.world_size > 1

    def state_layout(self) -> dict:
        return {"world": self.world_size, "distributed_optimizer": self.distributed_optimizer}

    def optimizer(self, params, **adamw) -> torch.optim.Optimizer:
        """With `distributed_optimizer`: `ShardedAdamW` over the whole group (each rank updates ~1 / world of every
        param group and all-gathers it); otherwise the base rule (AdamW, or fp32 main weights below fp32)."""
        if not self.sharded_state:
            return super().optimizer(params, **adamw)
        return ShardedAdamW(list(params), dense_group=dist.group.WORLD, expert_group=dist.group.WORLD, **adamw)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model on this rank's device with rank 0's parameters and buffers (broadcast)."""
        model = self._prepare(model)
        with torch.no_grad():
            for t in _unique([*model.parameters(), *model.buffers()]):
                dist.broadcast(t.data, src=0)
        return model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def all_reduce_grads(self, model: nn.Module) -> None:
        params = [p for p in _unique(model.parameters()) if p.requires_grad]
        if not params:
            return
        has = torch.tensor([grad_of(p) is not None for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(has, op=dist.ReduceOp.SUM)
        live = []
        for p, n in zip(params, has.tolist()):
            if n == 0:
                continue  # no rank produced a gradient: leave it None everywhere
            if grad_of(p) is None:  # (a weight with an fp32 main gradient gets an fp32 zero one)
                if hasattr(p, "main_grad"):
                    p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                else:
                    p.grad = torch.zeros_like(p)
            live.append(grad_of(p))
        for bucket in _buckets(live, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= self.world_size
            off = 0
            for g in bucket:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()
        for m in model.modules():
            if isinstance(m, MoE):
                dist.all_reduce(m.expert_load, op=dist.ReduceOp.SUM)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def barrier(self) -> None:
        dist.barrier()


def _unique(tensors) -> list[torch.Tensor]:
    """Tensors in order, each once (tied weights appear twice in `model.parameters()` otherwise)."""
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _buckets(grads: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Group gradients of one dtype and device into lists of at most `limit` bytes (one tensor may exceed it)."""
    out: list[list[torch.Tensor]] = []
    cur: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nb = g.numel() * g.element_size()
        if cur and (size + nb > limit or g.dtype != cur[0].dtype or g.device != cur[0].device):
            out.append(cur)
            cur, size = [], 0
        cur.append(g)
        size += nb
    if cur:
        out.append(cur)
    return out


def from_main(backend: TrainBackend, make: Callable[[], Any]) -> Any:
    """The main rank's `make()` on every rank of the process group (one broadcast; `make` runs on the main rank only).
    Every rank of the group counts, data-parallel or not: a Megatron layout's tensor-parallel ranks need the same
    batch too. Without a group of several ranks just `make()`."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return make()
    box = [make() if backend.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def training_device(cfg) -> str:
    """`trainer.device` resolved: "cuda" or "cpu" ("auto": CUDA when there is one)."""
    import torch as _torch

    if cfg.device == "cuda" and not _torch.cuda.is_available():
        raise ValueError("trainer.device: cuda, but torch sees no CUDA device here (use auto or cpu)")
    return cfg.device if cfg.device != "auto" else ("cuda" if _torch.cuda.is_available() else "cpu")


# ---- launching ---------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process could take it before use: launchers
    that rendezvous on it retry with a new one when it was, see `port_taken`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TRIES = 3  # launches whose rendezvous port was taken between `free_port` and the bind


def port_taken(output: str) -> bool:
    """Whether a failed launch failed because its rendezvous port was taken (the store's bind: EADDRINUSE)."""
    return "EADDRINUSE" in output or "address already in use" in output.lower()


def run_torchrun(world_size: int, module_argv: list[str], on_line: Callable[[str], bool],
                 on_retry: Callable[[], None] = lambda: None) -> tuple[int, list[str]]:
    """`python -m torch.distributed.run --nproc_per_node world_size … -m <module_argv>` on 127.0.0.1 with a port from
    `free_port`; every output line (stdout and stderr) goes to `on_line`, which returns whether it belongs in the
    tail kept for errors. When the port was taken before torchrun bound it (EADDRINUSE), it runs again on another,
    up to `PORT_TRIES` times (`on_retry` says so). Returns (exit status, the last 30 kept lines)."""
    import subprocess
    import sys
    from collections import deque

    for attempt in range(PORT_TRIES):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "-m", *module_argv]
        tail: deque[str] = deque(maxlen=30)
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                if on_line(line):
                    tail.append(line.rstrip("\n"))
        if proc.returncode == 0 or attempt + 1 == PORT_TRIES or not port_taken("\n".join(tail)):
            break
        on_retry()
    return proc.returncode, list(tail)


STOP_GRACE_S = 2.0  # when a rank fails: how long the others get to exit, then again after SIGTERM, before SIGKILL


def _worker(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, threads: int, args: tuple) -> None:
    # a rank dies on SIGTERM, whatever its parent ignored or blocked (a child inherits both across exec): a rank
    # stuck in the rendezvous (its port taken, a peer gone) is stopped at once, not after the launcher's SIGKILL wait
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    torch.set_num_threads(threads)
    backend = DDPBackend(rank, world_size)
    try:
        result = fn(backend, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        backend.close()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> list[Any]:
    """Run `fn(backend, *args)` in `world_size` fresh processes joined by a gloo group on 127.0.0.1.

    Each process gets a `DDPBackend` of its rank and `torch.set_num_threads(threads)`. `fn` must be
    importable by name (a module-level function: the children are started with the `spawn` method).
    Returns the per-rank results in rank order (passed back through `torch.save` files in a temporary
    directory, so tensors and plain Python objects work). A failing rank raises
    `torch.multiprocessing.ProcessRaisedException` with its traceback, after the others are stopped: each gets
    `STOP_GRACE_S` to exit, then SIGTERM, then SIGKILL after as long again (torch's own wait before SIGKILL is 30 s).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    out_dir = tempfile.mkdtemp(prefix="temper-launch-")
    try:
        for attempt in range(PORT_TRIES):
            try:
                ctx = torch.multiprocessing.start_processes(
                    _worker, args=(fn, world_size, free_port(), out_dir, threads, args), nprocs=world_size, join=False,
                    start_method="spawn",
                )
                while not ctx.join(grace_period=STOP_GRACE_S):
                    pass
                break
            except torch.multiprocessing.ProcessRaisedException as e:
                if attempt + 1 == PORT_TRIES or not port_taken(str(e)):
                    raise
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
