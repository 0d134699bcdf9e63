"""The eager code's paths are chosen by shape, whatever another thread does: while Dynamo compiles in one thread,
`torch.compiler.is_compiling()` reads True in every thread (an engine compiling its decode step beside a trainer's
forward), so the kernels ask `torch.compiler.is_dynamo_compiling()`, true only inside the trace."""

import torch

import temper_kernels.moe as kmoe


def _moe_inputs(n, e=8, k=2, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g)
    return x, idx, w, torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)


def test_an_eager_moe_call_keeps_its_path_while_another_thread_compiles(monkeypatch):
    args = _moe_inputs(64)  # past DENSE_ROWS: the routed loop
    want = kmoe.moe_experts_reference(*args)
    dense = []
    real = kmoe.moe_experts_dense
    monkeypatch.setattr(kmoe, "moe_experts_dense", lambda *a: dense.append(1) or real(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # what Dynamo's global flag reads meanwhile
    got = kmoe.moe_experts_reference(*args)
    assert dense == [] and torch.equal(got, want)
    kmoe.moe_experts_reference(*_moe_inputs(8))  # a decode-sized call takes the dense GEMM, as always
    assert dense == [1]


def test_inside_a_dynamo_trace_the_flag_is_set():
    f = torch.compile(lambda x: x + (1.0 if torch.compiler.is_dynamo_compiling() else 0.0), backend="eager")
    assert torch.equal(f(torch.zeros(3)), torch.ones(3)) and not torch.compiler.is_dynamo_compiling()
