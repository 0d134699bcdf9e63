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
    is host ints and that every tensor argument is on the meta device. With `compile_for` (a Triton `GPUTarget`) it
    also compiles the kernel for that GPU, once per specialisation (argument dtypes and constexpr values), ahead of
    time and without one (Triton's own compiler and ptxas): `compiled` maps each specialisation to {"error": None or
    the compiler's message, "shared": the shared memory it needs per block, in bytes, "regs" / "stack" / "local":
    registers, stack-frame bytes (where ptxas puts spilled registers) and local-memory bytes per thread (cuobjdump's
    resource usage; None where it is not at hand), "ttir": the kernel's Triton IR}, each launch specialised as
    `triton.jit` specialises it (`_specialise`). With `launches` (a list) each launch appends {"key": its
    specialisation, "grid", "ints": its integer arguments by name} (bench/ir_offsets.py reads the arithmetic for those
    values)."""

    def __init__(self, name: str, launched: list[str], fn=None, compile_for=None, compiled: dict | None = None,
                 originals=None, launches: list | None = None):
        self.name, self.launched = name, launched
        self.fn, self.compile_for, self.compiled = fn, compile_for, compiled
        self.originals = originals  # a context in which the modules hold their real kernels (and jitted helpers)
        self.launches = launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            dims = grid if isinstance(grid, tuple) else ()
            if not all(type(g) is int for g in dims):
                raise AssertionError(f"{self.name}: grid {grid} is not host ints")
            devices = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            if not devices <= {"meta"}:
                raise AssertionError(f"{self.name}: tensor arguments on {sorted(devices)}, not the device")
            self.launched.append(self.name)
            if self.compile_for is not None:
                key = self._compile(args, kwargs)
                if self.launches is not None:
                    ints = {n: v for n, v in zip(self.fn.arg_names, args, strict=False) if type(v) is int}
                    ints |= {n: v for n, v in kwargs.items() if type(v) is int}
                    self.launches.append({"key": key, "grid": tuple(dims), "ints": ints})
        return launch

    def _compile(self, args, kwargs) -> tuple:
        from triton.compiler import ASTSource
        from triton.compiler import compile as triton_compile

        launch = ("num_warps", "num_stages", "num_ctas")
        options = {k: v for k, v in kwargs.items() if k in launch}
        kwargs = {k: v for k, v in kwargs.items() if k not in launch}
        values = dict(zip(self.fn.arg_names, args, strict=False)) | kwargs
        signature, constexprs, attrs = _specialise(self.fn, values, self.compile_for)
        key = (self.name, tuple(sorted(signature.items())), tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
               tuple(sorted(options.items())), tuple(sorted((k, repr(v)) for k, v in attrs.items())))
        if key in self.compiled:
            return key
        try:
            with self.originals():  # the kernel's jitted helpers (`_query`, ...) resolve to themselves, not fakes
                src = ASTSource(fn=self.fn, signature=signature, constexprs=constexprs, attrs=attrs)
                k = triton_compile(src, target=self.compile_for, options=options)
            self.compiled[key] = {"error": None, "shared": k.metadata.shared, "ttir": k.asm.get("ttir"),
                                  **_resources(k.asm.get("cubin"))}
        except Exception as e:  # the compiler's message, for the report
            self.compiled[key] = {"error": f"{type(e).__name__}: {e}", "shared": None, "ttir": None, "regs": None,
                                  "stack": None, "local": None}
        return key


def _resources(cubin: bytes | None) -> dict:
    """{"regs", "stack", "local"} of a cubin's kernel from Triton's bundled `cuobjdump -res-usage` (None where
    unavailable). Spilled registers show as STACK bytes (ptxas's stack frame), not LOCAL."""
    import os
    import re
    import subprocess
    import tempfile

    try:
        import triton

        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+).*?LOCAL:(\d+)", out)
        return {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(3))}
    except Exception:
        return {"regs": None, "stack": None, "local": None}


def _specialise(fn, values: dict, target) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as `triton.jit` makes them at a launch with these argument values: constexpr
    parameters by value, an integer argument equal to 1 folded in as a constant, pointers (a meta tensor's address
    is 0: aligned, as real allocations are) and integers divisible by 16 marked `tt.divisibility = 16` (what lets
    the compiler vectorise loads and turn them into asynchronous copies), honouring `do_not_specialize`."""
    signature, constexprs, attrs = {}, {}, {}
    try:
        from triton.backends.compiler import BaseBackend
        from triton.compiler import make_backend
        from triton.runtime.jit import native_specialize_impl

        backend = make_backend(target)
    except Exception:  # an older Triton: plain types, no specialisation
        native_specialize_impl = None
    for i, p in enumerate(fn.params):
        v = values.get(p.name)
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
            continue
        if native_specialize_impl is None:
            signature[p.name] = _triton_type(v)
            continue
        ty, spec = native_specialize_impl(BaseBackend, v, p.is_const, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[p.name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = backend.parse_attr(spec)
    return signature, constexprs, attrs


_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
                  torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
                  torch.float8_e4m3fn: "fp8e4nv"}


def _triton_type(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + _TRITON_DTYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(v).__name__}")


@contextlib.contextmanager
def on_meta(compile_for=None, compiled: dict | None = None, launches: list | None = None) -> Iterator[list[str]]:
    """Every temper kernel op takes its Triton branch and launches a `FakeLaunch`; restored on exit. Yields the list
    the launches append their kernel names to. `compile_for`, `compiled`, `launches`: see `FakeLaunch`."""
    import triton.runtime

    import temper_kernels as tk

    from . import act, indexer, mla, moe, norm, rotary

    launched: list[str] = []
    saved: list[tuple[object, str, object]] = []

    def patch(mod, name, value):
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)

    @contextlib.contextmanager
    def originals():
        now = [(mod, name, getattr(mod, name)) for mod, name, _ in saved]
        for mod, name, value in saved:
            setattr(mod, name, value)
        try:
            yield
        finally:
            for mod, name, value in now:
                setattr(mod, name, value)

    try:
        for mod in (tk, act, indexer, mla, moe, norm, rotary):
            patch(mod, "backend", lambda *tensors: "triton")
            for name, obj in list(vars(mod).items()):
                if isinstance(obj, triton.runtime.KernelInterface):
                    patch(mod, name, FakeLaunch(name, launched, obj, compile_for, compiled if compiled is not None
                                                else {}, originals, launches))
        # as on a Hopper GPU: `torch._grouped_mm` in bf16 (it has a meta kernel), else the Triton grouped GEMM and its
        # device-built schedule
        patch(moe, "_torch_grouped_ok", lambda xs, w: hasattr(torch, "_grouped_mm") and xs.dtype == w.dtype ==
              torch.bfloat16)
        patch(indexer, "fp8_dot_supported", lambda device: True)  # e4m3 dots on tensor cores, as on a Hopper
        yield launched
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)
