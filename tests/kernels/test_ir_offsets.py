"""bench/ir_offsets.py on toy kernels compiled for sm_90 (no GPU): it reports the i32 multiply that wraps at the
launch's values and only there, follows loop counters and loaded indices, and is silent once the arithmetic is
64-bit. (bench/triton_compile.py runs it on every temper kernel at GLM-5's shapes: tests/kernels/test_gpu_bench.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from ir_offsets import wrapping_offsets  # noqa: E402


@triton.jit
def _narrow(x_ptr, y_ptr, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    tl.store(y_ptr + c, tl.load(x_ptr + row * stride + c))


@triton.jit
def _wide(x_ptr, y_ptr, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    tl.store(y_ptr + c, tl.load(x_ptr + row * stride + c))


@triton.jit
def _gathered(x_ptr, i_ptr, y_ptr, stride, K, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """A loaded row index times a stride, and a loop counter times a stride."""
    c = tl.arange(0, BLOCK)
    row = tl.load(i_ptr + tl.program_id(0))
    if WIDE:
        row = row.to(tl.int64)
    acc = tl.load(x_ptr + row * stride + c)
    for k in range(0, K, 4):
        acc += tl.load(y_ptr + k * stride + c)
    tl.store(y_ptr + c, acc)


@triton.jit
def _stores(x_ptr, y_ptr, stride, K, BLOCK: tl.constexpr):
    """A loop that carries no value (no iter_args in the IR): its counter times a stride."""
    c = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + c)
    for k in range(0, K, 4):
        tl.store(y_ptr + k * stride + c, v)


def _at(fn: str, snippet: str) -> str:
    """`test_ir_offsets.py:<line>` of the first line of toy kernel `fn` that holds `snippet` (how findings name it)."""
    lines = Path(__file__).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {fn}("))
    return f"test_ir_offsets.py:{next(i + 1 for i in range(start, len(lines)) if snippet in lines[i])}"


SIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "stride": "i32", "BLOCK": "constexpr"}
GSIG = {"x_ptr": "*fp32", "i_ptr": "*i32", "y_ptr": "*fp32", "stride": "i32", "K": "i32", "BLOCK": "constexpr",
        "WIDE": "constexpr"}
SSIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "stride": "i32", "K": "i32", "BLOCK": "constexpr"}
BUILDS = {"narrow": ("_narrow", SIG, {"BLOCK": 64}), "wide": ("_wide", SIG, {"BLOCK": 64}),
          "stores": ("_stores", SSIG, {"BLOCK": 16}),
          "gathered": ("_gathered", GSIG, {"BLOCK": 16, "WIDE": False}),
          "gathered_wide": ("_gathered", GSIG, {"BLOCK": 16, "WIDE": True})}


@pytest.fixture(scope="module")
def ttir(tmp_path_factory) -> dict[str, str]:
    """Each toy kernel's TTIR, compiled for sm_90 in a child process: this one imported Triton under
    TRITON_INTERPRET=1 (tests/conftest.py), where `@triton.jit` makes interpreter functions the compiler refuses."""
    out = tmp_path_factory.mktemp("ttir")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out / "cache")
    r = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return {name: (out / f"{name}.ttir").read_text() for name in BUILDS}


def test_reports_a_program_id_times_stride_that_wraps_and_only_where_it_does(ttir):
    narrow = ttir["narrow"]
    stride = {"stride": (6144, 6144)}
    found = wrapping_offsets(narrow, stride, (400_000,))  # 399,999 × 6144 > 2^31
    assert [(f.op, f.lo, f.hi) for f in found] == [("arith.muli", 0, 399_999 * 6144)]
    assert found[0].where == _at("_narrow", "row * stride")  # the load's line
    assert wrapping_offsets(narrow, stride, (300_000,)) == []  # 299,999 × 6144 < 2^31
    assert wrapping_offsets(ttir["wide"], stride, (400_000,)) == []


def test_follows_loaded_indices_and_loop_counters(ttir):
    narrow = ttir["gathered"]
    small = {"stride": (1024, 1024), "K": (64, 64)}
    # a loaded i32 row can be anything its type holds, unless told what the index tensor holds
    assert [f.where for f in wrapping_offsets(narrow, small, (8,))] == [_at("_gathered", "row * stride")]
    assert wrapping_offsets(narrow, small, (8,), loaded={"i_ptr": (0, 1000)}) == []
    # the loop counter k runs to K − 1 (the bound ignores the step): 2,999,999 × 1024 wraps
    big_k = wrapping_offsets(narrow, {"stride": (1024, 1024), "K": (3_000_000, 3_000_000)}, (8,),
                             loaded={"i_ptr": (0, 1000)})
    assert [(f.where, f.hi) for f in big_k] == [(_at("_gathered", "k * stride"), (3_000_000 - 1) * 1024)]
    assert wrapping_offsets(ttir["gathered_wide"], small, (8,)) == []


def test_follows_the_counter_of_a_loop_that_carries_no_value(ttir):
    """`scf.for` without results (a loop of stores only): its counter is bounded by the loop, not its type's span."""
    assert wrapping_offsets(ttir["stores"], {"stride": (1024, 1024), "K": (64, 64)}, (1,)) == []
    big = wrapping_offsets(ttir["stores"], {"stride": (1024, 1024), "K": (3_000_000, 3_000_000)}, (1,))
    assert [(f.where, f.hi) for f in big] == [(_at("_stores", "k * stride"), (3_000_000 - 1) * 1024)]


if __name__ == "__main__":  # the child process of the `ttir` fixture: compile each toy kernel, write its TTIR
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    for name, (fn, sig, const) in BUILDS.items():
        k = triton_compile(ASTSource(fn=globals()[fn], signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
        Path(sys.argv[1], f"{name}.ttir").write_text(k.asm["ttir"])
