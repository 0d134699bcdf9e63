"""HF layout ↔ `MegatronGLM` shards, both ways, for any (tp, ep, etp) layout. Pure torch: no Megatron import.

A rank's shard is named by (tp_rank, ep_rank, etp_rank). The rules, per HF tensor:

* replicated on every rank: norms, the down projections `q_a_proj` / `kv_a_proj_with_mqa`, the indexer's key
  `wk` and `k_norm`, the router weight and expert bias;
* split by heads over tp along the output rows (`ColumnParallelLinear`): `q_b_proj` (or `q_proj`), `kv_b_proj`,
  the indexer's `wq_b` and `weights_proj`; rows are head-major, so rank r holds heads [r·H/tp, (r+1)·H/tp);
* split over tp along the input columns (`RowParallelLinear`): `o_proj`, the dense and shared MLPs' `down_proj`;
* gated MLPs: Megatron's `linear_fc1` is [gate; up] of the rank's slice of the intermediate dim, so rank r holds
  cat(gate_r, up_r) (not a plain row split);
* vocab split over tp: `embed_tokens`, `lm_head`; MTP's `eh_proj` is column-parallel (output rows);
* routed experts: expert e lives on ep rank e // (E/ep) as `local_experts.{e mod E/ep}`, its fc1/fc2 split over
  etp like a gated MLP. With grouped experts (`experts.GroupedExperts`, `grouped=True`) a rank's local experts are
  stacked instead: `experts.fc1_weight` [E/ep, 2·I/etp, H] and `experts.fc2_weight` [E/ep, H, I/etp], local expert j
  at index j.

`to_megatron(hf, cfg, ...)` builds one rank's shard; `from_megatron(shards, cfg, ...)` joins every rank's shard back
into the HF dict. Both only slice and concatenate, so a round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from model.config import ModelConfig

REP, COL, ROW, GLU, VOCAB = "rep", "col", "row", "glu", "vocab"


def _same(hf: str, mg: str, items: list[tuple[str, str]]) -> Iterator[tuple[tuple[str, ...], str, str]]:
    """Rules for tensors named alike under the two prefixes."""
    for name, kind in items:
        yield (hf + name,), mg + name, kind


def _rules(cfg: ModelConfig) -> Iterator[tuple[tuple[str, ...], str, str]]:
    """(HF names, Megatron name, kind) for every non-expert tensor of the model."""
    L = cfg.num_hidden_layers
    yield ("model.embed_tokens.weight",), "embed_tokens.weight", VOCAB
    yield ("model.norm.weight",), "norm.weight", REP
    if not cfg.tie_word_embeddings:  # tied: the head is the embedding (HF writes no lm_head, as Megatron none)
        yield ("lm_head.weight",), "lm_head.weight", VOCAB
    types = cfg.layer_indexer_types()
    for i in range(L + cfg.num_nextn_predict_layers):
        hf = f"model.layers.{i}."
        mg = f"decoder.layers.{i}." if i < L else f"mtp_layers.{i - L}.layer."
        if i >= L:
            top = f"mtp_layers.{i - L}."
            yield from _same(hf, top, [("enorm.weight", REP), ("hnorm.weight", REP), ("eh_proj.weight", COL)])
            yield (hf + "shared_head.norm.weight",), top + "shared_head_norm.weight", REP
        yield (hf + "input_layernorm.weight",), mg + "input_layernorm.weight", REP
        yield (hf + "post_attention_layernorm.weight",), mg + "pre_mlp_layernorm.weight", REP
        a, ma = hf + "self_attn.", mg + "self_attention."  # temper's MLA: the same names on both sides
        q = [("q_a_proj.weight", REP), ("q_a_layernorm.weight", REP), ("q_b_proj.weight", COL)] \
            if cfg.q_lora_rank else [("q_proj.weight", COL)]
        yield from _same(a, ma, [*q, ("kv_a_proj_with_mqa.weight", REP), ("kv_a_layernorm.weight", REP),
                                 ("kv_b_proj.weight", COL), ("o_proj.weight", ROW)])
        if (types[i] == "full") if i < L else cfg.use_dsa:
            yield from _same(a + "indexer.", ma + "indexer.", [
                ("wq_b.weight", COL), ("wk.weight", REP), ("k_norm.weight", REP), ("k_norm.bias", REP),
                ("weights_proj.weight", COL)])
        m, mm = hf + "mlp.", mg + "mlp."
        if i < L and not cfg.is_moe_layer(i):
            yield (m + "gate_proj.weight", m + "up_proj.weight"), mm + "linear_fc1.weight", GLU
            yield (m + "down_proj.weight",), mm + "linear_fc2.weight", ROW
            continue
        yield (m + "gate.weight",), mm + "router.weight", REP
        yield (m + "gate.e_score_correction_bias",), mm + "router.expert_bias", REP
        if cfg.n_shared_experts:
            s = m + "shared_experts."
            yield (s + "gate_proj.weight", s + "up_proj.weight"), mm + "shared_experts.linear_fc1.weight", GLU
            yield (s + "down_proj.weight",), mm + "shared_experts.linear_fc2.weight", ROW


def _moe_layers(cfg: ModelConfig) -> list[tuple[str, str]]:
    L = cfg.num_hidden_layers
    out = [(f"model.layers.{i}.mlp.experts.", f"decoder.layers.{i}.mlp.experts.local_experts.")
           for i in range(L) if cfg.is_moe_layer(i)]
    out += [(f"model.layers.{L + j}.mlp.experts.", f"mtp_layers.{j}.layer.mlp.experts.local_experts.")
            for j in range(cfg.num_nextn_predict_layers)]
    return out


FC1, FC2 = "fc1_weight", "fc2_weight"  # GroupedExperts' stacked tensors


def is_routed_expert(name: str) -> bool:
    """A routed expert's tensor (sharded over ep and etp, its gradient summed over the expert-data-parallel group),
    in either expert layout; the shared experts are `mlp.shared_experts.`, dense like the rest."""
    return ".mlp.experts." in name


def _stack_experts(shard: dict[str, torch.Tensor], cfg: ModelConfig, per: int) -> None:
    """Per-expert `local_experts.{j}.linear_fc{1,2}.weight` → the stacked `fc1_weight` / `fc2_weight`, in place."""
    for _, mg_pre in _moe_layers(cfg):
        top = mg_pre.removesuffix("local_experts.")
        for n, t in ((1, FC1), (2, FC2)):
            shard[top + t] = torch.stack([shard.pop(f"{mg_pre}{j}.linear_fc{n}.weight") for j in range(per)])


def _unstack_experts(shard: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A shard in either expert layout → the per-expert names (views of the stacked tensors)."""
    out = dict(shard)
    for _, mg_pre in _moe_layers(cfg):
        top = mg_pre.removesuffix("local_experts.")
        for n, t in ((1, FC1), (2, FC2)):
            if top + t in out:
                for j, w in enumerate(out.pop(top + t).unbind(0)):
                    out[f"{mg_pre}{j}.linear_fc{n}.weight"] = w
    return out


