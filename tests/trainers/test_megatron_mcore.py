"""HF ↔ Megatron-core's own GLM-5 / DeepSeek-V3.2 names (trainers/megatron/mcore.py), tested on a state dict from
Megatron-core's own classes.

Megatron-core 0.16 (installed) builds this model without Transformer Engine from its own classes: GPTModel,
TransformerBlock / TransformerLayer, MLASelfAttention, DSAttention + DSAIndexer (the core attention of its DSA spec),
MoELayer with TopKRouter, SequentialMLP and SharedExpertMLP, MultiTokenPredictionBlock and LanguageModelEmbedding,
with its local (non-TE) linears and norms. Two stand-ins, neither holding a name of its own: the indexer's three
linears, which Megatron asks of Transformer Engine (`TELinear`, `parallel_mode="duplicated"`), are a plain linear
with a `weight`, as TELinear has; and `multi_latent_attention.HAVE_TE` is set False (without TE the extension
module defines MagicMock placeholders that make it True, and an isinstance check on one raises). The Hadamard
rotation of the indexer (`rotate_activation`, bf16 and a CUDA package only) is the identity here: it is orthogonal,
so the scores are the same in exact arithmetic. Transformer Engine's spelling (fused norms, grouped experts) cannot
be built here: it is tested on its documented key layout (TELayerNormColumnParallelLinear's `layer_norm_weight`,
TEGroupedMLP's `linear_fc1.weight{e}`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import configs
from model import ModelConfig, Transformer
from model.checkpoint import to_hf_state
from trainers.megatron.convert import from_megatron, to_megatron
from trainers.megatron.mapping import megatron_args
from trainers.megatron.mcore import from_mcore, to_mcore

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw) -> ModelConfig:
    """tiny, in what Megatron-core 0.16 expresses: an indexer in every layer (no IndexShare before 0.19), the ReLU
    score, MTP on the post-norm state (GPTModel's), its norms' epsilon also the indexer key norm's (1e-6, as HF's).
    16 indexer heads: a score is exactly 0 only when all 16 ReLUs are off, and such ties at the top-k boundary are
    broken differently (temper by position, Megatron as torch.topk falls)."""
    base = configs.load("tiny").model.model_dump()
    base.update({"indexer_types": None, "index_share_freq": 1, "mtp_input": "post_norm", "rms_norm_eps": 1e-6,
                 "index_topk": 8, "index_n_heads": 16, "initializer_range": 0.08, **kw})
    return ModelConfig(**base)


def _temper(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # nothing left at its initial value: a dropped or misplaced tensor shows
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.uniform_(0, 0.2)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return m


def _hf(m: Transformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in to_hf_state(m)}


@pytest.fixture(scope="module")
def mcore():
    from trainers.megatron import parallel

    parallel.initialize(1, 1, 1)
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.experimental_attention_variant import dsa

    saved = mla.HAVE_TE, dsa.rotate_activation
    mla.HAVE_TE, dsa.rotate_activation = False, (lambda x: x)
    yield
    mla.HAVE_TE, dsa.rotate_activation = saved
    parallel.destroy()


class _Duplicated(torch.nn.Linear):
    """What Megatron's DSA spec asks Transformer Engine for (TELinear, parallel_mode="duplicated"): a whole linear
    on every rank, with TELinear's `weight` and its (output, bias) return."""

    def __init__(self, n_in, n_out, *, config, init_method, bias, skip_bias_add, skip_weight_param_allocation,
                 parallel_mode):
        super().__init__(n_in, n_out, bias=bias)

    def forward(self, x):
        return super().forward(x), None


