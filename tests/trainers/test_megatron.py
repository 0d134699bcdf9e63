"""The Megatron-core backend on the CPU (gloo): config mapping, HF ↔ Megatron converters, and the Megatron-built
model against temper's torch model on the same weights (logits, MTP, loss, every gradient; 1 rank, TP = 2 and
EP = 2 in spawned ranks), plus one LM and one SAO trainer step."""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch

import configs
from model import Transformer, YarnConfig
from model.checkpoint import to_hf_state
from rollout.types import Segment, Trajectory
from trainers.config import SAOConfig, TrainConfig
from trainers.lm import LMTrainer
from trainers.megatron.convert import from_megatron, to_megatron
from trainers.megatron.mapping import MegatronMappingError, megatron_args, model_config_from_megatron
from trainers.sao import SAOTrainer


def _model(cfg=None, seed=0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(cfg or configs.load("tiny").model)
    with torch.no_grad():  # a non-zero expert bias, so a dropped or misplaced bias shows
        for moe in m.moe_layers():
            moe.gate.e_score_correction_bias.normal_(0, 0.01)
    return m


def _hf(m: Transformer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in to_hf_state(m)}


# ---- mapping ------------------------------------------------------------------------------------------
def test_mapping_names_and_round_trip():
    cfg = configs.load("tiny").model
    a = megatron_args(cfg)
    assert (a["dsa_indexer_topk_freq"], a["dsa_indexer_skip_topk_offset"]) == (4, 1)  # tiny: [full, shared ×3]
    assert a["mtp_num_layers"] == 1 and a["moe_layer_freq"] == [0, 1, 1, 1]
    assert a["moe_router_score_function"] == "sigmoid" and a["moe_router_enable_expert_bias"]
    assert a["moe_router_topk_scaling_factor"] == 2.5 and a["moe_shared_expert_intermediate_size"] == 128
    assert a["qk_head_dim"] == 32 and a["qk_pos_emb_head_dim"] == 16 and a["dsa_indexer_scoring_relu"] is True
    grouped = cfg.model_copy(update={"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4})
    g = megatron_args(ModelConfigCheck(grouped))
    assert (g["moe_router_num_groups"], g["moe_router_group_topk"]) == (4, 2)
    for c in (cfg, cfg.model_copy(update={"index_score_relu": False, "mtp_input": "post_norm"})):
        back = model_config_from_megatron(megatron_args(c), vocab_size=c.vocab_size, mtp_input=c.mtp_input,
                                          mtp_draft_steps=c.mtp_draft_steps, pad_token_id=c.pad_token_id,
                                          eos_token_id=c.eos_token_id)
        assert back.layer_indexer_types() == c.layer_indexer_types()
        assert back.rope_interleave_indexer == c.rope_interleave_indexer
        skip = {"indexer_types", "index_share_freq", "index_share_offset", "indexer_rope_interleave"}
        assert {k: v for k, v in back.model_dump().items() if k not in skip} == \
               {k: v for k, v in c.model_dump().items() if k not in skip}
    # Megatron's GLM-5 setting: ReLU off, MTP reads the post-norm state
    m = model_config_from_megatron({**a, "dsa_indexer_scoring_relu": False}, vocab_size=272)
    assert m.index_score_relu is False and m.mtp_input == "post_norm"


def ModelConfigCheck(c):
    """Validate a model_copy'd config (model_copy skips validation)."""
    return type(c)(**c.model_dump())


@pytest.mark.parametrize("update,key", [
    ({"attention_bias": True}, "attention_bias"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"n_routed_experts": 16, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 4}, "n_group"),
    ({"indexer_types": ["full", "shared", "full", "full"]}, "indexer_types"),
    ({"rope_scaling": YarnConfig(factor=4.0, original_max_position_embeddings=64, attention_factor=0.5)},
     "rope_scaling.attention_factor"),
    ({"rope_scaling": YarnConfig(factor=4.0, original_max_position_embeddings=64, truncate=False)},
     "rope_scaling.truncate"),
    ({"rope_scaling": YarnConfig(factor=4.0, original_max_position_embeddings=64, mscale=0.0, mscale_all_dim=1.0)},
     "rope_scaling.mscale"),
])
def test_mapping_refuses_what_megatron_cannot_express(update, key):
    cfg = ModelConfigCheck(configs.load("tiny").model.model_copy(update=update))
    with pytest.raises(MegatronMappingError, match=f"^{key}:"):
        megatron_args(cfg)


# ---- converters -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (2, 1, 2), (2, 2, 1), (1, 4, 1), (2, 4, 2)])
def test_convert_round_trip_is_bit_exact(tp, ep, etp, grouped):
    cfg = configs.load("tiny").model
    hf = _hf(_model(cfg))
    shards = {(t, e, k): to_megatron(hf, cfg, tp=tp, ep=ep, etp=etp, tp_rank=t, ep_rank=e, etp_rank=k, grouped=grouped)
              for t in range(tp) for e in range(ep) for k in range(etp)}
    assert any(".local_experts." in n for n in shards[0, 0, 0]) is not grouped
    back = from_megatron(shards, cfg, tp=tp, ep=ep, etp=etp)
    assert set(back) == set(hf)
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_convert_shard_layout_by_hand():
    cfg = configs.load("tiny").model
    hf = _hf(_model(cfg))
    H, d = cfg.num_attention_heads, cfg.qk_head_dim
    s = to_megatron(hf, cfg, tp=2, ep=4, etp=2, tp_rank=1, ep_rank=2, etp_rank=1)
    a = "decoder.layers.0.self_attention."
    # rank 1 of 2 holds heads 2 and 3 of q_b_proj and of kv_b_proj, and their input columns of o_proj
    assert torch.equal(s[a + "q_b_proj.weight"], hf["model.layers.0.self_attn.q_b_proj.weight"][H // 2 * d:])
    kvd = cfg.qk_nope_head_dim + cfg.v_head_dim
    assert torch.equal(s[a + "kv_b_proj.weight"], hf["model.layers.0.self_attn.kv_b_proj.weight"][H // 2 * kvd:])
    assert torch.equal(s[a + "o_proj.weight"],
                       hf["model.layers.0.self_attn.o_proj.weight"][:, H // 2 * cfg.v_head_dim:])
    hi = cfg.index_n_heads // 2 * cfg.index_head_dim
    assert torch.equal(s[a + "indexer.wq_b.weight"], hf["model.layers.0.self_attn.indexer.wq_b.weight"][hi:])
    # the indexer's head weights: one output row per indexer head, so rank 1 holds the rows of heads 2 and 3
    assert torch.equal(s[a + "indexer.weights_proj.weight"],
                       hf["model.layers.0.self_attn.indexer.weights_proj.weight"][cfg.index_n_heads // 2:])
    assert s[a + "indexer.weights_proj.weight"].shape == (cfg.index_n_heads // 2, cfg.hidden_size)
    assert torch.equal(s[a + "q_a_proj.weight"], hf["model.layers.0.self_attn.q_a_proj.weight"])  # replicated
    # gated MLP: fc1 = [gate half; up half] of this rank, not a plain row split
    i = cfg.intermediate_size // 2
    fc1 = s["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.0.mlp.gate_proj.weight"][i:],
                                       hf["model.layers.0.mlp.up_proj.weight"][i:]]))
    # ... and the dense fc2 (row parallel): this rank's input columns, the second half of the intermediate dim
    assert torch.equal(s["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.0.mlp.down_proj.weight"][:, i:])
    assert s["decoder.layers.0.mlp.linear_fc2.weight"].shape == (cfg.hidden_size, i)
    # 8 experts over ep = 4: ep rank 2 holds experts 4 and 5; local 1 = expert 5, etp rank 1 its second halves
    mi = cfg.moe_intermediate_size // 2
    e5 = "model.layers.1.mlp.experts.5."
    assert torch.equal(s["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"],
                       torch.cat([hf[e5 + "gate_proj.weight"][mi:], hf[e5 + "up_proj.weight"][mi:]]))
    assert torch.equal(s["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf[e5 + "down_proj.weight"][:, mi:])
    assert torch.equal(s["mtp_layers.0.eh_proj.weight"], hf["model.layers.4.eh_proj.weight"][cfg.hidden_size // 2:])
    # grouped experts: the same rank's two local experts stacked, local expert j at index j, in the MTP layer too
    g = to_megatron(hf, cfg, tp=2, ep=4, etp=2, tp_rank=1, ep_rank=2, etp_rank=1, grouped=True)
    fc1, fc2 = g["decoder.layers.1.mlp.experts.fc1_weight"], g["decoder.layers.1.mlp.experts.fc2_weight"]
    assert fc1.shape == (2, 2 * mi, cfg.hidden_size) and fc2.shape == (2, cfg.hidden_size, mi)
    assert torch.equal(fc1[1], torch.cat([hf[e5 + "gate_proj.weight"][mi:], hf[e5 + "up_proj.weight"][mi:]]))
    assert torch.equal(fc2[1], hf[e5 + "down_proj.weight"][:, mi:])
    e4 = "model.layers.4.mlp.experts.4."
    assert torch.equal(g["mtp_layers.0.layer.mlp.experts.fc2_weight"][0], hf[e4 + "down_proj.weight"][:, mi:])
    assert not any(".local_experts." in n for n in g) and set(g) - set(s) == {
        p + t for p in ("decoder.layers.1.", "decoder.layers.2.", "decoder.layers.3.", "mtp_layers.0.layer.")
        for t in ("mlp.experts.fc1_weight", "mlp.experts.fc2_weight")}


def test_convert_errors_name_the_tensor():
    cfg = configs.load("tiny").model
    hf = _hf(_model(cfg))
    shards = {(t, 0, t): to_megatron(hf, cfg, tp=2, tp_rank=t, etp_rank=t) for t in range(2)}
    shards[(1, 0, 1)] = dict(shards[(1, 0, 1)])
    shards[(1, 0, 1)]["norm.weight"] = shards[(1, 0, 1)]["norm.weight"] + 1e-3
    with pytest.raises(ValueError, match="^norm.weight: replicated tensor differs"):
        from_megatron(shards, cfg, tp=2)
    with pytest.raises(ValueError, match="num_attention_heads=4 does not split over 3"):
        to_megatron(hf, cfg, tp=3)
    del hf["model.layers.2.self_attn.kv_b_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.2.self_attn.kv_b_proj.weight"):
        to_megatron(hf, cfg)


# ---- the Megatron-built model vs temper's torch model ------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def reference():
    from model.losses import indexer_kl_loss  # noqa: F401
    from trainers.megatron.parity import hf_grads, step_loss

    cfg = configs.load("tiny").model
    ref = _model(cfg)
    # 91 tokens: an odd length, so sequence parallelism over 2 ranks pads (and must mask the padding out of the
    # routers' expert-load counts). The sparse path matters on these rows: 91 keys > index_topk = 64, one indexer
    # for four layers
    ids = torch.randint(0, 256, (4, 91), generator=torch.Generator().manual_seed(1))
    out = ref.run(ids)
    assert out.indexer_calls == [0]
    assert _rel(ref.run(ids, dense=True).logits, out.logits) > 1e-3
    for m in ref.moe_layers():
        m.expert_load.zero_()
    loss, lg, mlg = step_loss(ref, ids, ids.shape[0] * (ids.shape[1] - 1), indexer=True)
    loss.backward()
    loads = [m.expert_load.clone() for m in ref.moe_layers()]
    return cfg, _hf(ref), ids, loss.item(), lg, mlg, hf_grads(ref), loads


@pytest.mark.parametrize("tp,ep,etp,experts", [(1, 1, 1, "grouped"), (2, 1, 2, "grouped"), (2, 1, 1, "grouped"),
                                               (1, 2, 1, "grouped"), (2, 2, 1, "grouped"), (1, 1, 1, "sequential"),
                                               (2, 2, 1, "sequential")])
def test_megatron_matches_torch_logits_loss_and_grads(reference, tp, ep, etp, experts):
    """TP = 2 is sequence parallel (experts split over the tp ranks, or whole on each and summed over them); EP = 2
    splits the 8 experts over two data-parallel ranks, each with its own rows; TP = EP = 2 is four ranks. The routed
    experts as temper's GroupedExperts (the default) and as Megatron's SequentialMLP."""
    from trainers.megatron.parity import run_layout

    cfg, hf, ids, loss, lg, mlg, grads, loads = reference
    r = run_layout(cfg, hf, ids, tp=tp, ep=ep, etp=etp, indexer=True, experts=experts)
    assert r["world"] == tp * ep
    assert r["experts"] == [{"grouped": "GroupedExperts", "sequential": "SequentialMLP"}[experts]]
    assert len(r["expert_loads"]) == len(loads)  # every token routed once per layer, the padding not counted
    for got, want in zip(r["expert_loads"], loads):
        assert torch.equal(got.float(), want.float())
    assert abs(r["loss"] - loss) <= 1e-5 * abs(loss)
    assert _rel(r["logits"], lg) <= 1e-5 and _rel(r["mtp_logits"], mlg) <= 1e-5
    assert set(r["grads"]) == set(grads)
    for k, g in grads.items():
        if k.endswith("e_score_correction_bias"):
            continue  # a buffer: no gradient
        assert _rel(r["grads"][k], g) <= 1e-4, k
    for k in hf:  # the weights each rank loaded join back to the originals, and export to the engines' layout
        assert torch.equal(r["weights"][k], hf[k].float()), k
        assert torch.equal(r["exported"][k], hf[k].float()), k
    norm = sum(g.double().pow(2).sum() for k, g in grads.items() if not k.endswith("e_score_correction_bias")).sqrt()
    assert abs(r["grad_norm"] - float(norm)) <= 1e-5 * float(norm)  # the clip norm covers every shard once


def test_a_deep_copy_keeps_megatron_s_parameter_marks(megatron_rank):
    """SAO's critic and the KL reference are deep copies of the actor: each parameter keeps the marks Megatron and the
    backend read (`sequence_parallel`, `tensor_model_parallel`, `allreduce`, ...); a plain deepcopy drops them."""
    from trainers.megatron.backend import MegatronBackend

    m = MegatronBackend().wrap(_model(configs.load("micro").model))
    marked = {n: dict(p.__dict__) for n, p in m.named_parameters() if p.__dict__}
    assert any("tensor_model_parallel" in d for d in marked.values()) and any("allreduce" in d for d in marked.values())
    c = copy.deepcopy(m)
    assert {n: dict(p.__dict__) for n, p in c.named_parameters() if p.__dict__} == marked
    assert all(p is not q for p, q in zip(m.parameters(), c.parameters()))
    # but not an fp32 main gradient (trainers/optim.py): a copy whose parameters carried `main_grad` would read the
    # actor's gradient as its own, and its optimizer would not hook them (keep_main_grads skips a marked parameter)
    p0 = next(m.parameters())
    p0.main_grad = torch.ones(p0.shape)
    c = copy.deepcopy(m)
    assert not any(hasattr(q, "main_grad") for q in c.parameters())
    del p0.main_grad


class _Handle:
    """Stands in for the CUDA event Megatron's all-to-all dispatcher keeps after a GPU forward (`d2h_event`): it
    cannot be copied (a CPU build cannot make a `torch.cuda.Event`)."""

    def __deepcopy__(self, memo):
        raise TypeError("cannot copy a device handle")


def test_a_deep_copy_shares_device_handles_it_cannot_copy(megatron_rank, monkeypatch):
    import trainers.megatron.model as mm
    from trainers.megatron.backend import MegatronBackend

    assert torch.cuda.Event in mm._shared_on_copy() and torch.cuda.Stream in mm._shared_on_copy()
    m = MegatronBackend().wrap(_model(configs.load("micro").model))
    layer = next(x for x in m.modules() if hasattr(x, "token_dispatcher"))
    layer.token_dispatcher.d2h_event = h = _Handle()
    with pytest.raises(TypeError, match="cannot copy a device handle"):
        copy.deepcopy(m)
    monkeypatch.setattr(mm, "EXTRA_SHARED_ON_COPY", [_Handle])
    c = copy.deepcopy(m)
    assert next(x for x in c.modules() if hasattr(x, "token_dispatcher")).token_dispatcher.d2h_event is h


@pytest.mark.parametrize("mode,dtype", [("reference", torch.bfloat16), ("triton", torch.float32)])
def test_grouped_experts_equal_megatron_s_sequential_mlp(megatron_rank, monkeypatch, mode, dtype):
    """One MoE layer's routed experts, the same weights in both modules, the counts on the host (as Megatron's
    dispatchers hand them over), an empty expert: GroupedExperts (its twin in bf16, or the Triton grouped GEMM under
    the interpreter in fp32) against Megatron's SequentialMLP, outputs and every gradient."""
    from trainers.megatron.backend import MegatronBackend

    ref = _model(configs.load("micro").model)
    mods = {}
    for experts in ("grouped", "sequential"):
        be = MegatronBackend(dtype=dtype)
        be.experts = experts
        mods[experts] = be.wrap(copy.deepcopy(ref)).moe_layers()[0].experts
    grouped, seq = mods["grouped"], mods["sequential"]
    assert type(grouped).__name__ == "GroupedExperts" and type(seq).__name__ == "SequentialMLP"
    e, h = grouped.fc1_weight.shape[0], grouped.fc1_weight.shape[2]
    counts = torch.tensor([5, 0] + [3] * (e - 2))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), h, generator=g).to(dtype).requires_grad_()
    probs = torch.rand(x.shape[0], generator=g)
    out_s, _ = seq(x, counts, probs)
    gout = torch.randn(out_s.shape, generator=g).to(dtype)
    want = torch.autograd.grad(out_s, [x, *[p for le in seq.local_experts for p in le.parameters()]], gout)
    monkeypatch.setenv("TEMPER_KERNELS", mode)
    out_g, bias = grouped(x, counts, probs)
    got = torch.autograd.grad(out_g, [x, grouped.fc1_weight, grouped.fc2_weight], gout)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    assert bias is None and out_g.dtype == dtype
    torch.testing.assert_close(out_g, out_s, **tol)
    torch.testing.assert_close(got[0], want[0], **tol)
    assert len(want) == 1 + 2 * e  # x, then each expert's fc1 and fc2 weights (no biases)
    fc1, fc2 = torch.stack(list(want[1::2])), torch.stack(list(want[2::2]))
    torch.testing.assert_close(got[1], fc1, **tol)
    torch.testing.assert_close(got[2], fc2, **tol)
    assert torch.count_nonzero(got[1][1]) == 0 and torch.count_nonzero(got[2][1]) == 0  # the empty expert


@pytest.mark.parametrize("layout,pick", [("ep2", "0:5"), ("dp2", "1:2")])
def test_sao_on_data_parallel_megatron_ranks_takes_the_one_process_steps(tmp_path, layout, pick):
    """EP = 2 over two data-parallel ranks: every MoE layer exchanges tokens between them, so the ranks must run the
    same forwards on the same shapes although they hold 3 and 2 trajectories of other lengths (padded rows,
    trainers/sao.py `_rows`). DP = 2 with one trajectory (reward 1): the rank without any still backpropagates, so the gradient
    sums over the ranks match up. Two SAO steps (critic included) end where one process on the whole batch ends."""
    import subprocess
    import sys

    from trainers.backends import free_port

    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "megatron_sao_step.py")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "--master_port", str(free_port()), script, str(tmp_path), layout, pick],
                   check=True, timeout=600, capture_output=True)
    subprocess.run([sys.executable, script, str(tmp_path), "single", pick], check=True, timeout=600,
                   capture_output=True)
    one = torch.load(tmp_path / "single.pt", weights_only=False)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert one["updated"] and all(r["updated"] for r in ranks)
    assert ranks[0]["tokens"] == one["tokens"] and ranks[0]["value_loss"] == pytest.approx(one["value_loss"], 1e-4)
    for r in ranks:
        assert all(torch.equal(r["before"][k], one["before"][k]) for k in one["before"])
        # Adam moves a weight by about lr·g/(|g| + eps): one whose gradient is within rounding of zero can land
        # anywhere in ±lr under another reduction order, so count the weights whose updates differ by over 1% of
        # the largest update, instead of taking the largest difference (ranks that missed each other's tokens
        # would differ almost everywhere)
        moved = max(float((r["after"][k] - one["before"][k]).abs().max()) for k in one["before"])
        off = sum(int(((r["after"][k] - one["after"][k]).abs() > moved / 100).sum()) for k in one["before"])
        assert moved > 1e-4 and off / sum(v.numel() for v in one["before"].values()) < 1e-3, (moved, off)


@pytest.fixture
def megatron_rank():
    from trainers.megatron import parallel

    parallel.initialize(1, 1, 1)
    yield
    parallel.destroy()


def test_a_one_rank_group_binds_no_port(monkeypatch):
    """Without a rendezvous in the environment, a 1-rank group uses an in-process store: no TCP port is picked and kept
    in the environment, where the next group of the process would bind it again after another process took it."""
    import torch.distributed as dist

    from trainers.megatron import parallel

    for k in ("MASTER_PORT", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    for _ in range(2):  # a second group after the first is torn down, as bench/megatron_gpu.py's sections do
        parallel.initialize(1, 1, 1)
        try:
            assert dist.get_world_size() == 1 and "MASTER_PORT" not in os.environ
        finally:
            parallel.destroy()


def test_a_bf16_megatron_model_keeps_temper_s_dtypes_and_outputs(megatron_rank):
    """In bf16, every tensor of the Megatron model has the dtype temper's own model gives it through `.to(bf16)`
    (router weight, expert bias and indexer head weights fp32, the rest bf16: Megatron builds temper's submodules and
    its fallback norms in fp32, which failed on the H200 with a dtype mismatch), and the loss and logits are temper's
    bf16 ones."""
    from trainers.megatron.backend import MegatronBackend
    from trainers.megatron.convert import megatron_state
    from trainers.megatron.parity import step_loss

    ref = _model()
    mg = MegatronBackend(dtype=torch.bfloat16).wrap(ref)
    ours = copy.deepcopy(ref).to(torch.bfloat16)
    want = dict(to_hf_state(ours))
    got = from_megatron({(0, 0, 0): {k: v.detach() for k, v in megatron_state(mg).items()}}, mg.config)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert {k for k, v in want.items() if v.dtype == torch.float32} and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        la, lga, _ = step_loss(ours, ids, ids.numel() - 2)
        lb, lgb, _ = step_loss(mg, ids, ids.numel() - 2)
    assert abs(la.item() - lb.item()) <= 1e-3 * la.item()
    # bf16 rounds differently in Megatron's linears: a near-tie in the indexer's top-k or the routing can flip at a
    # position (one of 160 here, 0.12 off); every other position is within 0.008 (logits of magnitude ~1)
    d = (lgb.float() - lga.float()).abs()
    assert (d.mean() / lga.float().abs().mean()).item() <= 2e-2
    assert (d.amax(-1) > 0.05).float().mean().item() <= 0.02


def _megatron_copy(ref: Transformer):
    from trainers.megatron.backend import MegatronBackend

    return MegatronBackend().wrap(ref)


def _joined(m) -> dict[str, torch.Tensor]:
    from trainers.megatron.convert import megatron_state

    return from_megatron({(0, 0, 0): megatron_state(m)}, m.config)


def test_megatron_losses_through_head_chunks_equal_the_whole_logits(megatron_rank, monkeypatch):
    """Megatron's model takes the LM step's losses (next-token and MTP) and the policy's log-probs and entropy
    through its tensor-parallel head in row chunks as temper's does: the same values and every parameter's gradient
    as with the whole logits."""
    import model.losses as losses
    from model import lm_forward_loss, mtp_loss, token_logprobs

    ref = _model()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.7
    runs = {}
    for mode, limit in (("whole", 1 << 40), ("chunks", 13 * 272)):  # 13 rows a chunk: 78 positions in 6 chunks
        monkeypatch.setattr(losses, "LOGITS_CHUNK", limit)
        mg = _megatron_copy(copy.deepcopy(ref))
        assert (losses.head_chunk_rows(mg, 78) is None) == (mode == "whole")
        out, loss = lm_forward_loss(mg, ids, mask)
        mtp = mtp_loss(mg, out.hidden, ids, mask, steps=1)
        lp, ent = token_logprobs(mg, ids)
        (loss + 0.3 * mtp + (lp * mask).sum() * 1e-2 + ent.mean()).backward()
        runs[mode] = ([loss.detach(), mtp.detach(), lp.detach(), ent.detach()],
                      {n: p.grad.clone() for n, p in mg.named_parameters() if p.grad is not None})
    (vw, gw), (vc, gc) = runs["whole"], runs["chunks"]
    for a, b in zip(vw, vc, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert gw.keys() == gc.keys() and len(gw) > 10
    for k in gw:
        torch.testing.assert_close(gc[k], gw[k], rtol=1e-4, atol=1e-6, msg=k)


def test_lm_trainer_step_is_the_same_on_megatron(megatron_rank):
    ref = _model()
    mg = _megatron_copy(ref)
    tc = TrainConfig(lr=1e-3, warmup_steps=0, mtp_loss_weight=0.3, router_bias_rate=1e-2)
    ids = torch.randint(0, 256, (4, 80), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids, dtype=torch.bool)
    before = _hf(ref)
    a, b = LMTrainer(ref, tc).step(ids, mask), LMTrainer(mg, tc).step(ids, mask)
    assert abs(a.loss - b.loss) <= 1e-5 * a.loss and abs(a.mtp_loss - b.mtp_loss) <= 1e-5 * a.mtp_loss
    assert abs(a.indexer_loss - b.indexer_loss) <= 1e-4 * max(a.indexer_loss, 1e-6)
    after, joined = _hf(ref), _joined(mg)
    moved = 0
    for k in after:
        assert _step_rel(joined[k], after[k], before[k]) <= 1e-2, k
        moved += not torch.equal(after[k], before[k])
    assert moved > len(after) // 2  # the step moved the weights (and the router biases, by the same rule)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(after[bias], before[bias]) and torch.equal(joined[bias], after[bias])


def _step_rel(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> float:
    """How far one optimizer step's update differs, as a fraction of the update (L2). Adam's first step moves every
    weight by ~lr·sign(g): a gradient within rounding of zero may flip an element, so compare whole updates."""
    du = want.float() - before.float()
    return float((got.float() - want.float()).norm() / du.norm().clamp_min(1e-30)) if du.any() else \
        float((got.float() - want.float()).abs().max())


def _traj(rng: random.Random, reward: float) -> Trajectory:
    toks = [rng.randrange(256) for _ in range(40)]
    mask = [0] * 16 + [1] * 24
    return Trajectory("t", f"e{reward}", "f", "math", "h", "v", 0,
                      [Segment(toks, mask, [-math.log(272) if m else 0.0 for m in mask], [0 if m else -1 for m in mask])],
                      reward, "completed")


def test_sao_step_is_the_same_on_megatron(megatron_rank):
    ref = _model()
    mg = _megatron_copy(ref)
    rng = random.Random(3)
    trajs = [_traj(rng, r) for r in (1.0, 0.0, 1.0, 0.0)]
    sc = SAOConfig(lr=1e-3, critic_updates=1, micro_rows=2)
    ta, tb = SAOTrainer(ref, sc), SAOTrainer(mg, sc)
    # the critic is a deep copy of the actor with its attention frozen, on either backend
    frozen = [p for attn in tb.critic.body.attention_modules() for p in attn.parameters()]
    assert frozen and not any(p.requires_grad for p in frozen)
    assert tb.critic.body.state is not mg.state
    before = _hf(ref)
    sa, sb = ta.step(copy.deepcopy(trajs), 0), tb.step(copy.deepcopy(trajs), 0)
    assert sa["updated"] and sb["updated"], (sorted(sa.items()), sorted(sb.items()))
    assert abs(sa["value_loss"] - sb["value_loss"]) <= 1e-4 * sa["value_loss"]
    assert abs(sa["grad_norm"] - sb["grad_norm"]) <= 1e-4 * sa["grad_norm"]
    after, joined = _hf(ref), _joined(mg)
    for k in after:
        assert _step_rel(joined[k], after[k], before[k]) <= 1e-2, k


class _Pool:
    def __init__(self, teacher):
        self.teacher = teacher

    def score_batches(self, batches, fn):
        return [fn(self.teacher, rows) for _, rows in batches]


def test_opd_step_is_the_same_on_megatron(megatron_rank):
    from trainers.config import OPDConfig
    from trainers.megatron.backend import MegatronBackend
    from trainers.opd import OPDTrainer

    ref, teacher = _model(), _model(seed=5)
    be = MegatronBackend()
    mg = be.wrap(ref)
    rng = random.Random(3)
    trajs = [_traj(rng, r) for r in (1.0, 0.0, 1.0, 0.0)]
    before = _hf(ref)
    oc = OPDConfig(lr=1e-3)
    a = OPDTrainer(ref, _Pool(teacher), oc).step(copy.deepcopy(trajs))
    b = OPDTrainer(mg, _Pool(teacher), oc, backend=be).step(copy.deepcopy(trajs))
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
    assert abs(a["reverse_kl"] - b["reverse_kl"]) <= 1e-5 * abs(a["reverse_kl"])
    after, joined = _hf(ref), _joined(mg)
    for k in after:
        assert _step_rel(joined[k], after[k], before[k]) <= 1e-2, k
    exported = dict(to_hf_state(be.export(mg)))  # what the engines get: temper's model with the trained weights
    for k in after:
        assert torch.equal(exported[k], joined[k]), k
