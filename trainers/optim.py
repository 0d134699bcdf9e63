"""`ShardedAdamW`: AdamW over fp32 main weights, the main weights and Adam's moments split element-exactly over the
ranks that hold a parameter identically (ZeRO stage 1; Megatron's distributed optimizer, on temper's terms).

Where the backends use it (`TrainBackend.optimizer`):

* `trainer.megatron.distributed_optimizer: true`: sharded over the groups gradients are summed over, dense weights
  (and each rank's tensor-parallel shard of them) over the data-parallel group, routed experts over the
  expert-data-parallel group (the ranks holding the same expert shard);
* weights below fp32 (a bf16 checkpoint on the torch or DDP backend, `trainer.megatron.dtype: bfloat16`): the same
  fp32 main weights, unsharded (`shard=False`), as Megatron's mixed-precision optimizer keeps them. Adam's update of
  a bf16 weight is often smaller than half its last bit; a bf16 AdamW rounds it away every step, the main weight
  accumulates it.

How, per bucket (one per param group × rank group × parameter dtype): the bucket's parameters laid end to end form a
flat vector of N elements, cut into W equal ranges of ceil(N / W) (W: the group's size). Rank r owns range r: for each
piece of a parameter inside it (a *segment*) it keeps an fp32 main weight and its Adam moments, in a torch AdamW
whose parameters are the segments: for an fp32 parameter the main weight is the parameter's own slice (a view,
updated in place), for a bf16 one an fp32 copy. `step` hands each segment the matching slice of the gradient (cast
to fp32; a parameter without a gradient is skipped, as AdamW skips it), steps, casts the main weights to the parameter
dtype and all-gathers the ranges into the parameters. The gradients are complete before `step` (the backend's
`all_reduce_grads` and model-wide clip run first), so in fp32 the update is the whole AdamW's, bit for bit: every
AdamW operation is elementwise, and a segment is a slice.

A rank holds 3·ceil(N / W) fp32 elements of optimizer state per bf16 bucket (main weight and two moments), the scale
plan's 12 bytes per parameter over the data-parallel ranks (trainers/megatron/plan.py), and 2·ceil(N / W) per fp32
bucket (`local_state_bytes`). Weights and gradients are not sharded, and the gradients are all-reduced, not
reduce-scattered: stage 1, not 2.

Gradients of weights in a lower precision than fp32 are accumulated in fp32 (Megatron's `main_grad`): the optimizer
hooks each such parameter so that every backward adds its gradient, cast to fp32, into `param.main_grad` and clears
`param.grad`. Micro-batches then sum in fp32, the backends reduce and clip the fp32 sums (`grad_of`), and the step
reads them. A bf16 sum of micro-batch gradients rounds at every addition.

The main weights follow the model where the model's weights change from outside (a checkpoint or `load_hf` into the
model after the optimizer was built): before each update, a bf16 weight whose version counter moved since the last
step (an in-place write: `copy_`, `load_state_dict`; not a write through `.data`) has every element that no longer
equals its main weight's cast taken into the main weight (elementwise, without a host sync). An fp32 weight is its
own main weight.

Checkpoints: `state_dict()` is this rank's part (its segments' main weights and AdamW state), what the sharded
training state's rank files hold (trainers/checkpoint.py); `load_state_dict` takes the same rank's part back and
refuses another layout's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.distributed as dist

_FORMAT = "temper-sharded-adamw-2"
_HYPER = ("lr", "betas", "eps", "weight_decay")  # per param group, copied to the inner AdamW at each step


@dataclass
class _Segment:
    param: torch.Tensor  # the model's parameter
    lo: int  # the piece [lo, hi) of the parameter's flat elements this rank owns
    hi: int
    main: torch.Tensor  # its fp32 main weight (a leaf: the inner AdamW's parameter): a view of an fp32 parameter
    copy: bool  # True: a separate fp32 copy of a lower-precision parameter


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    offsets: list[int]  # each parameter's first element in the bucket's flat vector
    numel: int
    shard: int  # ceil(numel / world): the length of every rank's range
    group: object  # the process group (None: not sharded)
    world: int
    rank: int
    segments: list[_Segment]


def _group_size(group) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient a step uses: the fp32 main gradient where `ShardedAdamW` accumulates one, else `p.grad`."""
    mg = getattr(p, "main_grad", None)
    return mg if mg is not None else p.grad


def set_grad_of(p: torch.Tensor, g: torch.Tensor) -> None:
    """Replace the gradient `grad_of(p)` returned (after a reduction)."""
    if getattr(p, "main_grad", None) is not None:
        p.main_grad = g
    else:
        p.grad = g