def _gpt(cfg: ModelConfig):
    """Megatron-core's GPTModel of `cfg` (MLA + DSA + MoE + MTP), from its own classes (see the module docstring)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.spec_utils import ModuleSpec

    args = {k: v for k, v in megatron_args(cfg).items() if k in MLATransformerConfig.__dataclass_fields__}
    args.update(use_cpu_initialization=True, activation_func=F.silu, num_query_groups=cfg.num_attention_heads,
                moe_token_dispatcher_type="allgather", hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True,
                experimental_attention_variant="dsa", dsa_indexer_n_heads=cfg.index_n_heads,
                dsa_indexer_head_dim=cfg.index_head_dim, dsa_indexer_topk=cfg.index_topk)
    mcfg = MLATransformerConfig(**args)
    block = get_gpt_decoder_block_spec(mcfg, use_transformer_engine=False, normalization="RMSNorm")
    indexer = ModuleSpec(module=dsa.DSAIndexer, submodules=dsa.DSAIndexerSubmodules(
        linear_wq_b=_Duplicated, linear_wk=_Duplicated, linear_weights_proj=_Duplicated,
        k_norm=LocalSpecProvider().layer_norm(rms_norm=False, for_qk=True)))
    core = ModuleSpec(module=dsa.DSAttention, submodules=dsa.DSAttentionSubmodules(indexer=indexer))
    for spec in block.layer_specs:
        spec.submodules.self_attention.submodules.core_attention = core
    mtp = get_gpt_mtp_block_spec(mcfg, block.layer_specs[-1], use_transformer_engine=False)
    return GPTModel(mcfg, block, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                    mtp_block_spec=mtp, position_embedding_type="none",
                    share_embeddings_and_output_weights=cfg.tie_word_embeddings).eval()


def _own(gpt) -> dict[str, torch.Tensor]:
    return {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}


# ---- names ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_the_names_and_shapes_are_megatron_cores_own(mcore, tied):
    cfg = _cfg(tie_word_embeddings=tied)
    hf = _hf(_temper(cfg))
    gpt = _gpt(cfg)
    own, ours = _own(gpt), to_mcore(hf, cfg)
    assert set(ours) == set(own), (sorted(set(ours) - set(own))[:5], sorted(set(own) - set(ours))[:5])
    for k, t in own.items():
        assert ours[k].shape == t.shape, k
    assert ("output_layer.weight" in own) is not tied  # Megatron's head reads the embedding when tied
    missing, unexpected = gpt.load_state_dict(ours, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    back = from_mcore(gpt.state_dict(), cfg)  # what Megatron holds reads back bit for bit, every tensor
    assert set(back) == set(hf) and ("lm_head.weight" in hf) is not tied
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_megatron_cores_forward_matches_temper_on_the_converted_weights(mcore):
    """The converted weights in Megatron-core's GPTModel give temper's logits and MTP logits: every layout is right
    (MLA's projections, the indexer's rotary dims moved last, fc1 = [gate; up], the router and its bias), and Megatron
    feeds MTP the post-norm state (temper's `mtp_input="post_norm"`)."""
    cfg = _cfg()
    ours = _temper(cfg)
    gpt = _gpt(cfg)
    gpt.load_state_dict(to_mcore(_hf(ours), cfg), strict=False)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    assert ids.shape[1] > cfg.index_topk  # the indexer's selection matters
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        h = gpt.decoder(hidden_states=gpt.embedding(input_ids=ids, position_ids=pos), attention_mask=None)
        got = gpt.output_layer(h)[0].transpose(0, 1)  # Megatron: [s, b, v]
        both = gpt.mtp(input_ids=ids, position_ids=pos, hidden_states=h, attention_mask=None, embedding=gpt.embedding)
        got_mtp = gpt.output_layer(both.chunk(2, 0)[1])[0].transpose(0, 1)[:, :-1]  # its last row reads a rolled-in 0
        out = ours.run(ids, collect_indexer=True)
        want_mtp = ours.mtp(out.hidden[:, :-1], ids[:, 1:], 0)[0]
    for st in out.indexer_stats:  # no exact ties (see _cfg): the two top-k rules select the same tokens
        scores = st["index_logits"]
        assert (scores[scores.isfinite()] != 0).all()
    scale = out.logits.abs().max()
    assert (got - out.logits).abs().max() <= 1e-4 * scale
    assert (got_mtp - want_mtp).abs().max() <= 1e-4 * want_mtp.abs().max()
    # what pre-norm MTP input would have given differs: the comparison can tell the conventions apart
    pre = Transformer(cfg.model_copy(update={"mtp_input": "pre_norm"})).eval()
    pre.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (pre.mtp(out.hidden[:, :-1], ids[:, 1:], 0)[0] - got_mtp).abs().max() > 1e-2 * want_mtp.abs().max()


# ---- layouts by hand -------------------------------------------------------------------------------------------
def test_layouts_by_hand():
    cfg = _cfg()
    hf = _hf(_temper(cfg))
    mc = to_mcore(hf, cfg)
    a, ma = "model.layers.0.self_attn.", "decoder.layers.0.self_attention."
    d, r, H = cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_n_heads
    # the indexer: each head's rotary rows (HF: the first r) moved after the others; the key norm likewise
    wq = hf[a + "indexer.wq_b.weight"].view(H, d, -1)
    assert torch.equal(mc[ma + "core_attention.indexer.linear_wq_b.weight"],
                       torch.cat([wq[:, r:], wq[:, :r]], 1).reshape(H * d, -1))
    wk = hf[a + "indexer.wk.weight"]
    assert torch.equal(mc[ma + "core_attention.indexer.linear_wk.weight"], torch.cat([wk[r:], wk[:r]]))
    for p in ("weight", "bias"):
        kn = hf[a + f"indexer.k_norm.{p}"]
        assert torch.equal(mc[ma + f"core_attention.indexer.k_norm.{p}"], torch.cat([kn[r:], kn[:r]]))
    # the head weights and every MLA projection: as they are
    assert torch.equal(mc[ma + "core_attention.indexer.linear_weights_proj.weight"], hf[a + "indexer.weights_proj.weight"])
    assert torch.equal(mc[ma + "linear_kv_up_proj.weight"], hf[a + "kv_b_proj.weight"])
    assert torch.equal(mc[ma + "q_layernorm.weight"], hf[a + "q_a_layernorm.weight"])
    # gated MLPs: fc1 = [gate; up]; fc2 = down, unsplit
    m = "model.layers.0.mlp."
    assert torch.equal(mc["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]]))
    assert torch.equal(mc["decoder.layers.0.mlp.linear_fc2.weight"], hf[m + "down_proj.weight"])
    e = "model.layers.4.mlp.experts.5."  # the MTP layer's expert 5
    assert torch.equal(mc["mtp.layers.0.transformer_layer.mlp.experts.local_experts.5.linear_fc1.weight"],
                       torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]]))
    assert torch.equal(mc["mtp.layers.0.final_layernorm.weight"], hf["model.layers.4.shared_head.norm.weight"])
    assert torch.equal(mc["decoder.final_layernorm.weight"], hf["model.norm.weight"])