def _check(cfg: ModelConfig, tp: int, ep: int, etp: int) -> None:
    if cfg.n_routed_experts % ep:
        raise ValueError(f"expert parallel size {ep} does not divide n_routed_experts={cfg.n_routed_experts}")
    for name, n, k in [("num_attention_heads", cfg.num_attention_heads, tp), ("vocab_size", cfg.vocab_size, tp),
                       ("intermediate_size", cfg.intermediate_size, tp), ("index_n_heads", cfg.index_n_heads, tp),
                       ("moe_intermediate_size", cfg.moe_intermediate_size, etp),
                       ("hidden_size", cfg.hidden_size, tp)]:
        if n % k:
            raise ValueError(f"{name}={n} does not split over {k} ranks")


def _split(kind: str, ts: list[torch.Tensor], n: int, r: int) -> torch.Tensor:
    if kind == REP:
        return ts[0]
    if kind in (COL, VOCAB):
        return ts[0].chunk(n, 0)[r]
    if kind == ROW:
        return ts[0].chunk(n, 1)[r]
    return torch.cat([ts[0].chunk(n, 0)[r], ts[1].chunk(n, 0)[r]], 0)  # GLU


def _join(kind: str, parts: list[torch.Tensor], name: str = "", rtol: float = 0.0) -> list[torch.Tensor]:
    if kind == REP:
        for r, p in enumerate(parts[1:], 1):
            if not torch.equal(p, parts[0]):
                d, top = (p.float() - parts[0].float()).abs().max().item(), parts[0].float().abs().max().item()
                if d <= rtol * top:
                    continue
                raise ValueError(f"{name}: replicated tensor differs between tp ranks 0 and {r} "
                                 f"(max |diff| {d:.3g} of {top:.3g})")
        return [parts[0]]
    if kind in (COL, VOCAB):
        return [torch.cat(parts, 0)]
    if kind == ROW:
        return [torch.cat(parts, 1)]
    halves = [p.chunk(2, 0) for p in parts]
    return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]


