"""Parallel layouts and memory per GPU for training a `ModelConfig` on the Megatron backend.

`plan(cfg, n_gpus)` enumerates the (tp, pp, ep) layouts Megatron accepts for the model on `n_gpus` GPUs and
estimates each one's memory per GPU under a few training recipes; `python bench/megatron_plan.py` prints the table
for GLM-5 (`configs/presets/glm5.yaml`) on 8 and 64 H200s (the README's scale section).

Where the numbers come from:

* **Parameters** are counted exactly: the model is built on the meta device and every tensor is put in one class by
  how the backend shards it (`MegatronGLM` and `convert.to_megatron`): routed experts split over ep·etp; the per-head
  projections (`q_b_proj`, `kv_b_proj`, `o_proj`, the indexer's `wq_b` and head weights), the dense and shared-expert
  MLPs, the embedding, the LM head and MTP's `eh_proj` split over tp; everything else (the down projections
  `q_a_proj` / `kv_a_proj_with_mqa`, the indexer's key, the norms, the routers) replicated on every tp rank. Layers go
  to pipeline stages in contiguous, balanced blocks; the embedding sits on the first stage, the final norm, the LM
  head and the MTP layers on the last. The busiest stage sets the memory.
* **Training state** per parameter held: bf16 weights (2 B), gradients (fp32 main grads, 4 B, Megatron's default; or
  bf16, 2 B), and Adam with Megatron's distributed optimizer: fp32 master weights + two moments, sharded over the data-
  parallel ranks of the parameter (the dp group for dense weights, the expert-dp group for experts). `bf16_moments`
  is Megatron's precision-aware optimizer (moments in bf16: 8 B); `offload` keeps the optimizer state in host memory
  (Megatron's `optimizer_cpu_offload`), reported as host GiB per node. temper's own distributed optimizer
  (`trainers.optim.ShardedAdamW`) holds the fp32 master weights and moments so, split element-exactly, with fp32
  main gradients for bf16 weights (the "fp32 grads, fp32 Adam" recipe).
* **Activations** (an estimate, not a measurement) with full activation recompute and sequence parallelism: each
  layer keeps its bf16 input, `2·s·b·h / tp` bytes; the layer being recomputed needs its working set, taken as
  `34·s·b·h / tp` (attention and norms, the dense-transformer count) plus the MoE dispatch (`k` routed copies of each
  token in and out, `4·s·b·k·h`, and the expert MLP's `3·s·b·k·moe_intermediate·2 / etp`); the last stage adds the
  fp32 logits (`4·s·b·V / tp`, vocab-parallel, plus as many for their gradient). Under 1F1B the first stage holds
  `pp` micro-batches in flight.
* **A layout fits** when its total is at most `usable` (0.9) of the GPU's memory: the rest is the CUDA context, NCCL
  buffers and fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model.config import ModelConfig

GIB = 1024**3

# HF names of the tensors `MegatronGLM` splits over tensor parallelism (the rest of the dense weights is replicated)
TP_SPLIT = ("q_b_proj", "q_proj", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.weights_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "shared_experts.", "embed_tokens", "lm_head", "eh_proj")

RECIPES = {
    # name: (grad bytes, optimizer bytes per parameter, optimizer state on the GPU)
    "fp32 grads, fp32 Adam": (4, 12, True),
    "bf16 grads, bf16 moments": (2, 8, True),
    "bf16 grads, optimizer offloaded": (2, 12, False),
}


@dataclass
class Counts:
    """Parameters by how they shard: per decoder layer (tp-split, replicated, experts), plus the pieces on the first
    and last pipeline stage."""

    layers: list[tuple[int, int, int]]  # (tp-split, replicated, routed experts) per decoder layer
    first: tuple[int, int] = (0, 0)  # (tp-split, replicated): the embedding
    last: tuple[int, int, int] = (0, 0, 0)  # final norm, LM head and the MTP layers (tp-split, replicated, experts)
    total: int = 0

    @property
    def experts(self) -> int:
        return sum(e for *_, e in self.layers) + self.last[2]


def count_params(cfg: ModelConfig) -> Counts:
    """Exact parameter counts of temper's model for `cfg`, built on the meta device (no memory)."""
    import torch

    from model import Transformer

    with torch.device("meta"):
        m = Transformer(cfg)
    L = cfg.num_hidden_layers
    layers = [[0, 0, 0] for _ in range(L)]
    first, last = [0, 0], [0, 0, 0]
    for name, p in m.named_parameters():
        n = p.numel()
        kind = 2 if ".experts." in name else 0 if any(k in name for k in TP_SPLIT) else 1
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            (layers[i] if i < L else last)[kind] += n
        elif name.startswith("mtp") or name.startswith("norm") or name.startswith("lm_head"):
            last[kind] += n
        else:
            first[kind] += n
    total = sum(p.numel() for p in m.parameters())
    return Counts([tuple(x) for x in layers], tuple(first), tuple(last), total)


@dataclass
class Layout:
    tp: int
    pp: int
    ep: int
    etp: int = 1
    n_gpus: int = 1

    @property
    def dp(self) -> int:
        return self.n_gpus // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.n_gpus // (self.ep * self.etp * self.pp)

    def __str__(self) -> str:
        return f"tp{self.tp} pp{self.pp} ep{self.ep} dp{self.dp}"


def stage_blocks(n_layers: int, pp: int) -> list[range]:
    """Contiguous, balanced blocks of layers per pipeline stage (the first stages take the extra ones)."""
    q, r = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = q + (s < r)
        out.append(range(start, start + n))
        start += n
    return out