def test_transformer_engine_spelling_reads_like_the_local_one():
    """TE's layer spec: q / kv norms fused into the up projections, a dense layer's pre-MLP norm into fc1, grouped
    experts `linear_fc{1,2}.weight{e}` (its documented key layout; TE is not installed here)."""
    cfg = _cfg()
    hf = _hf(_temper(cfg))
    local, te = to_mcore(hf, cfg), to_mcore(hf, cfg, te=True)
    assert len(te) == len(local)
    fused = {"decoder.layers.0.self_attention.q_layernorm.weight":
             "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
             "decoder.layers.0.self_attention.kv_layernorm.weight":
             "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight",
             "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
             "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight": "decoder.layers.1.mlp.experts.linear_fc1.weight3",
             "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight": "decoder.layers.1.mlp.experts.linear_fc2.weight3"}
    for name, te_name in fused.items():
        assert name not in te and torch.equal(te[te_name], local[name]), te_name
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in te  # a MoE layer's norm stays a norm in TE's spec too
    with_state = {**te, "decoder.layers.0.self_attention.linear_proj._extra_state": None}  # TE's extra state
    back = from_mcore(with_state, cfg)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


# ---- tied embeddings and refusals -------------------------------------------------------------------------------
def test_tied_embeddings_convert_both_ways_in_both_converters():
    cfg = _cfg(tie_word_embeddings=True)
    hf = _hf(_temper(cfg))
    assert "lm_head.weight" not in hf
    mc = to_mcore(hf, cfg)
    assert "output_layer.weight" not in mc and set(from_mcore(mc, cfg)) == set(hf)
    # temper's own Megatron names, sharded over tp = 2 and ep = 2 (the head was a KeyError here)
    shards = {(t, e, t): to_megatron(hf, cfg, tp=2, ep=2, etp=2, tp_rank=t, ep_rank=e, etp_rank=t)
              for t in range(2) for e in range(2)}
    assert not any("lm_head" in k for s in shards.values() for k in s)
    back = from_megatron(shards, cfg, tp=2, ep=2, etp=2)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(KeyError, match=r"tie_word_embeddings: the head is the embedding\): output_layer.weight"):
        from_mcore({**mc, "output_layer.weight": mc["embedding.word_embeddings.weight"]}, cfg)


