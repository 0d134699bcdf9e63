"""`ShardedAdamW` (trainers/optim.py) against torch's own AdamW: in fp32 its update is AdamW's bit for
bit, on one rank and split element-exactly over two gloo ranks; in bf16 the weights are torch AdamW's on fp32 copies,
cast, where a bf16 AdamW rounds the update away; a resumed state continues bit for bit; weights changed from outside
are taken up; another layout is refused."""

import copy

import pytest
import torch
import torch.distributed as dist

from trainers.backends import launch
from trainers.optim import ShardedAdamW

pytestmark = pytest.mark.usefixtures("one_thread")

# the bf16 tests also run on a GPU (`bench/gpu_run.sh tests`): there both AdamWs take torch's foreach path
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]

SIZES = [(7,), (5,), (3,)]  # param groups [p0, p1] (12 elements) and [p2] (3), each split over the ranks on its own


def _params(dtype=torch.float32, seed=0, sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in sizes]


def _grads(step: int, sizes=SIZES, salt: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step + 1000 * salt)
    return [torch.randn(s, generator=g) for s in sizes]


def _groups(ps):
    """Two param groups with their own weight decay and lr (the trainers' LM form)."""
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0, "lr": 3e-3}]


def _run(opt, ps, steps, dtype, skip=None, salt: int = 0):
    """`steps` steps with a per-step lr; on step `skip` the second parameter has no gradient."""
    for t in range(steps):
        for p, g in zip(ps, _grads(t, salt=salt), strict=True):
            p.grad = g.to(dtype)
        if t == skip:
            ps[1].grad = None
        for grp in opt.param_groups:
            grp["lr"] = 1e-2 * (t + 1)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_fp32_one_rank_is_torch_adamw_bit_for_bit():
    ref, mine = _params(), _params()
    _run(torch.optim.AdamW(_groups(ref), lr=1e-2), ref, 4, torch.float32, skip=2)
    opt = ShardedAdamW(_groups(mine), lr=1e-2)
    _run(opt, mine, 4, torch.float32, skip=2)
    for a, b in zip(ref, mine, strict=True):
        assert torch.equal(a, b)
    # fp32 weights are their own main weights: the state is the two moments
    assert opt.local_shard_numel() == 15 and opt.local_state_numel() == 30 and opt.local_state_bytes() == 4 * 30


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weights_are_adamw_on_fp32_main_weights(device):
    """The reference is torch AdamW over fp32 copies fed the bf16 gradients, cast to bf16 after every step. Weights
    in [0.009, 0.014) have a bf16 ulp of 2^-14 (6.1e-5); with gradients of one sign Adam moves them about lr = 1e-5
    a step, under half an ulp: a bf16 AdamW leaves them where they were, the main weights add the steps up."""
    lr = 1e-5
    g = torch.Generator().manual_seed(0)
    start = [(0.009 + 0.005 * torch.rand(s, generator=g)).to(device, torch.bfloat16) for s in SIZES]
    main_ref = [w.float().requires_grad_() for w in start]
    mine, plain = [w.clone().requires_grad_() for w in start], [w.clone().requires_grad_() for w in start]
    opt, plain_opt, ref_opt = ShardedAdamW(mine, lr=lr), torch.optim.AdamW(plain, lr=lr), torch.optim.AdamW(main_ref,
                                                                                                            lr=lr)
    for t in range(40):
        grads = [(g.abs() + 0.1).to(device, torch.bfloat16) for g in _grads(t)]
        for p, q, r, gr in zip(mine, plain, main_ref, grads, strict=True):
            p.grad, q.grad, r.grad = gr.clone(), gr.clone(), gr.float()
        opt.step()
        plain_opt.step()
        ref_opt.step()
        for p, r in zip(mine, main_ref, strict=True):
            assert torch.equal(p.detach(), r.detach().to(torch.bfloat16)), t
    assert all(torch.equal(q, s) for q, s in zip(plain, start, strict=True))  # bf16 AdamW: nothing moved
    assert opt.local_state_bytes() == 4 * 3 * 15  # an fp32 copy and two moments per bf16 element
    assert all(bool((p < s).all()) for p, s in zip(mine, start, strict=True))  # every weight went down


