"""The CUDA path's Python code never reads the device, checked on the CPU: the model and its cache live on the `meta`
device (shapes, no data), the dispatch takes the Triton branch of every op, and every Triton kernel is replaced by a
launch that only checks its grid and arguments. What a host sync needs then fails:

* `.item()`, `.tolist()`, `int(t)`, `bool(t)`, `nonzero()`, boolean-mask indexing, `repeat_interleave` by a tensor,
  `bincount`: a meta tensor has no data to read, so these raise;
* a tensor made on the host and used with device tensors (a host-to-device copy, synchronous from pageable memory):
  `HostTensors` records every op that mixes the two;
* a kernel grid computed from device data: the fake launch asserts plain Python ints.

So the captured decode step (`DecodeGraphs.step`, dense and sparse key buckets) and a training forward + backward
(indexer KL, MTP, chunked cross-entropy) have none: the necessary condition for CUDA-graph capture, which the H200's
sync-debug warm-up (`rollout.engine.syncs_in`) checks on the device itself. This covers what runs on CUDA, the
kernels' launch code included (the indexer's packing, the sparse MLA's forward and backward wrappers, the grouped
GEMM's device-built tile schedule); tests/rollout/test_engine_device.py watches the same decode step on real CPU
tensors, where the torch reference kernels run instead and are left out of its check."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import configs
from model import KVCache, Transformer
from model.losses import indexer_kl_loss
from rollout.engine import DecodeGraphs, EngineStats

pytest.importorskip("triton.runtime")


class HostTensors(TorchDispatchMode):
    """Records ops that take a host tensor of one element or more together with a meta (device) tensor."""

    def __init__(self):
        super().__init__()
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        ts = [t for t in flat if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in ts) and any(t.device.type == "cpu" and t.dim() > 0 for t in ts):
            self.mixed.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def triton_on_meta():
    """Every op takes its Triton branch; kernels launch nothing (`temper_kernels.meta.on_meta`). Yields the names of
    the kernels launched."""
    from temper_kernels.meta import on_meta

    with on_meta() as launched:
        yield launched


def _meta(*shape, dtype=torch.long):
    return torch.zeros(*shape, dtype=dtype, device="meta")


def test_the_captured_decode_step_never_reads_the_device(triton_on_meta):
    cfg = configs.load("tiny").model  # DV 64, DR 16: the sparse MLA kernel's shapes
    with torch.device("meta"):
        model = Transformer(cfg).eval()
        cache = KVCache(cfg, 5, 256, dtype=torch.float32, device=torch.device("meta"))
    graphs = DecodeGraphs(model, cache, 4, EngineStats())
    for n_keys in (16, cfg.index_topk, 256):  # dense (within the top-k) and sparse (past it)
        triton_on_meta.clear()
        with torch.no_grad(), HostTensors() as host:
            logits = graphs.step(_meta(4, 1), torch.arange(4, device="meta"), torch.ones(4, dtype=torch.long,
                                                                                         device="meta"), n_keys)
        assert logits.shape == (4, 1, cfg.vocab_size) and host.mixed == [], (n_keys, host.mixed)
        sparse = {"_scores_kernel", "_topk_block_kernel", "_fwd_kernel"}
        assert sparse <= set(triton_on_meta) if n_keys > cfg.index_topk else not sparse & set(triton_on_meta)
        assert {"_gmm_kernel", "_rms_fwd"} <= set(triton_on_meta)


def test_a_training_forward_and_backward_never_read_the_device(triton_on_meta):
    import temper_kernels as tk

    cfg = configs.load("tiny").model
    with torch.device("meta"):
        model = Transformer(cfg).train()
    ids = _meta(2, 200)
    with HostTensors() as host:
        out = model.run(ids, collect_indexer=True, detach_indexer_input=True)
        ce = tk.chunked_cross_entropy(out.hidden[:, :-1].reshape(-1, cfg.hidden_size), model.lm_head.weight,
                                      ids[:, 1:].reshape(-1), chunk=128)
        mtp_logits, _ = model.mtp(out.hidden[:, :-1], ids[:, 1:], 0)
        loss = ce + out.logits.float().mean() + mtp_logits.float().mean() + indexer_kl_loss(out.indexer_stats)
        loss.backward()
    assert host.mixed == []
    assert {"_scores_kernel", "_topk_block_kernel", "_fwd_kernel", "_bwd_ds_kernel", "_bwd_dq_kernel", "_bwd_dkv_kernel",
            "_gmm_kernel", "_gmm_dw_kernel", "_rms_fwd", "_rms_bwd"} <= set(triton_on_meta)
    assert model.embed_tokens.weight.grad is not None and model.embed_tokens.weight.grad.device.type == "meta"


def test_the_check_catches_host_reads_and_host_tensors(triton_on_meta, monkeypatch):
    """The probe itself: a host read in the MoE dispatch (CUDA's `bincount`, the sync the H200 found), an `.item()` in
    the router and a host-made index each make the decode step fail or show."""
    import temper_kernels as tk

    cfg = configs.load("tiny").model
    with torch.device("meta"):
        model = Transformer(cfg).eval()
        cache = KVCache(cfg, 5, 128, dtype=torch.float32, device=torch.device("meta"))
    graphs = DecodeGraphs(model, cache, 4, EngineStats())

    def step():
        with torch.no_grad():
            return graphs.step(_meta(4, 1), torch.arange(4, device="meta"),
                               torch.ones(4, dtype=torch.long, device="meta"), 16)

    with monkeypatch.context() as m:
        m.setattr(tk.moe, "expert_counts", lambda idx, n: torch.bincount(idx.reshape(-1), minlength=n))
        with pytest.raises(NotImplementedError, match="bincount"):
            step()
    with monkeypatch.context() as m:
        real = tk.route  # what the model's router calls
        m.setattr(tk, "route", lambda logits, *a, **k: (float(logits.max().item()), real(logits, *a, **k))[1])
        with pytest.raises((RuntimeError, NotImplementedError), match="meta|data"):
            step()
    with monkeypatch.context() as m:
        real_route = tk.route
        m.setattr(tk, "route", lambda logits, *a, **k: tuple(  # indexed by a host-made index: copied to the device
            x[torch.arange(x.shape[0])] for x in real_route(logits, *a, **k)))
        with HostTensors() as host:
            step()
        assert host.mixed, "a host tensor added to device tensors went unseen"