def layouts(cfg: ModelConfig, n_gpus: int, max_tp: int = 8) -> list[Layout]:
    """Every layout Megatron accepts: tp divides the heads (≤ `max_tp`, inside a node), pp ≤ the layers, tp·pp
    divides the GPUs, ep divides the experts and the GPUs left after pp (experts are not tensor-split: etp = 1)."""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if t <= max_tp and cfg.num_attention_heads % t == 0 and n_gpus % t == 0):
        for pp in range(1, min(cfg.num_hidden_layers, n_gpus // tp) + 1):
            if n_gpus % (tp * pp):
                continue
            for ep in range(1, n_gpus // pp + 1):
                if (n_gpus // pp) % ep == 0 and cfg.n_routed_experts % ep == 0:
                    out.append(Layout(tp, pp, ep, 1, n_gpus))
    return out


@dataclass
class Estimate:
    layout: Layout
    recipe: str
    weights: float  # GiB per GPU
    grads: float
    optimizer: float  # on the GPU (0 when offloaded)
    activations: float
    host_per_node: float = 0.0  # GiB of optimizer state per node when offloaded
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def estimate(cfg: ModelConfig, counts: Counts, lay: Layout, recipe: str, *, seq_len: int = 4096,
             micro_batch: int = 1, gpus_per_node: int = 8) -> Estimate:
    """Memory per GPU of the busiest pipeline stage of `lay` under `recipe` (see the module docstring)."""
    grad_b, opt_b, on_gpu = RECIPES[recipe]
    blocks = stage_blocks(cfg.num_hidden_layers, lay.pp)
    s, b, h, k = seq_len, micro_batch, cfg.hidden_size, cfg.num_experts_per_tok
    best = None
    for si, blk in enumerate(blocks):
        tp_split = sum(counts.layers[i][0] for i in blk)
        repl = sum(counts.layers[i][1] for i in blk)
        exp = sum(counts.layers[i][2] for i in blk)
        n_layers = len(blk)
        if si == 0:
            tp_split, repl = tp_split + counts.first[0], repl + counts.first[1]
        if si == lay.pp - 1:
            tp_split, repl, exp = tp_split + counts.last[0], repl + counts.last[1], exp + counts.last[2]
            n_layers += cfg.num_nextn_predict_layers
        dense = tp_split / lay.tp + repl  # parameters this rank holds, outside the experts
        local_exp = exp / (lay.ep * lay.etp)
        held = dense + local_exp
        opt = dense / lay.dp + local_exp / lay.edp  # the distributed optimizer's shard
        in_flight = lay.pp - si  # 1F1B: stage s holds pp − s micro-batches' checkpoints
        moe = any(cfg.is_moe_layer(i) for i in blk)
        work = 34 * s * b * h / lay.tp + (4 * s * b * k * h + 6 * s * b * k * cfg.moe_intermediate_size / lay.etp
                                          if moe else 0)
        act = in_flight * n_layers * 2 * s * b * h / lay.tp + work
        if si == lay.pp - 1:
            act += 2 * 4 * s * b * cfg.vocab_size / lay.tp
        e = Estimate(lay, recipe, 2 * held / GIB, grad_b * held / GIB, opt_b * opt / GIB if on_gpu else 0.0, act / GIB,
                     detail={"stage": si, "layers": n_layers, "params_held": held, "optimizer_shard": opt})
        if not on_gpu:  # every GPU of a node offloads its shard to that node's host memory
            e.host_per_node = opt_b * opt * gpus_per_node / GIB
        if best is None or e.total > best.total:
            best = e
    return best


def plan(cfg: ModelConfig, n_gpus: int, gpu_gib: float = 141.0, usable: float = 0.9, *, seq_len: int = 4096,
         micro_batch: int = 1, top: int = 3, counts: Counts | None = None) -> dict:
    """The layouts that fit on `n_gpus` GPUs of `gpu_gib` GiB, per recipe, best first (least memory, then the
    smallest tp·pp, i.e. the least communication on the critical path); and the fewest GPUs (a multiple of 8) on
    which the first recipe fits at all."""
    counts = counts or count_params(cfg)
    cap = gpu_gib * usable
    out: dict = {"n_gpus": n_gpus, "gpu_gib": gpu_gib, "cap_gib": cap, "params": counts.total,
                 "experts": counts.experts, "recipes": {}}
    for recipe in RECIPES:
        ests = [estimate(cfg, counts, lay, recipe, seq_len=seq_len, micro_batch=micro_batch)
                for lay in layouts(cfg, n_gpus)]
        ests.sort(key=lambda e: (e.total > cap, e.layout.tp * e.layout.pp if e.total <= cap else 0, e.total))
        fits = [e for e in ests if e.total <= cap]
        out["recipes"][recipe] = {"fits": fits[:top], "best_overall": min(ests, key=lambda e: e.total) if ests else None}
    return out


def min_gpus(cfg: ModelConfig, recipe: str, gpu_gib: float = 141.0, usable: float = 0.9, step: int = 8,
             limit: int = 4096, counts: Counts | None = None, **kw) -> int | None:
    """The fewest GPUs (a multiple of `step`) on which some layout of `recipe` fits."""
    counts = counts or count_params(cfg)
    n = step
    while n <= limit:
        if any(estimate(cfg, counts, lay, recipe, **kw).total <= gpu_gib * usable for lay in layouts(cfg, n)):
            return n
        n += step
    return None


def bytes_lower_bound(counts: Counts, recipe: str) -> float:
    """GiB of weights + grads + on-GPU optimizer state for the whole model, whatever the layout (nothing is stored
    twice): the floor that no amount of parallelism removes, only more GPUs."""
    grad_b, opt_b, on_gpu = RECIPES[recipe]
    return counts.total * (2 + grad_b + (opt_b if on_gpu else 0)) / GIB