def test_resume_continues_bit_for_bit_and_other_layouts_are_refused():
    lr = 1e-4
    ps = _params(torch.bfloat16)
    opt = ShardedAdamW(_groups(ps), lr=lr)
    _run(opt, ps, 3, torch.bfloat16)
    saved_w, saved = [p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict())  # as torch.save would
    _run(opt, ps, 2, torch.bfloat16, salt=1)

    other = _params(torch.bfloat16, seed=9)  # other weights, a fresh optimizer: the state must bring everything
    opt2 = ShardedAdamW(_groups(other), lr=lr)
    with torch.no_grad():
        for p, w in zip(other, saved_w, strict=True):
            p.copy_(w)
    opt2.load_state_dict(saved)
    _run(opt2, other, 2, torch.bfloat16, salt=1)
    for a, b in zip(ps, other, strict=True):
        assert torch.equal(a, b)
    # without the main weights (seeded from the bf16 weights instead) the same two steps land elsewhere
    fresh = [w.clone().requires_grad_() for w in saved_w]
    opt3 = ShardedAdamW(_groups(fresh), lr=lr)
    opt3._inner.load_state_dict(saved["inner"])
    _run(opt3, fresh, 2, torch.bfloat16, salt=1)
    assert any(not torch.equal(a, b) for a, b in zip(ps, fresh, strict=True))

    wrong = ShardedAdamW([{"params": _params(torch.bfloat16, sizes=[(7,), (5,), (4,)])}], lr=lr)
    with pytest.raises(ValueError, match=r"model dtype .*trainer\.megatron\.dtype.*trainer\.megatron\.distributed_optimizer"):
        wrong.load_state_dict(saved)
    with pytest.raises(ValueError, match="trainer.megatron.distributed_optimizer"):
        wrong.load_state_dict({"state": {}, "param_groups": []})  # a plain AdamW's


def test_weights_changed_from_outside_are_taken_up():
    """After a step, new weights are loaded into the model (a checkpoint's): the next step starts from them, with the
    moments carried on, as AdamW on those weights would."""
    ref, mine = _params(), _params()
    ropt, opt = torch.optim.AdamW(ref, lr=1e-2), ShardedAdamW(mine, lr=1e-2)
    _run(ropt, ref, 1, torch.float32)
    _run(opt, mine, 1, torch.float32)
    with torch.no_grad():
        for a, b, w in zip(ref, mine, _params(seed=5), strict=True):
            a.copy_(w)
            b.copy_(w)
    _run(ropt, ref, 2, torch.float32, salt=2)
    _run(opt, mine, 2, torch.float32, salt=2)
    for a, b in zip(ref, mine, strict=True):
        assert torch.equal(a, b)


def test_bf16_weights_changed_from_outside_are_taken_up():
    """bf16: after a step, new weights are loaded (every element moved by 1, so none still rounds from its main
    weight); the next steps equal AdamW on fp32 copies set to those weights, moments carried on."""
    lr = 1e-4
    mine = _params(torch.bfloat16)
    ref = [p.detach().float().requires_grad_() for p in mine]
    ropt, opt = torch.optim.AdamW(ref, lr=lr), ShardedAdamW(mine, lr=lr)

    def steps(salt):
        for t in range(2):
            for p, r, g in zip(mine, ref, _grads(t, salt=salt), strict=True):
                p.grad, r.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
            ropt.step()
            opt.step()

    steps(0)
    with torch.no_grad():
        for p, r in zip(mine, ref, strict=True):
            p.add_(1.0)
            r.copy_(p.float())
    steps(3)
    for p, r in zip(mine, ref, strict=True):
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))


def test_a_partial_outside_change_keeps_the_other_main_weights():
    """One element of a bf16 weight is overwritten in place: that element restarts from the new value, every other
    keeps its fp32 main weight (a whole-weight reseed from bf16 would lose their sub-ulp progress)."""
    lr = 1e-5
    g = torch.Generator().manual_seed(0)
    w = (0.009 + 0.005 * torch.rand(8, generator=g)).to(torch.bfloat16).requires_grad_()
    opt = ShardedAdamW([w], lr=lr, weight_decay=0.0)
    for _ in range(3):  # sub-ulp steps: the main weight moves, the bf16 weight does not
        w.grad = torch.ones(8, dtype=torch.bfloat16)
        opt.step()
    main = opt._segments()[0].main.clone()
    assert not torch.equal(main, w.detach().float())
    with torch.no_grad():
        w[3] = 0.5
    w.grad = torch.zeros(8, dtype=torch.bfloat16)  # a step with zero gradient: Adam's momentum still moves it
    ref = main.clone()
    ref[3] = 0.5
    ref = ref.requires_grad_()
    ropt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    ropt.load_state_dict({"state": {0: {k: v.clone() for k, v in opt._inner.state_dict()["state"][0].items()}},
                          "param_groups": ropt.state_dict()["param_groups"]})
    ref.grad = torch.zeros(8)
    ropt.step()
    opt.step()
    assert torch.equal(opt._segments()[0].main, ref.detach())


