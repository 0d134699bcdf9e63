"""What a generated "python" check may do: read the final workspace as data, never run what is in it.

A "python" check computes its verdict in the process it runs in. If that process ever runs code from the workspace
(imports a module the agent wrote, execs a file, starts `python solution.py`, unpickles a file), the agent's code
runs next to the verdict and can forge it: read the nonce from the stack and print a passing verdict from an
`atexit` hook. A check that needs to run workspace code must use the "calls" kind instead: the sandbox only reports
type-tagged return values and the host compares them with expected values that never enter the sandbox.

`problems(code)` reads the check's source statically (nothing is run) and names every construct that could run
workspace code or reach around these rules: an import outside a list of stdlib modules that read and parse data;
`exec`, `eval`, `compile`, `__import__`, `getattr` and friends; process spawning (`os.system`, `os.exec*`, …);
dunder attributes (`__class__`, `__globals__`, …) and frame access. The check's code is written by the environment's
author (a model or a person), not by the agent; this is a guard against a careless author, backed by the gate's
forgery probes.
"""

from __future__ import annotations

import ast

MAX_CODE_CHARS = 64 << 10

# stdlib modules that read, parse and compute on data; none of them imports or runs code found on disk
DATA_MODULES = frozenset({
    "ast", "base64", "binascii", "bisect", "calendar", "collections", "configparser", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib",
    "heapq", "html", "io", "ipaddress", "itertools", "json", "keyword", "math", "numbers", "operator", "os",
    "pathlib", "random", "re", "shlex", "statistics", "struct", "textwrap", "time", "tokenize", "tomllib",
    "typing", "unicodedata", "uuid", "zlib",
})
# builtins that run code, import it, or reach objects by a computed name
BANNED_NAMES = frozenset({
    "exec", "eval", "compile", "__import__", "breakpoint", "globals", "locals", "vars", "getattr", "setattr",
    "delattr", "help", "__builtins__", "__loader__", "__spec__",
})
# attributes that start processes, import or run code, or walk the stack (os.system, os.execv, runpy.run_path, …)
BANNED_ATTRS = frozenset({
    "system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "startfile", "import_module",
    "load_module", "exec_module", "run_path", "run_module", "attrgetter", "methodcaller", "get_field", "get_value",
    "vformat", "f_back", "f_locals",
    "f_globals", "f_code", "gi_frame", "cr_frame", "ag_frame", "tb_frame", "load_extension",
})
BANNED_ATTR_PREFIXES = ("exec", "spawn")


def _attr_problem(name: str) -> str | None:
    if name.startswith("__") and name.endswith("__"):
        return f"dunder attribute .{name}"
    if name in BANNED_ATTRS or name.startswith(BANNED_ATTR_PREFIXES):
        return f".{name} (runs or imports code)"
    return None


def problems(code: str) -> list[str]:
    """What in `code` could run workspace code; empty when the check only reads files as data."""
    if len(code) > MAX_CODE_CHARS:
        return [f"{len(code)} characters, more than {MAX_CODE_CHARS}"]
    try:
        tree = ast.parse(code, "<check>")
    except SyntaxError as e:
        return [f"does not parse: {e.msg} (line {e.lineno})"]
    except (ValueError, RecursionError, MemoryError) as e:  # NUL bytes, absurd nesting
        return [f"does not parse: {type(e).__name__}"]
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] not in DATA_MODULES]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level or mod.split(".")[0] not in DATA_MODULES:
                found.append(f"from {'.' * node.level}{mod} import ...")
            for a in node.names:
                why = "import *" if a.name == "*" else _attr_problem(a.name) or (
                    a.name if a.name in BANNED_NAMES else None)
                if why:
                    found.append(f"from {mod} import {a.name}: {why}")
        elif isinstance(node, ast.Name) and node.id in BANNED_NAMES:
            found.append(f"{node.id}()")
        elif isinstance(node, ast.Name) and node.id.startswith("__") and node.id != "__name__":
            found.append(f"dunder name {node.id}")
        elif isinstance(node, ast.Attribute) and (why := _attr_problem(node.attr)):
            found.append(why)
    return list(dict.fromkeys(found))


def check_python(name: str, code: str) -> None:
    """Raise ValueError naming what in check `name`'s code could run workspace code."""
    bad = problems(code)
    if bad:
        raise ValueError(
            f"check {name!r}: a 'python' check reads the workspace as data and never runs its code, but this one "
            f"uses {', '.join(bad[:5])}; a check that runs workspace code must be a 'calls' check (the sandbox "
            f"reports type-tagged return values, the host compares them)")