def _accumulate_main_grad(p: torch.Tensor) -> None:
    """A post-accumulate-grad hook: `p.grad` (the weights' dtype) added into the fp32 `p.main_grad`, then cleared."""
    if p.main_grad is None:
        p.main_grad = p.grad.to(torch.float32)
    else:
        p.main_grad.add_(p.grad)
    p.grad = None


def keep_main_grads(params) -> None:
    """Accumulate the gradients of `params` below fp32 in fp32 `main_grad`s (once per parameter)."""
    for p in params:
        if p.requires_grad and p.dtype != torch.float32 and not hasattr(p, "main_grad"):
            p.main_grad = None
            p.register_post_accumulate_grad_hook(_accumulate_main_grad)


def _gather(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    fn(out, mine, group=group)


class ShardedAdamW:
    """See the module docstring. `params`: parameters or AdamW param groups. A parameter marked `routed_expert`
    (MegatronGLM marks its routed experts) is sharded over `expert_group`, every other one over `dense_group`;
    `shard=False` (or groups of one rank) keeps every rank's main weights whole. `adamw`: AdamW's defaults (lr, betas,
    eps, weight_decay); `amsgrad`, `maximize` and the rest are refused."""

    def __init__(self, params, *, dense_group=None, expert_group=None, shard: bool = True,
                 gather_chunk: int = 1 << 24, **adamw):
        extra = set(adamw) - set(_HYPER)
        if extra:
            raise ValueError(f"ShardedAdamW: AdamW options {sorted(extra)} are not supported (only {list(_HYPER)})")
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, **adamw}
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.defaults = defaults
        self.gather_chunk = gather_chunk  # elements per rank per all-gather: bounds the step's temporary memory
        self.param_groups: list[dict] = []  # the trainers set each step's lr here; `params` are the model's
        for g in groups:
            unknown = set(g) - {"params", *_HYPER}
            if unknown:
                raise ValueError(f"ShardedAdamW: param group options {sorted(unknown)} are not supported")
            self.param_groups.append({**defaults, **g, "params": list(g["params"])})
        seen: set[int] = set()
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in seen:
                    raise ValueError("ShardedAdamW: a parameter appears in more than one param group")
                seen.add(id(p))
        self.buckets: list[list[_Bucket]] = []  # per param group
        inner_groups = []
        for g in self.param_groups:
            mine: list[_Bucket] = []
            for want, group in ((False, dense_group), (True, expert_group)):
                dtypes = sorted({p.dtype for p in g["params"] if getattr(p, "routed_expert", False) == want}, key=str)
                for dt in dtypes:
                    ps = [p for p in g["params"] if getattr(p, "routed_expert", False) == want and p.dtype == dt]
                    mine.append(self._bucket(ps, group if shard else None))
            self.buckets.append(mine)
            inner_groups.append({**{k: g[k] for k in _HYPER}, "params": [s.main for b in mine for s in b.segments]})
        keep_main_grads(p for g in self.param_groups for p in g["params"])
        self._inner = torch.optim.AdamW(inner_groups, **{k: defaults[k] for k in _HYPER}) \
            if any(grp["params"] for grp in inner_groups) else None
        self._seen = self._versions()  # each weight's version counter as this optimizer last left it

    @staticmethod
    def _bucket(params: list[torch.Tensor], group) -> _Bucket:
        world, rank = _group_size(group)
        offsets, n = [], 0
        for p in params:
            if not p.is_contiguous():
                raise ValueError(f"ShardedAdamW: a parameter of shape {tuple(p.shape)} is not contiguous")
            offsets.append(n)
            n += p.numel()
        shard = -(-n // world)
        lo_r, hi_r = rank * shard, min((rank + 1) * shard, n)
        segments = []
        for p, off in zip(params, offsets, strict=True):
            lo, hi = max(lo_r, off) - off, min(hi_r, off + p.numel()) - off
            if lo < hi:
                flat = p.detach().view(-1)[lo:hi]
                copy = p.dtype != torch.float32
                segments.append(_Segment(p, lo, hi, flat.to(torch.float32, copy=True) if copy else flat, copy))
        return _Bucket(params, offsets, n, shard, group if world > 1 else None, world, rank, segments)

    # ---- the optimizer interface the trainers use ------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                for attr in ("grad", "main_grad"):
                    t = getattr(p, attr, None)
                    if t is None:
                        continue
                    if set_to_none:
                        setattr(p, attr, None)
                    else:
                        t.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        if self._inner is not None:
            for g, inner in zip(self.param_groups, self._inner.param_groups, strict=True):
                inner.update({k: g[k] for k in _HYPER})
            for buckets in self.buckets:
                for b in buckets:
                    for s in b.segments:
                        if s.copy and s.param._version != self._seen[id(s.param)]:  # changed from outside: the
                            cur = s.param.detach().view(-1)[s.lo:s.hi]  # main weight takes its value wherever the
                            torch.where(cur == s.main.to(cur.dtype), s.main, cur, out=s.main)  # two now differ
                        g = grad_of(s.param)
                        s.main.grad = None if g is None else g.detach().reshape(-1)[s.lo:s.hi].to(torch.float32)
            self._inner.step()
            for s in self._segments():
                s.main.grad = None
        for buckets in self.buckets:
            for b in buckets:
                self._publish(b)
        self._seen = self._versions()

    def _versions(self) -> dict[int, int]:
        return {id(p): p._version for g in self.param_groups for p in g["params"]}

    @staticmethod
    def _pieces(b: _Bucket, start: int, end: int):
        """(parameter, lo, hi, at) for each parameter piece [lo, hi) inside the bucket's flat range [start, end),
        `at` being where the piece begins in that range."""
        i = max(0, bisect.bisect_right(b.offsets, start) - 1)
        while i < len(b.params) and b.offsets[i] < end:
            off, p = b.offsets[i], b.params[i]
            lo, hi = max(start, off) - off, min(end, off + p.numel()) - off
            if lo < hi:
                yield p, lo, hi, off + lo - start
            i += 1

    def _publish(self, b: _Bucket) -> None:
        """The bucket's parameters ← every rank's main weights, cast to the parameter dtype: one all-gather per
        `gather_chunk` elements of a rank's range, so the step's temporary memory is world × gather_chunk elements."""
        if b.numel == 0:
            return
        if b.group is None:
            for s in b.segments:
                if s.copy:  # (a view was updated in place)
                    s.param.detach().view(-1)[s.lo:s.hi].copy_(s.main)
            return
        dtype, device = b.params[0].dtype, b.params[0].device
        seg = {id(s.param): s for s in b.segments}  # a rank's range is contiguous: one piece per parameter
        base = b.rank * b.shard
        for c0 in range(0, b.shard, self.gather_chunk):
            n = min(self.gather_chunk, b.shard - c0)
            mine = torch.zeros(n, dtype=dtype, device=device)
            for p, lo, hi, at in self._pieces(b, base + c0, base + c0 + n):
                s = seg[id(p)]
                mine[at:at + hi - lo] = s.main[lo - s.lo:hi - s.lo]
            out = torch.empty(n * b.world, dtype=dtype, device=device)
            _gather(out, mine, b.group)
            for r in range(b.world):
                for p, lo, hi, at in self._pieces(b, r * b.shard + c0, r * b.shard + c0 + n):
                    p.detach().view(-1)[lo:hi].copy_(out[r * n + at:r * n + at + hi - lo])

    def _segments(self) -> list[_Segment]:
        return [s for buckets in self.buckets for b in buckets for s in b.segments]

    def _layout(self) -> list[list[tuple]]:
        return [[(b.numel, b.world, b.rank, str(b.params[0].dtype) if b.params else "",
                  [(s.lo, s.hi) for s in b.segments]) for b in buckets] for buckets in self.buckets]

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part: its segments' fp32 main weights and their AdamW state, and the layout they belong to."""
        return {"format": _FORMAT, "layout": self._layout(),
                "main": [s.main.clone() if s.copy else None for s in self._segments()],  # fp32: the weights
                "inner": self._inner.state_dict() if self._inner is not None else None,
                "hyper": [{k: g[k] for k in _HYPER} for g in self.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != _FORMAT or state.get("layout") != self._layout():
            raise ValueError("ShardedAdamW: the state is not this optimizer's (fp32 main weights over these "
                             "parameters and ranks). Resume with the same model dtype (a bf16 checkpoint, "
                             "trainer.megatron.dtype), trainer.megatron.distributed_optimizer and layout")
        for s, main in zip(self._segments(), state["main"], strict=True):
            if s.copy:
                s.main.copy_(main)
        if self._inner is not None:
            self._inner.load_state_dict(state["inner"])
        for g, h in zip(self.param_groups, state["hyper"], strict=True):
            g.update(h)

    # ---- what a rank holds -----------------------------------------------------------------------------
    def local_state_numel(self) -> int:
        """Elements of Adam's moments this rank holds."""
        if self._inner is None:
            return 0
        return sum(t.numel() for st in self._inner.state.values() for k, t in st.items()
                   if k in ("exp_avg", "exp_avg_sq"))

    def local_shard_numel(self) -> int:
        """Elements of the parameters this rank updates (its ranges; what its moments cover once every segment stepped)."""
        return sum(s.hi - s.lo for s in self._segments())

    def local_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam's moments and the fp32 copies of lower-precision weights."""
        copies = sum(s.main.numel() for s in self._segments() if s.copy)
        return 4 * (self.local_state_numel() + copies)