def test_unsupported_options_are_refused():
    with pytest.raises(ValueError, match=r"\['amsgrad'\]"):
        ShardedAdamW(_params(), lr=1e-3, amsgrad=True)
    p = _params()
    with pytest.raises(ValueError, match="more than one param group"):
        ShardedAdamW([{"params": p}, {"params": p[:1]}], lr=1e-3)


def _two_ranks(backend, dtype_name: str, chunk: int):
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    dense = _params(dtype)
    expert = _params(dtype, seed=50 + rank, sizes=[(6,)])  # each rank its own expert, whole on that rank
    expert[0].routed_expert = True
    opt = ShardedAdamW(_groups(dense) + [{"params": expert}], lr=1e-2, dense_group=dist.group.WORLD,
                       expert_group=solo[rank], gather_chunk=chunk)
    numel = opt.local_shard_numel()
    for t in range(3):
        for p, g in zip(dense, _grads(t), strict=True):
            p.grad = g.to(dtype)
        expert[0].grad = _grads(t, sizes=[(6,)], salt=rank + 1)[0].to(dtype)
        for grp in opt.param_groups:
            grp["lr"] = 1e-2 * (t + 1)
        opt.step()
        opt.zero_grad()
    return {"dense": [p.detach().clone() for p in dense], "expert": expert[0].detach().clone(), "numel": numel,
            "moments": opt.local_state_numel(), "state": opt.state_dict()}


def _reference(dtype, rank):
    """One process, torch AdamW over fp32 copies of every parameter, with rank `rank`'s expert."""
    dense = [p.detach().float().requires_grad_() for p in _params(dtype)]
    expert = [p.detach().float().requires_grad_() for p in _params(dtype, seed=50 + rank, sizes=[(6,)])]
    opt = torch.optim.AdamW(_groups(dense) + [{"params": expert}], lr=1e-2)
    for t in range(3):
        for p, g in zip(dense, _grads(t), strict=True):
            p.grad = g.to(dtype).float()
        expert[0].grad = _grads(t, sizes=[(6,)], salt=rank + 1)[0].to(dtype).float()
        for grp in opt.param_groups:
            grp["lr"] = 1e-2 * (t + 1)
        opt.step()
    return [p.detach().to(dtype) for p in dense], expert[0].detach().to(dtype)


@pytest.mark.parametrize("dtype, chunk", [("float32", 1 << 24), ("bfloat16", 4)])
def test_two_ranks_split_the_state_exactly_and_step_as_one_adamw(dtype, chunk):
    """`chunk` 4: a rank's range of 6 goes out in all-gathers of 4 and 2 elements."""
    got = launch(_two_ranks, 2, dtype, chunk)
    for rank, g in enumerate(got):
        dense, expert = _reference(getattr(torch, dtype), rank)
        for a, b in zip(dense, g["dense"], strict=True):
            assert torch.equal(a, b), rank  # each rank's dense weights: the whole update, gathered
        assert torch.equal(expert, g["expert"]), rank
    # group 1's 12 elements split 6 / 6, group 2's 3 split 2 / 1; each rank's 6 expert elements whole
    assert [g["numel"] for g in got] == [6 + 2 + 6, 6 + 1 + 6]
    assert [g["moments"] for g in got] == [2 * (6 + 2 + 6), 2 * (6 + 1 + 6)]
    # (lo, hi) of each owned piece: rank 0 holds p0[0:6] and p2[0:2]; rank 1 p0[6:7], all of p1 and p2[2:3]
    lay0, lay1 = got[0]["state"]["layout"], got[1]["state"]["layout"]
    assert [lay0[0][0][4], lay0[1][0][4], lay0[2][0][4]] == [[(0, 6)], [(0, 2)], [(0, 6)]]
    assert [lay1[0][0][4], lay1[1][0][4], lay1[2][0][4]] == [[(6, 7), (0, 5)], [(2, 3)], [(0, 6)]]


