"""`temper_kernels.recomputed`: a tensor kept for the backward as a recipe, made again there, the gradients those of
keeping it; the other saved tensors go to the hooks outside; nothing changes inside `no_recipes()`."""

import torch

from temper_kernels.memory import no_recipes, recomputed


def _setup():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 5, generator=g, requires_grad=True)
    w = torch.randn(4, 5, generator=g, requires_grad=True)
    return a, w


def _grads(use_recipe: bool, outer: list | None = None, off: bool = False):
    a, w = _setup()
    made = []

    def again():
        made.append(1)
        return a.detach().exp()

    t = a.exp()
    ctx = recomputed(t, again) if use_recipe else torch.enable_grad()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda x: outer.append(x) or x, lambda x: x) \
        if outer is not None else torch.enable_grad()
    with hooks, no_recipes() if off else torch.enable_grad(), ctx:
        y = (t * w).sum()  # the multiply saves t (for w's gradient) and w (for t's)
    y.backward()
    return a.grad, w.grad, len(made)


def test_a_recipe_is_made_again_once_and_gives_the_same_gradients():
    ga, gw, made = _grads(False)
    ra, rw, made_r = _grads(True)
    assert made == 0 and made_r == 1
    assert torch.equal(ga, ra) and torch.equal(gw, rw)


def test_the_other_saved_tensors_go_to_the_outer_hooks_and_the_recipe_does_not():
    outer: list[torch.Tensor] = []
    _grads(True, outer)
    assert len(outer) == 1 and outer[0].is_leaf and outer[0].requires_grad  # w: the multiply's other operand
    plain: list[torch.Tensor] = []
    _grads(False, plain)
    assert len(plain) == 2  # without the recipe the outer hook is handed t too


def test_no_recipes_saves_the_tensor_itself():
    ga, gw, _ = _grads(False)
    ra, rw, made = _grads(True, off=True)
    assert made == 0 and torch.equal(ga, ra) and torch.equal(gw, rw)
