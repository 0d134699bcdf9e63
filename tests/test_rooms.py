"""Rooms of one size, and no import circles (DESIGN: no file over 600 lines).

Every tracked Python file has at most 600 lines. The project's modules import each other without a circle: the import
graph (every `import` and `from … import`, at module level or inside a function, each resolved to the project module it
names) has no strongly connected component of two or more modules. Two kinds of edge are not counted: imports under
`if TYPE_CHECKING:` (never run), and a module's import of its own package (`from . import name` of a name the
package's `__init__` defines: Python runs the package first whatever the order).
"""

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if (ROOT / f).exists()]


def _module(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts and parts[0] == "bench":  # the benches import each other by bare name (bench/ is on their sys.path)
        parts = parts[1:]
    return ".".join(parts)


def _imports(tree: ast.Module):
    """Every import node outside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skip]


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module → the project modules it imports (`files`: module → path)."""
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.endswith("__init__.py")
        for node in _imports(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".")[: len(mod.split(".")) - (0 if is_pkg else 1)]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and not mod.startswith(name + "."):  # not its own package
                    graph[mod].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_file_over_600_lines():
    long = {f: n for f in _tracked() if (n := len((ROOT / f).read_text().splitlines())) > 600}
    assert long == {}


def test_the_circle_finder_finds_a_circle_and_passes_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    files = {_module(f): f for f in _tracked() if not f.startswith(("tests/", "docs/"))}
    graph = import_graph(files)
    assert "assets.keys" in graph["assets.launch"] and "rollout.engine" in graph["rollout.server"]  # it sees imports
    assert circles(graph) == []