def _two_optimizers(backend):
    """Phase 1 (A) then phase 2 (B) over the same bf16 weights, both built first (the base recipe's two trainers):
    B, stepping with lr 0, must keep A's weights, so it must see that A's sharded publish changed them."""
    w = torch.nn.Parameter(torch.linspace(-1, 1, 10).to(torch.bfloat16))
    a = ShardedAdamW([w], lr=0.05, weight_decay=0.0, dense_group=dist.group.WORLD)
    b = ShardedAdamW([w], lr=0.0, weight_decay=0.0, dense_group=dist.group.WORLD)
    start = w.detach().clone()
    for _ in range(3):
        w.grad = torch.ones(10, dtype=torch.bfloat16)
        a.step()
        a.zero_grad()
    after_a = w.detach().clone()
    w.grad = torch.ones(10, dtype=torch.bfloat16)
    b.step()
    return not torch.equal(after_a, start), torch.equal(w.detach(), after_a)


def test_a_sharded_publish_is_seen_by_another_optimizer_of_the_same_weights():
    """The all-gathered ranges are written so that the weights' version counters move (not through `.data`): another
    optimizer over the same weights takes them into its main weights instead of publishing its stale copy."""
    assert launch(_two_optimizers, 2) == [(True, True)] * 2


def test_param_groups_given_as_generators_keep_their_parameters():
    """`TrainBackend.optimizer` reads each group's parameters once, so a generator (`model.parameters()`) in a group is
    not used up by its dtype check: every parameter is trained, on the fp32 path and the main-weights path."""
    from trainers.backends import TorchBackend

    for dtype in (torch.float32, torch.bfloat16):
        m = torch.nn.Linear(3, 2).to(dtype)
        opt = TorchBackend().optimizer([{"params": m.parameters(), "lr": 0.1}])
        before = [p.detach().clone() for p in m.parameters()]
        m(torch.ones(4, 3, dtype=dtype)).sum().backward()
        opt.step()
        assert all(not torch.equal(a, p.detach()) for a, p in zip(before, m.parameters(), strict=True)), dtype


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_gradients_of_micro_batches_sum_in_fp32(device):
    """Two backwards into a bf16 weight (two micro-batches): the step reads the fp32 sum of the two bf16 gradients,
    where autograd's own accumulation would add them in bf16 and round. `.grad` stays empty; `zero_grad` clears the
    sum; the step equals torch AdamW on an fp32 copy fed that sum."""
    w = torch.full((4,), 0.5, dtype=torch.bfloat16, device=device, requires_grad=True)
    x1 = torch.tensor([1.0, 1.0, 3.0, 1.0], dtype=torch.bfloat16, device=device)
    x2 = torch.tensor([2 ** -9, 2 ** -8, 2 ** -7, 1.0], dtype=torch.bfloat16, device=device)  # rounded away in bf16
    opt = ShardedAdamW([w], lr=1e-3, weight_decay=0.0)
    (w * x1).sum().backward()
    (w * x2).sum().backward()
    assert w.grad is None
    want = x1.float() + x2.float()
    assert torch.equal(w.main_grad, want)
    assert not torch.equal((x1 + x2).float(), want)  # what a bf16 accumulation would have given
    ref = w.detach().float().requires_grad_()
    ref.grad = want.clone()
    torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0).step()
    opt.step()
    assert torch.equal(w.detach(), ref.detach().to(torch.bfloat16))
    opt.zero_grad()
    assert w.main_grad is None and w.grad is None
    f32 = torch.zeros(3, device=device, requires_grad=True)  # an fp32 weight keeps its plain `.grad`
    ShardedAdamW([f32], lr=1e-3)
    (f32 * 2).sum().backward()
    assert torch.equal(f32.grad, torch.full((3,), 2.0, device=device)) and not hasattr(f32, "main_grad")


