"""The Megatron layout planner (trainers/megatron/plan.py): exact parameter counts, the shard a rank holds against
the converter's real shards, the memory terms by hand, and the glm5 answers that follow from arithmetic alone."""

from __future__ import annotations

import pytest
import torch

import configs
from model import Transformer
from model.checkpoint import to_hf_state
from trainers.megatron.plan import GIB, RECIPES, Layout, count_params, estimate, layouts, min_gpus, plan, stage_blocks


def test_counts_are_the_models_parameters():
    cfg = configs.load("tiny").model
    torch.manual_seed(0)
    m = Transformer(cfg)
    c = count_params(cfg)
    assert c.total == sum(p.numel() for p in m.parameters())
    assert sum(map(sum, c.layers)) + sum(c.first) + sum(c.last) == c.total
    assert c.experts == sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    assert c.first == (cfg.vocab_size * cfg.hidden_size, 0)  # the embedding, split over tp


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (1, 4)])
def test_held_parameters_equal_the_converters_shard(tp, ep):
    """What the planner says one rank holds (pp = 1) is the element count of the shard `to_megatron` cuts for it."""
    from trainers.megatron.convert import to_megatron

    cfg = configs.load("tiny").model
    torch.manual_seed(0)
    hf = {k: v.detach() for k, v in to_hf_state(Transformer(cfg))}
    shard = to_megatron(hf, cfg, tp=tp, ep=ep, etp=1, tp_rank=0, ep_rank=0, etp_rank=0)
    held = sum(v.numel() for k, v in shard.items() if not k.endswith("router.expert_bias"))  # buffers, not params
    assert held < sum(p.numel() for p in Transformer(cfg).parameters())  # a real shard
    e = estimate(cfg, count_params(cfg), Layout(tp, 1, ep, 1, tp * ep), "fp32 grads, fp32 Adam")
    assert e.detail["params_held"] == held


def test_one_gpu_terms_by_hand():
    cfg = configs.load("tiny").model
    c = count_params(cfg)
    s, h, k, V = 256, cfg.hidden_size, cfg.num_experts_per_tok, cfg.vocab_size
    e = estimate(cfg, c, Layout(1, 1, 1, 1, 1), "fp32 grads, fp32 Adam", seq_len=s)
    assert e.weights * GIB == pytest.approx(2 * c.total)
    assert e.grads * GIB == pytest.approx(4 * c.total)
    assert e.optimizer * GIB == pytest.approx(12 * c.total)
    n_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    act = n_layers * 2 * s * h + 34 * s * h + 4 * s * k * h + 6 * s * k * cfg.moe_intermediate_size + 8 * s * V
    assert e.activations * GIB == pytest.approx(act)
    off = estimate(cfg, c, Layout(1, 1, 1, 1, 1), "bf16 grads, optimizer offloaded", seq_len=s, gpus_per_node=8)
    assert off.optimizer == 0 and off.host_per_node * GIB == pytest.approx(12 * c.total * 8)
    # the distributed optimizer: 4 data-parallel ranks hold a quarter each; tp = 2 halves the split tensors
    e4 = estimate(cfg, c, Layout(1, 1, 1, 1, 4), "fp32 grads, fp32 Adam", seq_len=s)
    assert e4.optimizer == pytest.approx(e.optimizer / 4) and e4.weights == pytest.approx(e.weights)
    e2 = estimate(cfg, c, Layout(2, 1, 1, 1, 2), "fp32 grads, fp32 Adam", seq_len=s)
    split = sum(x for x, _, _ in c.layers) + c.first[0] + c.last[0]
    assert e2.weights * GIB == pytest.approx(2 * (c.total - split / 2))


def test_stages_and_layouts():
    assert [len(b) for b in stage_blocks(78, 8)] == [10, 10, 10, 10, 10, 10, 9, 9]
    assert [b.start for b in stage_blocks(10, 3)] == [0, 4, 7]
    cfg = configs.load("glm5").model
    for lay in layouts(cfg, 64):
        assert lay.tp * lay.pp * lay.dp == 64 and lay.ep * lay.pp * lay.edp == 64
        assert cfg.n_routed_experts % lay.ep == 0 and cfg.num_attention_heads % lay.tp == 0 and lay.tp <= 8


def test_glm5_on_8_and_64_h200s():
    """Arithmetic the plan must agree with: 744B-class weights in bf16 alone exceed 8 × 127 GiB, and with fp32 Adam
    the routed experts alone (≥ 1/64 of 734B per GPU × 18 B) exceed 127 GiB on 64 GPUs."""
    cfg = configs.load("glm5").model
    c = count_params(cfg)
    assert 740e9 < c.total < 760e9 and c.experts > 0.97 * c.total
    assert 2 * c.total / 8 / GIB > 127
    p8 = plan(cfg, 8, counts=c)
    assert all(not r["fits"] for r in p8["recipes"].values())
    assert c.experts / 64 * 18 / GIB > 127
    p64 = plan(cfg, 64, counts=c)
    assert not p64["recipes"]["fp32 grads, fp32 Adam"]["fits"]
    fits = p64["recipes"]["bf16 grads, optimizer offloaded"]["fits"]
    assert fits and all(e.total <= p64["cap_gib"] for e in fits)
    n = min_gpus(cfg, "fp32 grads, fp32 Adam", counts=c)
    assert n is not None and n * 127 * GIB >= c.total * 18  # no fewer GPUs than the state itself needs
    assert set(RECIPES) == set(p64["recipes"])
