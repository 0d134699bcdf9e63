"""temper's GLM-5 model built from Megatron-core parts, for the `trainer.kind: megatron` backend.

What Megatron supplies: the parallel state, `TransformerBlock` / `TransformerLayer` (built from
`get_gpt_decoder_block_spec`, so the first `first_k_dense_replace` layers are dense and the rest MoE), its
tensor-parallel linears and vocab-parallel embedding, and the MoE layer (`TopKRouter` with sigmoid scores, the
expert bias, group-limited top-k and the routed scaling factor; the token dispatcher; `SharedExpertMLP`; and, with
`experts="sequential"`, its `SequentialMLP` experts).

What temper supplies, as a `ModuleSpec` in the layer's `self_attention` slot: MLA with the DSA lightning indexer
and IndexShare (`MegatronMLA`, temper's own `model.attention.MLA` with its heads split over the tensor-parallel
ranks). Megatron's MLA spec cannot be built without Transformer Engine (its local `DotProductAttention` rejects
`k_channels`) and its DSA spec supports only Transformer Engine, so the attention core is temper's: the Triton
sparse-MLA and indexer kernels on a GPU, the torch twins elsewhere. By default (`experts="grouped"`) the routed
experts are temper's too, in the layer's `experts` slot: `GroupedExperts`, two grouped GEMMs per layer on the kernels'
`grouped_linear` (trainers/megatron/experts.py), where `SequentialMLP` loops over the experts.

`MegatronGLM` is a training model with the interface the trainers use on `model.Transformer`: `run(ids)` →
`ModelOutput(logits, hidden)`, `mtp(hidden, next_ids, step)`, `mtp_layers`, `norm`, `lm_head`, `config` (the
temper `ModelConfig`), `attention_modules()`, `update_router_bias(rate)`, `moe_layers()`. So `LMTrainer`,
`SAOTrainer` and the OPD trainer run on it unchanged. It has no KV cache: the engines keep temper's own model and
receive the weights in HF layout (`trainers.megatron.convert.to_hf`), the same weight sync as the torch backend.
Megatron's `GPTModel` is not used as the outer class because its forward owns the loss and feeds MTP from inside;
the trainers need the hidden states and each MTP step's logits (SAO's critic, OPD's teachers, the MTP loss).

Activations inside Megatron are [sequence, batch, hidden]; temper's are [batch, sequence, hidden].
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import MLA, AttnContext
from model.config import ModelConfig
from model.layers import RMSNorm, Rotary
from model.transformer import ModelOutput, Transformer
from trainers.optim import grad_of, set_grad_of

from .convert import from_megatron, is_routed_expert, load_into, megatron_state
from .experts import GroupedExperts
from .mapping import megatron_args

EXPERTS = ("grouped", "sequential")  # temper's GroupedExperts, or Megatron's SequentialMLP


@functools.cache
def _mcore():
    """The megatron.core modules this file uses (imported lazily: megatron-core is the optional extra)."""
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.transformer import MLATransformerConfig
        from megatron.core.transformer.spec_utils import ModuleSpec, build_module
        from megatron.core.transformer.transformer_block import TransformerBlock
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("trainer.kind=megatron needs megatron-core: pip install 'temper[megatron]'") from e
    return parallel_state, tensor_parallel, get_gpt_decoder_block_spec, MLATransformerConfig, ModuleSpec, \
        build_module, TransformerBlock


def transformer_config(cfg: ModelConfig, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                       dtype: torch.dtype = torch.float32, dispatcher: str | None = None, **overrides: Any):
    """Megatron's MLATransformerConfig for `cfg` on a (tp, pp, ep) layout. Keys the installed Megatron does not
    know (the DSA fields before 0.19) are left out: the attention core is temper's and reads them from `cfg`.
    With tp > 1 the layout is sequence parallel (Megatron requires it for MoE under tensor parallelism: without it
    every tp rank would dispatch the same tokens). `dispatcher`: Megatron's MoE token dispatcher; None: "alltoall"
    with CUDA, else "allgather" (the all-to-all dispatcher allocates CUDA streams)."""
    dispatcher = dispatcher or ("alltoall" if torch.cuda.is_available() else "allgather")
    _, _, _, MLATransformerConfig, *_ = _mcore()
    args = megatron_args(cfg)
    known = set(MLATransformerConfig.__dataclass_fields__)
    args = {k: v for k, v in args.items() if k in known}  # model-level keys (tied embeddings) and pre-0.19 DSA keys
    args.update(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp if etp is not None else tp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=False, pipeline_dtype=dtype,
        use_cpu_initialization=True, perform_initialization=True, init_method_std=cfg.initializer_range,
        activation_func=F.silu, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=False,
        hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=tp > 1, num_query_groups=cfg.num_attention_heads,
    )
    args.update(overrides)
    return MLATransformerConfig(**args)


@dataclass
class ForwardState:
    """What every attention layer of one forward shares: the context and IndexShare's current selection."""

    ctx: AttnContext | None = None
    sel: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