class _Net(torch.nn.Module):
    """A bf16 weight and an fp32 one (as a bf16 checkpoint keeps its routers), and a bf16 weight only rank 1 uses."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(4, 3, generator=g).to(torch.bfloat16))
        self.b = torch.nn.Parameter(torch.randn(3, generator=g))
        self.c = torch.nn.Parameter(torch.randn(3, generator=g).to(torch.bfloat16))

    def loss(self, x: torch.Tensor, use_c: bool = False) -> torch.Tensor:
        y = (x.to(torch.bfloat16) @ self.a).float() * self.b
        if use_c:
            y = y + (x[:, :3].to(torch.bfloat16) * self.c).float()
        return y.pow(2).sum()


def _xs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, generator=g) for _ in range(n)]


def test_the_torch_backend_trains_bf16_weights_through_fp32_main_weights():
    """`TorchBackend.optimizer` on a model with bf16 weights: `ShardedAdamW`; two micro-batches sum in fp32, the
    backend's clip scales the fp32 sums by torch's rule, and the step equals torch AdamW on fp32 copies fed them."""
    from trainers.backends import TorchBackend

    be, net = TorchBackend(), _Net()
    ref = {n: p.detach().float().clone() for n, p in net.named_parameters()}
    opt = be.optimizer(net.parameters(), lr=1e-3)
    assert isinstance(opt, ShardedAdamW)
    assert isinstance(be.optimizer([torch.zeros(2, requires_grad=True)], lr=1e-3), torch.optim.AdamW)  # fp32 only
    from trainers.config import TrainerConfig
    from trainers.runtime import make_train_backend

    off = make_train_backend(TrainerConfig(device="cpu", fp32_main_weights=False))  # the opt-out: a bf16 AdamW
    assert type(off.optimizer(_Net().parameters(), lr=1e-3)) is torch.optim.AdamW
    grads = {n: torch.zeros_like(r) for n, r in ref.items()}
    for x in _xs(2, 1):
        twin = _Net()  # the same weights; its grads, cast to fp32, summed by hand
        twin.loss(x, use_c=True).backward()
        for n, p in twin.named_parameters():
            grads[n] += p.grad.float()
        net.loss(x, use_c=True).backward()
    for n, p in net.named_parameters():
        if p.dtype == torch.bfloat16:  # bf16: the fp32 sum in main_grad; fp32 (b): autograd's own fp32 sum
            assert p.grad is None and torch.equal(p.main_grad, grads[n]), n
        else:
            assert torch.equal(p.grad, grads[n]), n
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    norm = be.clip_grad_norm(net, 0.5)
    assert torch.equal(norm, total) and float(total) > 0.5  # so the clip scales
    coef = (0.5 / (total + 1e-6)).clamp(max=1.0)
    fp32 = {n: r.clone().requires_grad_() for n, r in ref.items()}
    for n, p in fp32.items():
        p.grad = grads[n] * coef
    torch.optim.AdamW(list(fp32.values()), lr=1e-3).step()
    opt.step()
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), fp32[n].detach().to(p.dtype)), n


def _ddp_bf16(backend):
    net = _Net()
    opt = backend.optimizer(net.parameters(), lr=1e-3)
    for x in _xs(2, 10 + backend.rank):
        net.loss(x, use_c=backend.rank == 1).backward()
    backend.all_reduce_grads(net)
    return {n: (p.main_grad if p.dtype == torch.bfloat16 else p.grad).clone() for n, p in net.named_parameters()}, \
        type(opt).__name__


def test_ddp_averages_the_fp32_main_gradients():
    """Two gloo ranks, bf16 weights: the reduced gradients are the mean of each rank's fp32 sums, and `c`, used on
    rank 1 only, gets rank 1's half on both (a zero fp32 main gradient stood in on rank 0)."""
    got = launch(_ddp_bf16, 2)
    want = {n: torch.zeros(p.shape) for n, p in _Net().named_parameters()}
    for rank in range(2):
        for x in _xs(2, 10 + rank):  # each micro-batch's gradient on a fresh twin, summed in fp32 by hand
            twin = _Net()
            twin.loss(x, use_c=rank == 1).backward()
            for n, p in twin.named_parameters():
                if p.grad is not None:
                    want[n] += p.grad.float()
    want = {n: w / 2 for n, w in want.items()}
    for grads, name in got:
        assert name == "ShardedAdamW"
        for n, w in want.items():
            assert grads[n].dtype == torch.float32
            torch.testing.assert_close(grads[n], w, rtol=1e-6, atol=0), n
