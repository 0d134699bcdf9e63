"""Backends: two-process gloo data parallelism reproduces single-process gradients and steps, including
parameters that get a gradient on only some ranks (MoE routing, MTP) or on none."""

import signal

import pytest
import torch
from torch import nn

import configs
from model import Transformer, next_token_loss
from trainers.backends import DDPBackend, TorchBackend, launch

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 24


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (4, SEQ), generator=g)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _train_step(backend, model: Transformer, ids: torch.Tensor):
    """One data-parallel step; returns (mean-reduced grads, params after AdamW, router biases after)."""
    model = backend.wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    backend.backward(next_token_loss(model(ids), ids))
    backend.all_reduce_grads(model)
    grads = _grads(model)
    backend.step(opt)
    model.update_router_bias(0.1)
    biases = [m.gate.e_score_correction_bias.clone() for m in model.moe_layers()]
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, biases


class TwoBranch(nn.Module):
    """Rank 0 uses branch `a` only, rank 1 both; `never` is used by no rank."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.never = nn.Linear(3, 1), nn.Linear(3, 1), nn.Linear(3, 1)


def _ddp_worker(backend: DDPBackend, ids: torch.Tensor):
    assert backend.world_size == 2 and backend.is_main == (backend.rank == 0)
    torch.manual_seed(1000 + backend.rank)  # different init per rank: wrap() must broadcast rank 0's
    model = Transformer(configs.load("micro").model)
    local = ids[2 * backend.rank : 2 * backend.rank + 2]
    lm = _train_step(backend, model, local)

    torch.manual_seed(5)
    tb = backend.wrap(TwoBranch())
    x = torch.ones(2, 3) * (backend.rank + 1)
    loss = tb.a(x).sum() + (tb.b(x).sum() if backend.rank == 1 else 0)
    backend.backward(loss)
    backend.all_reduce_grads(tb)
    backend.barrier()
    return lm, _grads(tb)


def test_two_process_ddp_matches_single_process():
    ids = _batch()
    # Rank 0's initial weights are seed 1000's; the reference starts from the same ones.
    torch.manual_seed(1000)
    ref_model = Transformer(configs.load("micro").model)
    ref_grads, ref_params, ref_biases = _train_step(TorchBackend(), ref_model, ids)

    (lm0, tb0), (lm1, tb1) = launch(_ddp_worker, 2, ids)

    for grads, params, biases in (lm0, lm1):
        assert grads.keys() == ref_grads.keys()
        for n, g in ref_grads.items():
            if g is None:  # e.g. MTP layers: no rank produced a gradient, so none is invented
                assert grads[n] is None, n
            else:
                torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-5, msg=n)
        for n, p in ref_params.items():
            # Adam divides by |g| + eps, which magnifies summation-order differences (~1e-11) of
            # near-zero gradients: agreement to 1% of the learning rate is the meaningful bound.
            torch.testing.assert_close(params[n], p, atol=1e-4, rtol=0, msg=n)
        for b, rb in zip(biases, ref_biases):  # router bias update saw the global expert load
            torch.testing.assert_close(b, rb, atol=0, rtol=0)
    assert any(g is None for g in ref_grads.values()) and any(g is not None for g in ref_grads.values())
    for n in lm0[1]:  # after one step the ranks agree exactly
        assert torch.equal(lm0[1][n], lm1[1][n]), n

    # Unused parameters: `b` only has a gradient on rank 1 → averaged with rank 0's implicit zero.
    torch.manual_seed(5)
    ref = TwoBranch()
    (ref.a(torch.ones(2, 3)).sum() + ref.a(2 * torch.ones(2, 3)).sum() + ref.b(2 * torch.ones(2, 3)).sum()).backward()
    for got in (tb0, tb1):
        for n in ("a.weight", "a.bias", "b.weight", "b.bias"):
            torch.testing.assert_close(got[n], dict(ref.named_parameters())[n].grad / 2, msg=n)
        assert got["never.weight"] is None and got["never.bias"] is None


def test_torch_backend_and_launch_errors():
    b = TorchBackend()
    assert (b.rank, b.world_size, b.is_main) == (0, 1, True)
    m = nn.Linear(2, 1)
    assert b.wrap(m) is m
    with pytest.raises(ValueError, match="world_size"):
        launch(_ddp_worker, 0)


def _rank_of(backend):
    return (backend.rank, backend.world_size)


def test_launch_tries_another_port_when_its_port_was_taken(squatted_port):
    """`free_port` can hand out a port that another process binds before the rendezvous does (two test workers, a busy
    host): the launch fails on EADDRINUSE and tries a new port. A port taken every time still fails, with the error."""
    import trainers.backends as tb

    assert launch(_rank_of, 2) == [(0, 2), (1, 2)]
    assert squatted_port.handed[0] == squatted_port.taken and len(squatted_port.handed) == 2
    squatted_port.always()
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="EADDRINUSE|address already in use"):
        launch(_rank_of, 2)
    assert tb.port_taken("code: -98, name: EADDRINUSE, message: address already in use")
    assert not tb.port_taken("RuntimeError: NaN loss")


def _sigterm_of(backend):
    return int(signal.getsignal(signal.SIGTERM)), signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_launched_ranks_die_on_sigterm_whatever_the_parent_ignored():
    """A child inherits an ignored or blocked SIGTERM across exec; a launched rank resets both, so a rank stuck in the
    rendezvous when another fails is stopped by the launcher's SIGTERM. Checked with the launching process ignoring
    and blocking SIGTERM: each rank reports the default disposition and an empty mask."""
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        assert launch(_sigterm_of, 2) == [(int(signal.SIG_DFL), False)] * 2
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        signal.signal(signal.SIGTERM, old)


def test_trainer_device_places_the_model_and_names_its_key(monkeypatch):
    """`trainer.device`: the backend's `wrap` puts the model there (checked with the meta device, which any machine
    has); `auto` is the host without CUDA, and `cuda` without CUDA is refused with the key named."""
    from trainers.config import TrainerConfig
    from trainers.runtime import make_train_backend

    m = TorchBackend("meta").wrap(Transformer(configs.load("micro").model))
    assert all(p.is_meta for p in m.parameters())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    be = make_train_backend(TrainerConfig())
    assert isinstance(be, TorchBackend) and be.device == torch.device("cpu")
    with pytest.raises(ValueError, match="trainer.device: cuda"):
        make_train_backend(TrainerConfig(device="cuda"))
    with pytest.raises(ValueError, match="trainer.dist_backend: nccl"):
        make_train_backend(TrainerConfig(device="cpu", dist_backend="nccl", world_size=2), 0, 2)
    with pytest.raises(ValueError, match="trainer.device: cpu with trainer.kind=megatron"):
        TrainerConfig(kind="megatron", device="cpu")


def _zero_worker(backend: DDPBackend, ids: torch.Tensor, out: str):
    """Two LM steps with the backend's optimizer, ZeRO-1 on and off, from the same weights; with it on, a sharded
    training state saved after step 1 and restored into other weights and a fresh optimizer."""
    from trainers.checkpoint import load_training_state, restore, save_training_state
    from trainers.optim import ShardedAdamW

    local = ids[2 * backend.rank : 2 * backend.rank + 2]
    res = {}
    for zero in (False, True):
        backend.distributed_optimizer = zero
        torch.manual_seed(0)
        model = backend.wrap(Transformer(configs.load("micro").model))
        opt = backend.optimizer(model.parameters(), lr=1e-2)

        def step(m, o, rows):
            backend.backward(next_token_loss(m(rows), rows))
            backend.all_reduce_grads(m)
            backend.clip_grad_norm(m, 1.0)
            backend.step(o)
            o.zero_grad(set_to_none=True)

        step(model, opt, local)
        if zero:
            assert isinstance(opt, ShardedAdamW) and backend.sharded_state
            save_training_state(out, policy=model, optimizer=opt, step=1, policy_version=2, data_cursor=0,
                                backend=backend)
        step(model, opt, local.flip(0))
        res[zero] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if zero:
            res["shard"] = opt.local_shard_numel(), sum(p.numel() for p in model.parameters())
            torch.manual_seed(1)
            other = backend.wrap(Transformer(configs.load("micro").model))
            opt2 = backend.optimizer(other.parameters(), lr=1e-2)
            restore(load_training_state(out), other, opt2, backend=backend)
            step(other, opt2, local.flip(0))
            res["resumed"] = {n: p.detach().clone() for n, p in other.named_parameters()}
    backend.distributed_optimizer = False
    return res


def test_ddp_distributed_optimizer_steps_as_adamw_and_resumes_from_its_rank_files(tmp_path):
    """`trainer.distributed_optimizer` on the torch data-parallel backend: each rank updates half of the weights
    (element-exact split) and all-gathers the rest, so two steps equal the whole AdamW's bit for bit; the training
    state is saved as rank files, and restoring it into other weights and fresh optimizers continues bit for bit."""
    got = launch(_zero_worker, 2, _batch(), str(tmp_path / "state"))
    for r, res in enumerate(got):
        for n, w in res[False].items():
            assert torch.equal(res[True][n], w), (r, n)
            assert torch.equal(res["resumed"][n], w), (r, n)
    (s0, total), (s1, _) = (res["shard"] for res in got)
    assert s0 + s1 == total and abs(s0 - s1) <= 1  # one param group, one dtype: ceil(n / 2) and the rest
    from trainers.checkpoint import load_training_state

    state = load_training_state(tmp_path / "state")
    assert state.ranks == 2 and state.layout == {"world": 2, "distributed_optimizer": True}


def test_distributed_optimizer_key_belongs_to_the_torch_backends():
    from trainers.config import TrainerConfig

    with pytest.raises(ValueError, match="trainer.megatron.distributed_optimizer"):
        TrainerConfig(kind="megatron", distributed_optimizer=True)
