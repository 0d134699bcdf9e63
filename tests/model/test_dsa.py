"""DeepSeek Sparse Attention, the lightning indexer and IndexShare."""

import torch

from model import KVCache, Transformer
from model import attention as attn
from model.attention import stable_topk


def _pair(cfg_factory, **kw):
    torch.manual_seed(0)
    sparse = Transformer(cfg_factory(initializer_range=0.08, **kw)).eval()
    dense = Transformer(cfg_factory(initializer_range=0.08, use_dsa=False, **kw)).eval()
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if ".indexer." not in k})
    return sparse, dense


def test_topk_at_least_length_equals_dense_attention(cfg_factory):
    sparse, dense = _pair(cfg_factory, index_topk=32)
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(sparse(ids), dense(ids), atol=1e-6, rtol=0)
        # and the sparse model really is sparse once the context is longer than top-k
        long = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(2))
        assert (sparse(long) - dense(long)).abs().max() > 1e-3


def test_selection_of_every_query_is_its_topk_causal_keys(cfg_factory):
    """Attend-over-selected equals an explicit per-query softmax over the top-k keys (slow twin)."""
    sparse, _ = _pair(cfg_factory, index_topk=6, num_hidden_layers=1, first_k_dense_replace=1,
                      indexer_types=["full"])
    layer = sparse.layers[0].self_attn
    x = torch.randn(1, 20, 64)
    with torch.no_grad():
        ctx, _, _ = sparse._context(1, 20, x.device, x.dtype, None, None, None, mtp=False)
        out, sel = layer(x, ctx)
        # slow twin
        cfg = sparse.config
        q_lat = layer.q_a_layernorm(layer.q_a_proj(x))
        q = layer.q_b_proj(q_lat).view(1, 20, 4, -1)
        kv = layer.kv_a_proj_with_mqa(x)
        from model.layers import apply_rope

        c = layer.kv_a_layernorm(kv[..., : cfg.kv_lora_rank])
        kpe = apply_rope(kv[..., cfg.kv_lora_rank :], ctx.cos, ctx.sin, True)
        qpe = apply_rope(q[..., cfg.qk_nope_head_dim :], ctx.cos[:, :, None], ctx.sin[:, :, None], True)
        kvx = layer.kv_b_proj(c).view(1, 20, 4, -1)
        ix = layer.indexer
        qi, w = ix.queries(x, q_lat, ctx.cos, ctx.sin)
        ki = ix.keys(x, ctx.cos, ctx.sin)
        rows = []
        for t in range(20):
            scores = torch.stack([(w[0, t] * (qi[0, t] @ ki[0, s]).relu()).sum() for s in range(t + 1)])
            chosen = sorted(torch.argsort(-scores, stable=True)[: min(6, t + 1)].tolist())
            assert sel is None or t < 6 or sel[0, t].tolist() == chosen
            heads = []
            for h in range(4):
                k = torch.cat([kvx[0, chosen, h, :16], kpe[0, chosen]], -1)
                qq = torch.cat([q[0, t, h, :16], qpe[0, t, h]])
                p = ((k @ qq) * layer.scale).softmax(-1)
                heads.append(p @ kvx[0, chosen, h, 16:])
            rows.append(torch.cat(heads))
        want = layer.o_proj(torch.stack(rows))[None]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_future_tokens_never_change_earlier_logits(cfg_factory):
    sparse, _ = _pair(cfg_factory, index_topk=5)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (1, 40), generator=g)
    with torch.no_grad():
        base = sparse(ids)
        for cut in (7, 20, 33):
            changed = ids.clone()
            changed[:, cut:] = torch.randint(0, 300, (1, 40 - cut), generator=g)
            # MoE groups tokens by expert, so GEMM shapes (and rounding) move with the future: 1e-5, not 0
            torch.testing.assert_close(sparse(changed)[:, :cut], base[:, :cut], atol=1e-5, rtol=0)


def test_shared_layers_never_run_an_indexer_and_use_the_leaders_indices(cfg_factory, monkeypatch):
    types = ["full", "shared", "shared", "full"]
    sparse, _ = _pair(cfg_factory, index_topk=6, indexer_types=types)
    assert [blk.self_attn.indexer is not None for blk in sparse.layers] == [t == "full" for t in types]
    seen = {}
    orig = attn.MLA.forward

    def spy(self, x, ctx, shared_sel=None):
        out, sel = orig(self, x, ctx, shared_sel)
        seen[self.layer_idx] = (shared_sel, sel)
        return out, sel

    monkeypatch.setattr(attn.MLA, "forward", spy)
    ids = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = sparse.run(ids)
        assert out.indexer_calls == [0, 3]
        assert seen[1][1] is seen[0][1] and seen[2][1] is seen[0][1]  # the very same index tensor
        assert seen[3][1] is not seen[0][1]
        cache = KVCache(sparse.config, 2, 40)
        sparse.run(ids[:, :20], cache=cache)
        step = sparse.run(ids[:, 20:21], cache=cache)
        assert step.indexer_calls == [0, 3]


def test_stable_topk_breaks_ties_by_position():
    s = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, float("-inf")]])
    assert stable_topk(s, 3).tolist() == [[1, 2, 4]]
    assert stable_topk(s, 6).tolist() == [[0, 1, 2, 3, 4, 5]]
    z = torch.zeros(2, 3, 50)
    assert stable_topk(z, 4).tolist() == [[[0, 1, 2, 3]] * 3] * 2
    r = torch.randn(4, 100)
    torch.testing.assert_close(stable_topk(r, 10), r.topk(10).indices.sort(-1).values)


def test_half_split_indexer_rotary_differs_from_interleaved(cfg_factory):
    a = Transformer(cfg_factory(index_topk=5, indexer_rope_interleave=True)).eval()
    b = Transformer(cfg_factory(index_topk=5, indexer_rope_interleave=False)).eval()
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (a(ids) - b(ids)).abs().max() > 0
