"""Keeping a tensor for the backward as a recipe instead of its values.

    with recomputed(t, lambda: make_t_again()):
        y = op(t)        # whatever `op` saves for its backward, `t` is saved as the recipe

`op`'s backward then calls the recipe (under `no_grad`) to get `t` back: the same ops on the same inputs give the same
bits, so the gradients are those of keeping it. Worth it where `t` is large and cheap to make from tensors that are
kept anyway: the sparse MLA's absorbed query (one small GEMM from the query), the MoE's rows sorted by expert (a
gather from the layer's input). A saved-tensors hook (`torch.autograd.graph.saved_tensors_hooks`) does the swap, for
`t` itself (by identity); every other tensor saved inside the `with` goes to the hooks that were active outside it
(a memory count's, say), as if this one were not there.

Inside `no_recipes()` nothing is swapped: activation checkpointing (model/transformer.py) keeps only each layer's
input and makes the rest again itself, and a recipe's closure would keep its inputs alive past the layer.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

_OFF = contextvars.ContextVar("temper_no_recipes", default=False)


@contextlib.contextmanager
def no_recipes() -> Iterator[None]:
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def _outer_hooks():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Recipe:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self.fn = fn


@contextlib.contextmanager
def recomputed(t: torch.Tensor, fn: Callable[[], torch.Tensor]) -> Iterator[None]:
    """See the module docstring. Nothing changes where no graph is built (nor in a compiled region: the engine's
    compiled decode step builds none, and dynamo cannot trace the ContextVar read)."""
    if torch.compiler.is_dynamo_compiling() or _OFF.get() or not (torch.is_grad_enabled() and t.requires_grad):
        yield
        return
    outer = _outer_hooks()

    def pack(x):
        if x is t:
            return _Recipe(fn)
        return outer[0](x) if outer else x

    def unpack(x):
        if isinstance(x, _Recipe):
            with torch.no_grad():
                return x.fn()
        return outer[1](x) if outer else x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
