"""Megatron vs torch parity on the same weights: logits, MTP logits, loss and every gradient, on any (tp, ep)
layout. Used by the tests (gloo on the CPU) and by `bench/megatron_gpu.py` (NCCL on the H200).

Loss of one step: next-token cross-entropy + `mtp_w` × the MTP loss (+ the indexer KL when `indexer`), summed over
tokens and divided by the global token count, so that with expert parallelism (each rank its own rows) the sum of
the ranks' dense gradients is the full-batch gradient, as it is for the experts through the dispatcher.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from model.checkpoint import to_hf_state
from model.config import ModelConfig
from model.losses import indexer_kl_loss
from trainers.optim import grad_of

from .convert import from_megatron, megatron_state


def step_loss(model, ids: torch.Tensor, n_global: int, mtp_w: float = 0.3, indexer: bool = False):
    """(loss, logits, mtp_logits) of `model` (temper Transformer or MegatronGLM) on rows `ids`."""
    out = model.run(ids, collect_indexer=indexer, detach_indexer_input=True)
    lg = out.logits.float()
    loss = F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum") / n_global
    mlg = None
    if len(model.mtp_layers) and mtp_w:
        mlg, _ = model.mtp(out.hidden[:, :-1], ids[:, 1:], 0)
        mlg = mlg.float()
        ml = F.cross_entropy(mlg[:, :-1].reshape(-1, mlg.shape[-1]), ids[:, 2:].reshape(-1), reduction="sum")
        loss = loss + mtp_w * ml / n_global
    if indexer and out.indexer_stats:
        loss = loss + indexer_kl_loss(out.indexer_stats) * ids.shape[0] / n_global
    return loss, lg.detach(), None if mlg is None else mlg.detach()


def hf_grads(model) -> dict[str, torch.Tensor]:
    """A temper Transformer's gradients under HF names, in fp32 (zeros where none; buffers left out). A bf16 weight's
    gradient is its fp32 main gradient where its optimizer keeps one (trainers/optim.py)."""
    g = copy.deepcopy(model).float()
    with torch.no_grad():
        for p, q in zip(model.parameters(), g.parameters(), strict=True):
            q.copy_(grad_of(p) if grad_of(p) is not None else torch.zeros_like(q))
    return dict(to_hf_state(g))


def megatron_grads(model) -> dict[str, torch.Tensor]:
    """A MegatronGLM's gradients under the converter's names (buffers keep their values)."""
    grads = {n: (grad_of(p) if grad_of(p) is not None else torch.zeros_like(p)).detach().float().cpu()
             for n, p in model.named_parameters()}
    return {k: grads.get(k, v.detach().float().cpu()) for k, v in megatron_state(model).items()}


def rank_worker(rank: int, world: int, port: int, tp: int, ep: int, etp: int, payload: str, out_dir: str,
                device: str, dtype: str, experts: str = "grouped") -> None:
    """One rank: build MegatronGLM on the (tp, ep) layout, load its shard, run `step_loss`, save its results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    from megatron.core import parallel_state as ps

    from model import Transformer
    from model.checkpoint import from_hf_state

    from .backend import MegatronBackend

    blob = torch.load(payload, weights_only=False)
    cfg = ModelConfig(**blob["cfg"])
    be = MegatronBackend(tp, 1, ep, etp, dtype=getattr(torch, dtype), experts=experts)
    try:
        ref = Transformer(cfg)
        ref.load_state_dict(from_hf_state(cfg, blob["hf"]), strict=False)
        m = be.wrap(ref)  # this rank's shard
        m.train()
        lay = be.layout
        ids = blob["ids"].to(be.device)
        n_global = ids.shape[0] * (ids.shape[1] - 1)
        rows = ids[be.rank :: be.world_size]  # data parallelism (the ep ranks of a tp = 1 layout): each rank its rows
        loss, lg, mlg = step_loss(m, rows, n_global, blob["mtp_w"], blob["indexer"])
        loss.backward()
        m.finish_backward(average=False)  # the losses are shares of one global sum
        norm = be.clip_grad_norm(m, float("inf"))
        exported = {k: v.float() for k, v in to_hf_state(be.export(m))}  # the gathered weights, as the engines get them
        etp_rank = ps.get_expert_tensor_parallel_rank()
        torch.save({"key": (lay.tp_rank, lay.ep_rank, etp_rank), "dp": (be.rank, be.world_size), "loss": loss.item(),
                    "logits": lg.cpu(), "mtp_logits": None if mlg is None else mlg.cpu(), "grad_norm": float(norm),
                    "grads": megatron_grads(m), "loads": [c.clone().cpu() for c in m.expert_loads()],
                    "weights": {k: v.float().cpu() for k, v in megatron_state(m).items()}, "exported": exported,
                    "experts": sorted({type(x.experts).__name__ for x in m.moe_layers()})},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        be.close()


def run_layout(cfg: ModelConfig, hf: dict[str, torch.Tensor], ids: torch.Tensor, *, tp: int = 1, ep: int = 1,
               etp: int | None = None, device: str = "cpu", dtype: str = "float32", mtp_w: float = 0.3,
               indexer: bool = False, experts: str = "grouped") -> dict:
    """Run `rank_worker` on tp·ep fresh processes; returns the joined loss, logits and HF-named gradients.
    `etp`: the experts' tensor-parallel size (None: tp, Megatron's default); `experts`: the routed experts' module."""
    from trainers.backends import free_port

    world = tp * ep
    etp = tp if etp is None else etp
    out_dir = tempfile.mkdtemp(prefix="temper-mcore-")
    try:
        payload = str(Path(out_dir) / "payload.pt")
        torch.save({"cfg": cfg.model_dump(), "hf": hf, "ids": ids, "mtp_w": mtp_w, "indexer": indexer}, payload)
        torch.multiprocessing.spawn(rank_worker, args=(world, free_port(), tp, ep, etp, payload, out_dir, device, dtype, experts),
                                    nprocs=world, join=True)
        res = [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    shards, weights = {}, {}
    for r in res:
        shards.setdefault(r["key"], r["grads"])
        weights.setdefault(r["key"], r["weights"])
    dp = res[0]["dp"][1]
    if dp > 1:
        res = sorted((r for r in res if r["key"][0] == 0), key=lambda r: r["dp"][0])  # one rank per dp rank
        logits = torch.cat([r["logits"] for r in res], 0)  # dp rank r holds rows r, r + dp, ...
        order = torch.cat([torch.arange(ids.shape[0])[r::dp] for r in range(dp)])
        logits = logits[order.argsort()]
        mtp = None if res[0]["mtp_logits"] is None else torch.cat([r["mtp_logits"] for r in res], 0)[order.argsort()]
        loss = sum(r["loss"] for r in res)
        loads = res[0]["loads"]
    else:
        logits, mtp, loss, loads = res[0]["logits"], res[0]["mtp_logits"], res[0]["loss"], res[0]["loads"]
    return {"loss": loss, "logits": logits, "mtp_logits": mtp, "world": world, "expert_loads": loads,
            "grad_norm": res[0]["grad_norm"], "exported": res[0]["exported"], "experts": res[0]["experts"],
            "grads": from_megatron(shards, cfg, tp=tp, ep=ep, etp=etp, rtol=1e-4),  # each shard: the step's gradient
            "weights": from_megatron(weights, cfg, tp=tp, ep=ep, etp=etp)}