def to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig, *, tp: int = 1, ep: int = 1, etp: int | None = None,
                tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0, grouped: bool = False) -> dict[str, torch.Tensor]:
    """The shard of rank (tp_rank, ep_rank, etp_rank): Megatron names → tensors (views into `hf` where possible).
    `grouped`: the local experts stacked, as `GroupedExperts` holds them."""
    etp = tp if etp is None else etp
    _check(cfg, tp, ep, etp)
    out: dict[str, torch.Tensor] = {}
    for names, mg, kind in _rules(cfg):
        missing = [n for n in names if n not in hf]
        if missing:
            raise KeyError(f"HF state lacks {', '.join(missing)}")
        out[mg] = _split(kind, [hf[n] for n in names], tp, tp_rank)
    per = cfg.n_routed_experts // ep
    for hf_pre, mg_pre in _moe_layers(cfg):
        for j in range(per):
            e = ep_rank * per + j
            g, u, d = (hf[f"{hf_pre}{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            out[f"{mg_pre}{j}.linear_fc1.weight"] = _split(GLU, [g, u], etp, etp_rank)
            out[f"{mg_pre}{j}.linear_fc2.weight"] = _split(ROW, [d], etp, etp_rank)
    if grouped:
        _stack_experts(out, cfg, per)
    return out


def from_megatron(shards: dict[tuple[int, int, int], dict[str, torch.Tensor]], cfg: ModelConfig, *, tp: int = 1,
                  ep: int = 1, etp: int | None = None, rtol: float = 0.0) -> dict[str, torch.Tensor]:
    """Join every rank's shard (keyed by (tp_rank, ep_rank, etp_rank)) into the HF state dict. Dense tensors are read
    from one shard per tp rank, experts from one shard per (ep rank, etp rank); replicated tensors
    must agree across the tp ranks: bit for bit (weights), or within `rtol` of their largest entry (gradients, whose
    all-reduce may sum in a different order on each rank). Shards may hold their experts in either layout."""
    etp = tp if etp is None else etp
    _check(cfg, tp, ep, etp)
    shards = {k: _unstack_experts(v, cfg) for k, v in shards.items()}
    dense = {k[0]: v for k, v in sorted(shards.items(), reverse=True)}  # tp rank → its shard of lowest ep rank
    expert = {(k[1], k[2]): v for k, v in sorted(shards.items(), reverse=True)}  # (ep, etp) rank → a shard
    missing = [r for r in range(tp) if r not in dense] + [k for k in
                                                          ((e, t) for e in range(ep) for t in range(etp)) if k not in expert]
    if missing:
        raise KeyError(f"from_megatron: no shard for ranks {missing}")
    hf: dict[str, torch.Tensor] = {}
    for names, mg, kind in _rules(cfg):
        parts = [dense[r][mg] for r in range(tp)]
        for n, t in zip(names, _join(kind, parts, mg, rtol)):
            hf[n] = t
    per = cfg.n_routed_experts // ep
    for hf_pre, mg_pre in _moe_layers(cfg):
        for e in range(cfg.n_routed_experts):
            er, j = divmod(e, per)
            fc1 = [expert[(er, k)][f"{mg_pre}{j}.linear_fc1.weight"] for k in range(etp)]
            fc2 = [expert[(er, k)][f"{mg_pre}{j}.linear_fc2.weight"] for k in range(etp)]
            hf[f"{hf_pre}{e}.gate_proj.weight"], hf[f"{hf_pre}{e}.up_proj.weight"] = _join(GLU, fc1)
            hf[f"{hf_pre}{e}.down_proj.weight"] = _join(ROW, fc2)[0]
    return hf


def megatron_state(model) -> dict[str, torch.Tensor]:
    """A MegatronGLM's own tensors under the converter's names (Megatron's `_extra_state` entries dropped; with tied
    embeddings the head's name of the one tensor too)."""
    tied = model.config.tie_word_embeddings
    return {k: v for k, v in model.state_dict().items()
            if torch.is_tensor(v) and not k.endswith("_extra_state") and not (tied and k == "lm_head.weight")}


def load_into(model, hf: dict[str, torch.Tensor], *, tp: int = 1, ep: int = 1, etp: int | None = None,
              tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Copy this rank's shard of `hf` into a MegatronGLM (every tensor must be covered, shapes must match)."""
    own = megatron_state(model)
    shard = to_megatron(hf, model.config, tp=tp, ep=ep, etp=etp, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank,
                        grouped=any(k.endswith(".experts." + FC1) for k in own))
    if set(shard) != set(own):
        extra, missing = sorted(set(shard) - set(own)), sorted(set(own) - set(shard))
        raise KeyError(f"shard/model mismatch: unexpected {extra[:5]}, missing {missing[:5]}")
    with torch.no_grad():
        for k, t in own.items():
            if t.shape != shard[k].shape:
                raise ValueError(f"{k}: shard shape {tuple(shard[k].shape)} != model {tuple(t.shape)}")
            t.copy_(shard[k])
