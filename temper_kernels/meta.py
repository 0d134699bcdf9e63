"""The CUDA path without a GPU: run a model on the `meta` device (shapes, no data) with every op on its Triton branch
and every Triton kernel replaced by a launch that records itself and checks its grid and arguments.

    with on_meta() as launched:
        model(ids_on_meta)           # the Python of the CUDA path runs; no kernel does
    launched                         # the kernels it would have launched, in order

What this shows on a CPU machine: the CUDA path's own code reads no device data (a meta tensor has none, so
`.item()`, `nonzero()`, `bool(t)`, `bincount` raise), computes every grid from host values, and passes only device
tensors to kernels; and how many kernels and aten ops a step issues (bench/decode_ops.py). It shows nothing about
the kernels' numbers (TRITON_INTERPRET=1 tests those) or speed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class FakeLaunch:
    """Stands in for a Triton kernel: `kernel[grid](*args)` records the kernel's name after checking that the grid
    is host ints and that every tensor argument is on the meta device."""

    def __init__(self, name: str, launched: list[str]):
        self.name, self.launched = name, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            dims = grid if isinstance(grid, tuple) else ()
            if not all(type(g) is int for g in dims):
                raise AssertionError(f"{self.name}: grid {grid} is not host ints")
            devices = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            if not devices <= {"meta"}:
                raise AssertionError(f"{self.name}: tensor arguments on {sorted(devices)}, not the device")
            self.launched.append(self.name)
        return launch


@contextlib.contextmanager
def on_meta() -> Iterator[list[str]]:
    """Every temper kernel op takes its Triton branch and launches a `FakeLaunch`; restored on exit. Yields the list
    the launches append their kernel names to."""
    import triton.runtime

    import temper_kernels as tk

    from . import act, indexer, mla, moe, norm, rotary

    launched: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def patch(mod, name, value):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    try:
        for mod in (tk, act, indexer, mla, moe, norm, rotary):
            patch(mod, "backend", lambda *tensors: "triton")
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, triton.runtime.KernelInterface):
                    patch(mod, name, FakeLaunch(name, launched))
        # as on a Hopper GPU: `torch._grouped_mm` in bf16 (it has a meta kernel), else the Triton grouped GEMM and its
        # device-built schedule
        patch(moe, "_torch_grouped_ok", lambda xs, w: hasattr(torch, "_grouped_mm") and xs.dtype == w.dtype ==
              torch.bfloat16)
        yield launched
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)