def test_what_cannot_convert_is_refused_naming_it():
    cfg = _cfg()
    hf = _hf(_temper(cfg))
    L = cfg.num_hidden_layers
    # an MTP layer's own embedding: converts when it is the shared one, is refused when it differs
    same = {**hf, f"model.layers.{L}.embed_tokens.weight": hf["model.embed_tokens.weight"].clone()}
    assert set(to_mcore(same, cfg)) == set(to_mcore(hf, cfg))
    other = {**hf, f"model.layers.{L}.shared_head.head.weight": hf["lm_head.weight"] + 1}
    with pytest.raises(ValueError, match=rf"model.layers.{L}.shared_head.head.weight: MTP layer 0's own copy differs"):
        to_mcore(other, cfg)
    with pytest.raises(KeyError, match="model.layers.9.mlp.foo: no Megatron-core name"):
        to_mcore({**hf, "model.layers.9.mlp.foo": torch.zeros(1)}, cfg)
    mc = to_mcore(hf, cfg)
    # a Megatron checkpoint with an indexer where the config shares one (IndexShare): refused, not dropped
    shared = _cfg(indexer_types=["full", "shared", "full", "full"])
    with pytest.raises(KeyError, match=r"no place for: decoder\.layers\.1\.self_attention\.core_attention\.indexer"):
        from_mcore(mc, shared)
    del mc["decoder.layers.2.self_attention.linear_kv_up_proj.weight"]
    with pytest.raises(KeyError, match=r"lacks decoder.layers.2.self_attention.linear_kv_up_proj.weight \(HF "
                                       r"model.layers.2.self_attn.kv_b_proj.weight\)"):
        from_mcore(mc, cfg)


def test_a_tied_megatron_model_takes_temper_s_step_on_two_tp_ranks():
    """temper's MegatronGLM with tied embeddings (one tensor for the embedding and the head, split over the vocabulary
    alike): on tp = 2 the loss, logits, MTP logits and every gradient are temper's own tied model's, the embedding's
    the sum of its two uses'."""
    from trainers.megatron.parity import hf_grads, run_layout, step_loss

    cfg = configs.load("tiny").model.model_copy(update={"tie_word_embeddings": True})
    ref = _temper(cfg)
    hf = _hf(ref)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    loss, lg, mlg = step_loss(ref, ids, ids.shape[0] * (ids.shape[1] - 1), indexer=True)
    loss.backward()
    grads = hf_grads(ref)
    r = run_layout(cfg, hf, ids, tp=2, indexer=True)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))  # (an unrouted expert: 0)

    assert abs(r["loss"] - loss.item()) <= 1e-5 * loss.item()
    assert rel(r["logits"], lg) <= 1e-5 and rel(r["mtp_logits"], mlg) <= 1e-5
    assert set(r["grads"]) == set(grads) and "lm_head.weight" not in grads
    for k, g in grads.items():
        if not k.endswith("e_score_correction_bias"):
            assert rel(r["grads"][k], g) <= 1e-4, k
    assert all(torch.equal(r["exported"][k], hf[k].float()) for k in hf)