class MegatronMLA(MLA):
    """temper's MLA + DSA as Megatron's `self_attention` submodule, with `num_attention_heads / tp` heads (and as
    many indexer heads) on each tensor-parallel rank. Per-head projections are Megatron's `ColumnParallelLinear`
    (q_b_proj, kv_b_proj, the indexer's wq_b and head weights) and `RowParallelLinear` (o_proj); the down
    projections, norms and the indexer's key are replicated. The tensor-parallel algebra is explicit in the two
    `MLA` hooks: a replicated activation entering per-head work goes through `_FanOut` (its gradient is summed over
    ranks, so replicated weights get identical, complete gradients), and a sum over heads (the indexer score, the
    head-summed attention statistic) through `_SumHeads`. (Megatron's own copy/reduce regions all-reduce a
    contiguous copy and return the original, so a non-contiguous gradient would go unreduced.)
    """

    def __init__(self, config, layer_number: int, cp_comm_type=None, pg_collection=None, *, model_cfg: ModelConfig,
                 state: ForwardState, **_: Any):
        ps, *_ = _mcore()
        tp = ps.get_tensor_model_parallel_world_size()
        H, HI = model_cfg.num_attention_heads, model_cfg.index_n_heads
        if H % tp or (model_cfg.use_dsa and HI % tp):
            raise ValueError(f"tensor parallel size {tp} must divide num_attention_heads={H} and index_n_heads={HI}")
        local = model_cfg.model_copy(update={"num_attention_heads": H // tp, "index_n_heads": HI // tp})
        idx = layer_number - 1
        L = model_cfg.num_hidden_layers
        itype = model_cfg.layer_indexer_types()[idx] if idx < L else ("full" if model_cfg.use_dsa else "none")
        super().__init__(local, idx, itype)
        self.tp, self.state, self.sp = tp, state, bool(config.sequence_parallel)
        mc = _no_sp(config)  # the attention works on the whole sequence: its linears do no sequence-parallel comms

        def col(n_in, n_out):
            return _Column(n_in, n_out, config=mc, init_method=mc.init_method, bias=False, gather_output=False,
                           disable_grad_reduce=True)

        c = model_cfg
        if c.q_lora_rank:
            self.q_b_proj = col(c.q_lora_rank, H * c.qk_head_dim)
        else:
            self.q_proj = col(c.hidden_size, H * c.qk_head_dim)
        self.kv_b_proj = col(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = _Row(H * c.v_head_dim, c.hidden_size, config=mc, init_method=mc.output_layer_init_method,
                           bias=False, input_is_parallel=True, skip_bias_add=False)
        if self.indexer is not None:
            self.indexer.wq_b = col(c.q_lora_rank or c.hidden_size, HI * c.index_head_dim)
            self.indexer.weights_proj = col(c.hidden_size, HI)
            self.indexer.w_scale = (HI * c.index_head_dim) ** -0.5

    def _fan(self, t: torch.Tensor) -> torch.Tensor:
        return _FanOut.apply(t) if self.tp > 1 else t

    def _reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        return _SumHeads.apply(t) if self.tp > 1 else t

    @property
    def _split_heads(self) -> bool:
        return self.tp > 1

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **_: Any):
        """hidden_states [S, B, h] ([S/tp, B, h] sequence parallel) → ([S(/tp), B, h], None)."""
        st, tpl = self.state, _mcore()[1]
        x = hidden_states
        if self.sp:  # the whole sequence; its gradient is complete on every rank (the _FanOut points), so split it back
            x = tpl.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        out, sel = MLA.forward(self, x.transpose(0, 1), st.ctx, st.sel)
        st.sel = sel  # IndexShare: the next layer reads its leader's selection from here
        out = out.transpose(0, 1)
        if self.sp:  # o_proj all-reduced the heads: keep this rank's sequence chunk
            out = tpl.scatter_to_sequence_parallel_region(out)
        return out, None


def _tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous()  # Megatron's own _reduce all-reduces a contiguous copy and returns the input unreduced
    dist.all_reduce(t, group=_mcore()[0].get_tensor_model_parallel_group())
    return t


class _FanOut(torch.autograd.Function):
    """Identity forward; the gradient is summed over the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return _tp_all_reduce(g.clone())


class _SumHeads(torch.autograd.Function):
    """Sum over the tensor-parallel ranks forward; identity backward (each rank's term has its own parameters)."""

    @staticmethod
    def forward(ctx, t):
        return _tp_all_reduce(t.clone())

    @staticmethod
    def backward(ctx, g):
        return g


@functools.cache
def _linear_classes():
    _, tpl, *_ = _mcore()

    class Column(tpl.ColumnParallelLinear):
        """Megatron's ColumnParallelLinear returning the output alone (temper's MLA calls it like nn.Linear)."""

        def forward(self, x):  # noqa: D102
            return super().forward(x)[0]

    class Row(tpl.RowParallelLinear):
        def forward(self, x):  # noqa: D102
            return super().forward(x)[0]

    return Column, Row


def _Column(*a, **kw):
    return _linear_classes()[0](*a, **kw)


def _Row(*a, **kw):
    return _linear_classes()[1](*a, **kw)


def _mark_tp_shards(model: nn.Module) -> None:
    """Mark each parallel linear's and the vocab embedding's weight `tensor_model_parallel` where it holds a slice.
    Megatron sets the mark only inside its initialisers, which `perform_initialization=False` (the backend loads
    every tensor) skips; the model-wide clip norm and Megatron's own duplicate test read it."""
    _, tpl, *_ = _mcore()
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if w is None:
            continue
        if isinstance(mod, tpl.ColumnParallelLinear):
            split, dim = mod.output_size_per_partition != mod.output_size, 0
        elif isinstance(mod, tpl.RowParallelLinear):
            split, dim = mod.input_size_per_partition != mod.input_size, 1
        elif isinstance(mod, tpl.VocabParallelEmbedding):
            split, dim = mod.num_embeddings_per_partition != mod.num_embeddings, 0
        else:
            continue
        w.tensor_model_parallel, w.partition_dim, w.partition_stride = split, dim if split else -1, 1


def _no_sp(config):
    """A copy of Megatron's config with sequence parallelism off (for modules that see the whole sequence)."""
    c = copy.copy(config)
    c.sequence_parallel = False
    return c


class _Norm(RMSNorm):
    """temper's RMSNorm (kernels.rms_norm) with Megatron's norm constructor (config, hidden_size, eps). Inside a
    sequence-parallel layer it sees one chunk of the sequence: its weight is marked `sequence_parallel`, and the
    backend sums such gradients over the tp ranks (as Megatron's finalize_model_grads does)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5):
        super().__init__(hidden_size, eps)
        if config is not None and config.sequence_parallel:
            self.weight.sequence_parallel = True


class MTPBlock(nn.Module):
    """One MTP layer: eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]) → a Megatron TransformerLayer (MoE, full indexer)."""

    def __init__(self, cfg: ModelConfig, mcfg, layer_spec, layer_number: int):
        super().__init__()
        *_, build_module, _ = _mcore()
        self.enorm = _Norm(hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hnorm = _Norm(hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eh_proj = _Column(2 * cfg.hidden_size, cfg.hidden_size, config=_no_sp(mcfg),
                               init_method=mcfg.init_method, bias=False, gather_output=True)
        self.layer = build_module(layer_spec, config=mcfg, layer_number=layer_number)
        self.shared_head_norm = _Norm(hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps)


def _shared_on_copy() -> tuple[type, ...]:
    """What a `MegatronGLM` deep copy shares instead of copying: process groups, and the CUDA events and streams
    Megatron's all-to-all token dispatcher keeps after a forward on a GPU (`d2h_event`), which cannot be copied."""
    from torch.distributed import ProcessGroup

    return (ProcessGroup, torch.cuda.Event, torch.cuda.Stream, *EXTRA_SHARED_ON_COPY)


EXTRA_SHARED_ON_COPY: list[type] = []  # more handle types to share (the tests add one that cannot be copied)


class MegatronGLM(nn.Module):
    """See the module docstring. Build with `MegatronGLM(cfg, mcfg)` after `parallel.initialize(...)`."""

    # model/losses.py may take its losses through `lm_head(norm(h))` in row chunks: the head gathers each chunk's
    # logits over the vocabulary's tensor-parallel ranks (every rank runs the same chunks)
    supports_head_chunks = True

    def __init__(self, config: ModelConfig, mcfg, experts: str = "grouped"):
        super().__init__()
        ps, tpl, get_block_spec, _, ModuleSpec, build_module, TransformerBlock = _mcore()
        if experts not in EXPERTS:
            raise ValueError(f"MegatronGLM: experts={experts!r} is not one of {', '.join(EXPERTS)}")
        if ps.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("MegatronGLM runs one pipeline stage; pipeline_model_parallel_size must be 1")
        self.config, self.mcfg = cfg, mcfg = config, mcfg
        self.state = ForwardState()
        attn = ModuleSpec(module=MegatronMLA, params={"model_cfg": cfg, "state": self.state})
        norm = ModuleSpec(module=_Norm)
        block = get_block_spec(mcfg, use_transformer_engine=False, normalization="RMSNorm")
        for spec in block.layer_specs:
            sub = spec.submodules
            sub.self_attention = attn
            sub.input_layernorm = sub.pre_mlp_layernorm = norm
            if experts == "grouped" and getattr(sub.mlp.submodules, "experts", None) is not None:
                sub.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
        self.embed_tokens = tpl.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, init_method=mcfg.init_method,
                                                       config=_no_sp(mcfg))
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.sp = bool(mcfg.sequence_parallel)
        self.decoder = TransformerBlock(mcfg, block, post_layer_norm=False)
        self.norm = _Norm(hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = _Column(cfg.hidden_size, cfg.vocab_size, config=_no_sp(mcfg), init_method=mcfg.init_method,
                               bias=False, gather_output=True)
        if cfg.tie_word_embeddings:  # one tensor: both split the vocabulary's rows over the tp ranks alike (pp = 1)
            self.lm_head.weight = self.embed_tokens.weight
        moe_spec = block.layer_specs[-1]
        if not cfg.is_moe_layer(cfg.num_hidden_layers - 1):
            raise ValueError("MegatronGLM: the last layer must be MoE (the MTP layers copy its spec)")
        L = cfg.num_hidden_layers
        self.mtp_layers = nn.ModuleList(MTPBlock(cfg, mcfg, moe_spec, L + j + 1)
                                        for j in range(cfg.num_nextn_predict_layers))
        self.rotary = Rotary(cfg)
        for m in self.moe_layers():
            m.router.register_forward_hook(self._uncount_padding)
        _mark_tp_shards(self)
        for name, p in self.named_parameters():  # the distributed optimizer shards these over the expert-dp group
            p.routed_expert = is_routed_expert(name)

    def _uncount_padding(self, router, args, out) -> None:
        """The routers count every token they route (Megatron 0.16's padding_mask for the count is broken); take the
        sequence-parallel padding's routes back out, so the loads the bias update sees are the real tokens'."""
        start = self.state.extra.get("pad_from")
        if start is not None and router.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                router.local_tokens_per_expert -= out[1][start:].sum(0).to(router.local_tokens_per_expert.dtype)

    # ---- the Transformer interface the trainers use ------------------------------------------------
    def _context(self, b: int, t: int, device, dtype, **kw) -> AttnContext:
        """The whole-sequence context (no cache), as temper's Transformer builds it (it reads only `self.rotary`)."""
        return Transformer._context(self, b, t, device, dtype, None, None, None, mtp=False, **kw)[0]

    def run(self, input_ids: torch.Tensor, *, dense: bool = False, impl: str = "auto",
            collect_indexer: bool = False, detach_indexer_input: bool = False, logits: bool = True,
            **unsupported: Any) -> ModelOutput:
        if unsupported:
            raise TypeError(f"MegatronGLM.run is a training forward (no KV cache): {', '.join(unsupported)} unsupported")
        b, t = input_ids.shape
        pad = -t % self.tp if self.sp else 0  # sequence parallel: the length must split over the tp ranks
        ids = F.pad(input_ids, (0, pad)) if pad else input_ids
        x = self.embed_tokens(ids)
        ctx = self._context(b, t + pad, x.device, x.dtype, dense=dense, impl=impl,
                            collect=[] if collect_indexer else None, detach_indexer_input=detach_indexer_input)
        h = self._blocks(lambda z, **kw: self.decoder(z, attention_mask=None, **kw), x, ctx, t)
        if pad:  # causal: no real position attends the padding; the statistics keep the real queries and keys
            for e in ctx.collect or []:
                at_sel = e["sel"] is not None  # then logits and target are [B, T, k], at the selected keys
                for k in ("index_logits", "target", "sel"):
                    if e[k] is not None:
                        e[k] = e[k][:, :t] if at_sel or k == "sel" else e[k][:, :t, :t]
        out = self.lm_head(self.norm(h)) if logits else h.new_empty(0)
        return ModelOutput(out, h, ctx.collect, ctx.indexer_calls)

    def _blocks(self, fn, x: torch.Tensor, ctx: AttnContext, t: int) -> torch.Tensor:
        """Run Megatron layers `fn` on x [B, T(+pad), h] → [B, t, h] (the first t positions): to [S, B, h], split over
        the sequence-parallel ranks (padding taken out of the routers' expert-load counts) and gathered back."""
        tpl = _mcore()[1]
        b, tp_len = x.shape[:2]
        z = x.transpose(0, 1).contiguous()
        pad_from = None
        if self.sp:
            z = tpl.scatter_to_sequence_parallel_region(z)
            if tp_len > t:  # this chunk's tokens flattened [S/tp, B]: the padding is the tail from row pad_from
                n = tp_len // self.tp
                pad_from = max(0, t - _mcore()[0].get_tensor_model_parallel_rank() * n) * b
        self.state.ctx, self.state.sel, self.state.extra["pad_from"] = ctx, None, pad_from
        try:
            h = fn(z)
        finally:
            self.state.ctx = self.state.sel = self.state.extra["pad_from"] = None
        if self.sp:  # what follows is replicated with complete gradients: the backward keeps this rank's chunk
            h = tpl.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)
        return h.transpose(0, 1)[:, :t]

    def forward(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        return self.run(input_ids, **kw).logits

    def mtp(self, hidden: torch.Tensor, next_ids: torch.Tensor, step: int = 0, *, impl: str = "auto",
            logits: bool = True, **unsupported: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if unsupported:
            raise TypeError(f"MegatronGLM.mtp is a training forward (no KV cache): {', '.join(unsupported)} unsupported")
        if not len(self.mtp_layers):
            raise RuntimeError("this model has no MTP layer (num_nextn_predict_layers = 0)")
        m = self.mtp_layers[min(step, len(self.mtp_layers) - 1)]
        if step == 0 and self.config.mtp_input == "post_norm":
            hidden = self.norm(hidden)
        b, t = next_ids.shape
        pad = -t % self.tp if self.sp else 0
        if pad:
            next_ids, hidden = F.pad(next_ids, (0, pad)), F.pad(hidden, (0, 0, 0, pad))
        x = m.eh_proj(torch.cat([m.enorm(self.embed_tokens(next_ids)), m.hnorm(hidden)], -1))
        ctx = self._context(b, t + pad, hidden.device, hidden.dtype, impl=impl)
        h = self._blocks(lambda z, **kw: m.layer(z, attention_mask=None, **kw)[0], x, ctx, t)
        return (self.lm_head(m.shared_head_norm(h)) if logits else h.new_empty(0)), h

    def mtp_head_norm(self, step: int = 0) -> nn.Module:
        """The norm MTP draft step `step` applies before the shared `lm_head`."""
        return self.mtp_layers[min(step, len(self.mtp_layers) - 1)].shared_head_norm

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The weights in HF layout (what `save_checkpoint` writes). One rank holds everything only when the model
        is not split; a sharded model is gathered by `MegatronBackend.export`, a collective."""
        if _mcore()[0].get_model_parallel_group().size() > 1 or _mcore()[0].get_expert_model_parallel_world_size() > 1:
            raise RuntimeError("MegatronGLM.hf_state: this rank holds a shard; gather with MegatronBackend.export")
        return from_megatron({(0, 0, 0): megatron_state(self)}, self.config)

    def load_hf(self, hf: dict[str, torch.Tensor]) -> None:
        """Load this rank's shard of an HF-layout state (restoring a training checkpoint)."""
        ps = _mcore()[0]
        load_into(self, hf, tp=self.mcfg.tensor_model_parallel_size, ep=self.mcfg.expert_model_parallel_size,
                  etp=self.mcfg.expert_tensor_parallel_size, tp_rank=ps.get_tensor_model_parallel_rank(),
                  ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank())

    def attention_modules(self) -> list[nn.Module]:
        return [layer.self_attention for layer in self.decoder.layers]

    def moe_layers(self) -> list[nn.Module]:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        return [m for m in self.modules() if isinstance(m, MoELayer)]

    @torch.no_grad()
    def expert_loads(self) -> list[torch.Tensor]:
        """Tokens routed to each expert since the last `update_router_bias`, one tensor per MoE layer."""
        return [m.router.local_tokens_per_expert for m in self.moe_layers()]

    @torch.no_grad()
    def finish_backward(self, average: bool = True) -> None:
        """Make every rank's gradients the step's gradients (what Megatron's DDP and finalize_model_grads do):

        * a weight that saw one sequence-parallel chunk (the layers' norms, the routers) is summed over the tp ranks;
        * dense weights are summed over the data-parallel group, routed experts over the expert-data-parallel group
          (the ranks holding the same expert shard; the dispatcher already brought every ep rank's tokens);
        * `average`: divided by the data-parallel size (each rank's loss a mean over its own rows); otherwise the
          losses are shares of one global sum.
        The routers' expert-load counts are summed over the tp and data-parallel ranks, so the bias update after the
        step sees the global load and keeps the biases identical everywhere."""
        import torch.distributed as dist

        ps = _mcore()[0]
        tp_g, dp_g, edp_g = (ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group(),
                             ps.get_expert_data_parallel_group())
        dp = ps.get_data_parallel_world_size()
        for name, p in self.named_parameters():
            g = grad_of(p)  # bf16 weights: the fp32 main gradient
            if g is None:
                continue
            g = g.contiguous()
            if self.sp and getattr(p, "sequence_parallel", False):
                dist.all_reduce(g, group=tp_g)
            group = edp_g if is_routed_expert(name) else dp_g
            if dist.get_world_size(group) > 1:
                dist.all_reduce(g, group=group)
            if average and dp > 1:
                g /= dp
            set_grad_of(p, g)
        for m in self.moe_layers():
            c = m.router.local_tokens_per_expert
            for group in (tp_g if self.sp else None, dp_g):
                if group is not None and dist.get_world_size(group) > 1:
                    dist.all_reduce(c, group=group)

    @torch.no_grad()
    def update_router_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing, temper's rule on Megatron's counters: bias += rate·sign(mean load − load)."""
        for m in self.moe_layers():
            r = m.router
            load = r.local_tokens_per_expert.float()
            if load.sum() > 0:
                r.expert_bias += rate * torch.sign(load.mean() - load)
            r.local_tokens_per_expert.zero_()

    def __deepcopy__(self, memo):
        """A deep copy (SAO's critic copies the actor) that shares the process groups instead of copying them."""
        shared = _shared_on_copy()
        saved = {t: copy._deepcopy_dispatch.get(t) for t in (*shared, torch.Tensor)}
        for t in shared:  # handles, not data: shared
            copy._deepcopy_dispatch[t] = lambda h, _memo: h
        # Megatron's dispatchers keep the last forward's routing tensors (graph non-leaves): copied detached
        copy._deepcopy_dispatch[torch.Tensor] = lambda t, m: t.__deepcopy__(m) if t.is_leaf else t.detach().clone()
        try:
            cls = self.__class__
            new = cls.__new__(cls)
            memo[id(self)] = new
            for k, v in self.__dict__.items():
                object.__setattr__(new, k, copy.deepcopy(v, memo))
            # a Parameter's deep copy drops its Python attributes, which Megatron and the backend read (the
            # sequence-parallel and tensor-parallel marks, `allreduce`): without them a copy's (SAO's critic's)
            # replicated weights would go unreduced over the tp ranks and its clip norm would miss its shards
            # (not the fp32 main gradient: the copy's optimizer hooks its own parameters, trainers.optim.keep_main_grads)
            for p, q in zip(self.parameters(), new.parameters(), strict=True):
                q.__dict__.update(copy.deepcopy({k: v for k, v in p.__dict__.items() if k != "main_grad"}, memo))
            return new
        finally:
            for t, f in saved.items():
                if f is None:
                    del copy._deepcopy_dispatch[t]
                else:
                    copy._deepcopy_dispatch[t] = f
