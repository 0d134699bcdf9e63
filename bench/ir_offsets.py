"""Find 32-bit address arithmetic that can wrap, in a Triton kernel's TTIR, for the argument values of real launches.

A Triton kernel computes an element offset in the type of its operands: a program id is i32, an integer argument
below 2³¹ is specialised as i32, so `row * stride` is an i32 multiply even where the product passes 2³¹ and the
address wraps (the result is not wrong by a little: it points at some other row). `tt.addptr` then adds that i32
offset to a 64-bit pointer, so each offset must itself be exact.

`wrapping_offsets(ttir, values, grid, loaded)` propagates integer intervals through the kernel (argument values from
the launches, program ids from the grid, `tl.arange` bounds, constants; a loaded integer spans its type unless
`loaded` bounds what that pointer argument holds; loop-carried integers span their type) and reports every i32
add / subtract / multiply / shift / truncation in the operands of a `tt.addptr` whose exact result can leave
[−2³¹, 2³¹). The interval of an op is computed in exact arithmetic, so the first op that wraps is the one reported
(and those downstream of it too). What it cannot see: an offset computed in i64 and truncated by Triton itself,
pointers carried through loops. bench/triton_compile.py runs it on every kernel at GLM-5 shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

I32 = (-(2**31), 2**31 - 1)
_BITS = {"i1": 1, "i8": 8, "i16": 16, "i32": 32, "i64": 64}
_VAL = re.compile(r"%[\w.$-]+(?:#\d+)?")
_LOC_DEF = re.compile(r'^#(loc\d*) = loc\((.*)\)\s*$')
_ARITH = {"arith.addi", "arith.subi", "arith.muli", "arith.shli", "arith.trunci"}


@dataclass
class Finding:
    op: str  # e.g. "arith.muli"
    value: str  # the SSA name (Triton names it after the Python variable)
    where: str  # file:line of the Python source
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.where}: {self.op} {self.value} spans [{self.lo:,}, {self.hi:,}] in i32"


def _full(ty: str) -> tuple[int, int] | None:
    bits = _BITS.get(ty)
    if bits is None:
        return None
    return (0, 1) if bits == 1 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def _elem(ty: str) -> str:
    """The element type of `i32`, `tensor<16x1xi32>`, `tensor<16x!tt.ptr<bf16>>` ('ptr' for pointers)."""
    ty = ty.strip()
    if "!tt.ptr" in ty:
        return "ptr"
    m = re.match(r"tensor<(?:[\d?]+x)*([\w]+)(?:,.*)?>", ty)
    return m.group(1) if m else ty


def _shape(ty: str) -> list[int]:
    m = re.match(r"tensor<((?:\d+x)+)", ty.strip())
    return [int(x) for x in m.group(1).split("x")[:-1]] if m else []


def _split_types(s: str) -> list[str]:
    """Top-level comma split (types hold commas inside <...> and (...))."""
    out, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "<(["
        depth -= ch in ">)]"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _typed_names(s: str) -> list[tuple[str, str]]:
    """(name, type) of each `%name: type` in an argument list (types may nest <...>; a ` loc(...)` may follow)."""
    out = []
    for m in re.finditer(r"(%[\w.$-]+): ", s):
        i, depth, ty = m.end(), 0, ""
        while i < len(s):
            ch = s[i]
            if depth == 0 and (ch in ",)" or s.startswith(" loc(", i) or s.startswith(" {", i)):
                break
            depth += ch in "<("
            depth -= ch in ">)"
            ty += ch
            i += 1
        out.append((m.group(1), ty.strip()))
    return out


def _strip_loc(line: str) -> tuple[str, str | None]:
    i = line.rfind(" loc(")
    if i < 0:
        return line, None
    return line[:i], line[i + 5 : -1] if line.rstrip().endswith(")") else None


class _Locs:
    def __init__(self, ttir: str):
        self.defs = {}
        for line in ttir.splitlines():
            m = _LOC_DEF.match(line)
            if m:
                self.defs[m.group(1)] = m.group(2)

    def where(self, loc: str | None, depth: int = 0) -> str:
        if loc is None or depth > 20:
            return "?"
        loc = loc.strip()
        if loc.startswith("#"):
            return self.where(self.defs.get(loc[1:]), depth + 1)
        m = re.match(r'^"([^"]+)":(\d+):\d+', loc)
        if m:
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
        m = re.match(r"^callsite\((.*) at (.*)\)$", loc)
        if m:
            inner = self.where(m.group(1), depth + 1)
            return inner if inner != "?" else self.where(m.group(2), depth + 1)
        m = re.match(r'^"[^"]*"\((.*)\)$', loc)
        if m:
            return self.where(m.group(1), depth + 1)
        return "?"


def _interval(op: str, a, b):
    if a is None or b is None:
        return None
    if op == "arith.addi":
        return a[0] + b[0], a[1] + b[1]
    if op == "arith.subi":
        return a[0] - b[1], a[1] - b[0]
    if op == "arith.muli":
        c = [x * y for x in a for y in b]
        return min(c), max(c)
    if op == "arith.shli":
        if b[0] < 0 or b[1] > 63:
            return None
        c = [x << y for x in a for y in b]
        return min(c), max(c)
    return None


def wrapping_offsets(ttir: str, values: dict[str, tuple[int, int]], grid: tuple[int, ...],
                     loaded: dict[str, tuple[int, int]] | None = None) -> list[Finding]:
    """See the module docstring. `values`: each integer argument's [min, max] over the launches; `grid`: the largest
    grid; `loaded`: [min, max] of the integers a pointer argument holds (what `tl.load` through it can return)."""
    loaded = loaded or {}
    locs = _Locs(ttir)
    rng: dict[str, tuple[int, int] | None] = {}  # value → exact interval (None: unknown / not an integer)
    ety: dict[str, str] = {}  # value → element type
    base: dict[str, str] = {}  # pointer value → the pointer argument it derives from
    defs: dict[str, tuple[str, list[str], str | None]] = {}  # value → (op, integer operands, loc)
    addptr_offsets: list[str] = []
    pending: list[tuple[list[str], str, list[str]]] = []  # open tt.reduce / tt.scan: (results, kind, operands)
    lines = ttir.splitlines()
    for raw in lines:
        line, loc = _strip_loc(raw.strip())
        if line.startswith("tt.func"):
            for name, ty in _typed_names(raw):
                e = _elem(ty)
                ety[name] = e
                if e == "ptr":
                    base[name] = name[1:]
                elif name[1:] in values:
                    rng[name] = values[name[1:]]
                else:
                    rng[name] = _full(e)
            continue
        if line.startswith("})") and pending:  # the end of a reduce / scan region
            results, kind, operands = pending.pop()
            for r, o in zip(results, operands, strict=False):
                a = rng.get(o)
                n = max(_shape(line.split(":")[-1].split("->")[0]) or [1])
                if a is not None and kind == "arith.addi":
                    rng[r] = (min(a[0], 0) * n, max(a[1], 0) * n)
                elif a is not None and kind in ("arith.maxsi", "arith.minsi", "arith.cmpi", "arith.select"):
                    rng[r] = a
                else:
                    rng[r] = None
                ety[r] = ety.get(o, "?")
                defs[r] = ("reduce", [o], loc)
            continue
        if pending and pending[-1][1] is None:
            m = re.match(r"%[\w.$-]+ = (arith\.\w+)", line)
            if m:
                pending[-1] = (pending[-1][0], m.group(1), pending[-1][2])
        if line.startswith("scf.for "):  # a loop without results (no iter_args): its counter's span all the same
            line = "%__no_result = " + line
        m = re.match(r"^(%[\w.$-]+)(?::(\d+))? = (\"?[\w.]+\"?)\s*(.*)$", line)
        if not m:
            if line.startswith("^bb"):  # block arguments (loop bodies, combiners): their type's span
                for name, ty in _typed_names(raw):
                    ety[name], rng[name] = _elem(ty), _full(_elem(ty))
            continue
        res, nres, op, rest = m.group(1), m.group(2), m.group(3).strip('"'), m.group(4)
        results = [f"{res}#{i}" for i in range(int(nres))] if nres else [res]
        if op in ("tt.reduce", "tt.scan"):
            operands = _VAL.findall(rest.split("<{")[0])
            pending.append((results, None, operands))
            continue
        if op == "scf.for":
            fm = re.match(r"(%[\w.$-]+) = (%[\w.$#-]+) to (%[\w.$#-]+) step (%[\w.$#-]+)", rest)
            iters = re.findall(r"(%[\w.$-]+) = (%[\w.$#-]+)", rest.split("iter_args(")[-1]) if "iter_args(" in rest else []
            tail = rest.rsplit("->", 1)[-1].split("{")[0].rsplit(" : ", 1)[0].strip()
            tys = _split_types(tail.strip("()")) if "->" in rest else []
            ivty = rest.rsplit(":", 1)[-1].split("{")[0].strip()
            if fm:
                iv, lb, ub, st = fm.groups()
                lo, hi, s = rng.get(lb), rng.get(ub), rng.get(st)
                ety[iv] = _elem(ivty)
                rng[iv] = (lo[0], hi[1] - 1) if lo and hi and s and s[0] > 0 and hi[1] > lo[0] else (
                    (lo[0], lo[0]) if lo and hi and hi[1] <= lo[0] else _full(_elem(ivty)))
            for i, (name, _) in enumerate(iters):  # loop-carried: its type's span
                e = _elem(tys[i]) if i < len(tys) else "?"
                ety[name], rng[name] = e, _full(e)
            for i, r in enumerate(results):
                e = _elem(tys[i]) if i < len(tys) else "?"
                ety[r], rng[r] = e, _full(e)
            continue
        # the result type: after "->" where there is one, else after the last ":"
        sig = rest
        if op in ("scf.if", "scf.while", "scf.execute_region"):
            tys = _split_types(sig.rsplit("->", 1)[-1].split("{")[0].strip().strip("()")) if "->" in sig else []
            if op == "scf.while":  # the before-region's arguments: their type's span
                names = re.findall(r"(%[\w.$-]+) = (%[\w.$#-]+)", sig.split(")")[0])
                wtys = _split_types(sig.split(" : ", 1)[-1].split("->")[0].strip().strip("()"))
                for i, (name, _) in enumerate(names):
                    e = _elem(wtys[i]) if i < len(wtys) else "?"
                    ety[name], rng[name] = e, _full(e)
            for i, r in enumerate(results):
                e = _elem(tys[i]) if i < len(tys) else "?"
                ety[r], rng[r] = e, _full(e)
            continue
        rty = sig.rsplit("->", 1)[-1] if "->" in sig else sig.rsplit(" : ", 1)[-1]
        rty = rty.split(" to ")[-1]  # casts: `i32 to i64`
        e = _elem(_split_types(rty)[-1]) if rty.strip() else "?"
        if op == "tt.load":
            pm = re.search(r"ptr<(\w+)>", rty)
            e = pm.group(1) if pm else "?"
        elif op in ("arith.cmpi", "arith.cmpf"):
            e = "i1"
        elif op == "tt.addptr":
            e = "ptr"
        operands = _VAL.findall(sig.split(" : ")[0] if " : " in sig else sig)
        for r in results:
            ety[r] = e
        r0 = results[0]
        a = [rng.get(o) for o in operands]
        iv = None
        if op == "arith.constant":
            cm = re.match(r"(?:dense<)?(-?\d+)>? : ", sig)
            iv = (int(cm.group(1)),) * 2 if cm and e in _BITS else None
            if sig.startswith("true") or sig.startswith("dense<true>"):
                iv = (1, 1)
            elif sig.startswith("false") or sig.startswith("dense<false>"):
                iv = (0, 0)
        elif op == "tt.get_program_id":
            d = "xyz".index(sig.split()[0])
            iv = (0, (grid[d] if d < len(grid) else 1) - 1)
        elif op == "tt.get_num_programs":
            d = "xyz".index(sig.split()[0])
            iv = ((grid[d] if d < len(grid) else 1),) * 2
        elif op == "tt.make_range":
            mm = re.search(r"end = (-?\d+) : i32, start = (-?\d+)", sig)
            iv = (int(mm.group(2)), int(mm.group(1)) - 1) if mm else None
        elif op in ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.trans", "ttg.convert_layout",
                    "arith.extsi", "arith.index_cast", "arith.index_castui"):
            iv = a[0] if a else None
            if operands and operands[0] in base:
                base[r0] = base[operands[0]]
        elif op == "arith.extui":
            iv = a[0] if a and a[0] is not None and a[0][0] >= 0 else _full(ety.get(operands[0], "?"))
            if iv is not None and ety.get(operands[0]) == "i1":
                iv = (0, 1)
        elif op in _ARITH and op != "arith.trunci":
            iv = _interval(op, a[0], a[1]) if len(a) == 2 else None
        elif op == "arith.trunci":
            iv = a[0] if a else None
        elif op in ("arith.divsi", "arith.divui") and len(a) == 2 and a[0] and a[1] and a[1][0] > 0:
            c = [int(x / y) for x in a[0] for y in a[1]]
            iv = (min(c), max(c))
        elif op in ("arith.remsi", "arith.remui") and len(a) == 2 and a[0] and a[1] and a[1][0] > 0:
            m_ = a[1][1] - 1
            iv = (0 if a[0][0] >= 0 else max(a[0][0], -m_), min(a[0][1], m_) if a[0][1] >= 0 else 0)
        elif op in ("arith.minsi", "arith.maxsi") and len(a) == 2 and a[0] and a[1]:
            f = min if op == "arith.minsi" else max
            iv = (f(a[0][0], a[1][0]), f(a[0][1], a[1][1]))
        elif op == "arith.select" and len(a) == 3 and a[1] and a[2]:
            iv = (min(a[1][0], a[2][0]), max(a[1][1], a[2][1]))
        elif op == "arith.andi" and len(a) == 2 and a[0] and a[1] and (a[0][0] >= 0 or a[1][0] >= 0):
            iv = (0, min(x[1] for x in a if x[0] >= 0))
        elif op == "arith.cmpi":
            iv = (0, 1)
        elif op == "tt.addptr":
            if operands and operands[0] in base:
                base[r0] = base[operands[0]]
            if len(operands) > 1:
                addptr_offsets.append(operands[1])
        elif op == "tt.load":
            b = base.get(operands[0]) if operands else None
            iv = loaded.get(b) if b in loaded else None
        if iv is None and op not in ("tt.addptr",):
            iv = _full(e)
        for r in results:
            rng[r] = iv
        defs[r0] = (op, [o for o in operands if ety.get(o) in _BITS], loc)
    # the i32 arithmetic each addptr offset is computed from
    findings, seen, stack = [], set(), list(addptr_offsets)
    while stack:
        v = stack.pop()
        if v in seen or v not in defs:
            continue
        seen.add(v)
        op, operands, loc = defs[v]
        if op == "tt.load" or op == "reduce":
            continue
        if op in _ARITH and ety.get(v) == "i32":
            if op == "arith.trunci":
                iv = rng.get(operands[0]) if operands else None
            else:
                iv = _interval(op, *(rng.get(o) for o in operands[:2])) if len(operands) >= 2 else None
            if iv is None:
                iv = _full("i64") if op == "arith.trunci" else None
            if iv is not None and (iv[0] < I32[0] or iv[1] > I32[1]):
                findings.append(Finding(op, v, locs.where(loc), iv[0], iv[1]))
        stack.extend(operands)
    return sorted(findings, key=lambda f: (f.where, f.value))
