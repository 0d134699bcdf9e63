"""The two checkpoint conventions where Megatron's GLM-5 setup and temper's default differ: the indexer score's
ReLU (`index_score_relu`) and the hidden state MTP reads (`mtp_input`)."""

import torch

import configs
from model import ModelConfig, Transformer
from temper_kernels.indexer import _indexer_topk_triton, indexer_topk_reference, scores_reference


def test_indexer_score_without_relu_by_hand():
    g = torch.Generator().manual_seed(0)
    q, w, k = torch.randn(1, 3, 2, 4, generator=g), torch.randn(1, 3, 2, generator=g), torch.randn(1, 5, 4, generator=g)
    dots = torch.einsum("bthd,bsd->bths", q, k)
    torch.testing.assert_close(scores_reference(q, w, k, relu=False), torch.einsum("bth,bths->bts", w, dots))
    torch.testing.assert_close(scores_reference(q, w, k), torch.einsum("bth,bths->bts", w, dots.relu()))
    assert not torch.allclose(scores_reference(q, w, k, relu=False), scores_reference(q, w, k))


def test_triton_topk_follows_the_relu_flag():
    g = torch.Generator().manual_seed(1)
    q, w, k = torch.randn(2, 40, 4, 32, generator=g), torch.randn(2, 40, 4, generator=g), torch.randn(2, 40, 32, generator=g)
    qpos = torch.arange(40).expand(2, 40)
    for relu in (True, False):
        want = indexer_topk_reference(q, w, k, qpos, 8, relu=relu)
        assert torch.equal(_indexer_topk_triton(q, w, k, qpos, 8, False, relu), want)
    assert not torch.equal(indexer_topk_reference(q, w, k, qpos, 8, relu=False),
                           indexer_topk_reference(q, w, k, qpos, 8, relu=True))


def test_mtp_input_post_norm_feeds_the_normed_state():
    cfg = configs.load("micro").model
    torch.manual_seed(0)
    pre = Transformer(cfg)
    post = Transformer(ModelConfig(**{**cfg.model_dump(), "mtp_input": "post_norm"}))
    post.load_state_dict(pre.state_dict())
    with torch.no_grad():
        pre.norm.weight.mul_(1.7)  # a non-trivial final norm
        post.norm.weight.copy_(pre.norm.weight)
    ids = torch.randint(0, 256, (2, 12))
    h = pre.run(ids).hidden
    got, _ = post.mtp(h[:, :-1], ids[:, 1:], 0)
    want, _ = pre.mtp(pre.norm(h[:, :-1]), ids[:, 1:], 0)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, pre.mtp(h[:, :-1], ids[:, 1:], 0)[0])
    # later draft steps chain the previous step's hidden state unchanged in either convention
    torch.testing.assert_close(post.mtp(h[:, :-1], ids[:, 1:], 1)[0], pre.mtp(h[:, :-1], ids[:, 1:], 1)[0])
