"""In-sandbox tool runner (stdlib only). Reads {"tool": ..., "args": {...}} as JSON on stdin, acts on
the workspace (the current directory), prints the observation. Exit code 0 = the tool ran, 2 = a
usage error the agent should read. Paths may not leave the workspace."""

import ast
import json
import operator
import os
import sys

ROOT = os.path.realpath(os.getcwd())
MAX_READ = 16000


def _path(p):
    full = os.path.realpath(os.path.join(ROOT, p))
    if full != ROOT and not full.startswith(ROOT + os.sep):
        raise UsageError(f"path {p!r} is outside the workspace")
    return full


class UsageError(Exception):
    pass


def t_ls(args):
    base = _path(args.get("path") or ".")
    if not os.path.isdir(base):
        raise UsageError(f"{args.get('path')}: not a directory")
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, base)
        for f in sorted(filenames):
            out.append(f if rel == "." else os.path.join(rel, f))
        if len(out) > 500:
            break
    return "\n".join(out)


def t_read(args):
    p = _path(args["path"])
    if not os.path.isfile(p):
        raise UsageError(f"{args['path']}: no such file")
    with open(p, encoding="utf-8", errors="replace") as f:
        text = f.read(MAX_READ + 1)
    return text if len(text) <= MAX_READ else text[:MAX_READ] + "\n[truncated]"


def t_write(args):
    p = _path(args["path"])
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        f.write(args.get("content", ""))
    return f"wrote {len(args.get('content', ''))} chars to {args['path']}"


def t_replace(args):
    p = _path(args["path"])
    if not os.path.isfile(p):
        raise UsageError(f"{args['path']}: no such file")
    with open(p, encoding="utf-8") as f:
        text = f.read()
    old, new = args["old"], args["new"]
    n = text.count(old)
    if n == 0:
        raise UsageError(f"{old!r} not found in {args['path']}")
    if n > 1:
        raise UsageError(f"{old!r} occurs {n} times in {args['path']}; give more context")
    with open(p, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new))
    return f"replaced 1 occurrence in {args['path']}"


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
            raise UsageError("exponent too large")
        return _OPS[type(node.op)](a, b)
    raise UsageError("calc accepts numbers, + - * / // % ** and parentheses")


def t_calc(args):
    expr = args["expr"]
    if len(expr) > 200:
        raise UsageError("expression too long")
    try:
        v = _eval(ast.parse(expr, mode="eval"))
    except SyntaxError:
        raise UsageError(f"cannot parse {expr!r}") from None
    except ZeroDivisionError:
        raise UsageError("division by zero") from None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(round(v, 6) if isinstance(v, float) else v)


TOOLS = {"ls": t_ls, "read": t_read, "write": t_write, "replace": t_replace, "calc": t_calc}


def answer(req):
    """(exit code, observation) of one request: 0 the tool ran, 2 a usage error the agent should read."""
    try:
        return 0, TOOLS[req["tool"]](req.get("args", {}))
    except UsageError as e:
        return 2, f"error: {e}"
    except OSError as e:
        return 2, f"error: {e.strerror or e}"


def main():
    code, text = answer(json.loads(sys.stdin.read()))
    print(text, end="")
    sys.exit(code)


def serve(cap):
    """A tool session: one request per line on stdin, one reply per line on stdout ({"rc", "out", "truncated"}; rc 1
    with the error's last lines where the tool raised), until stdin closes. Each request is answered as `main`
    answers it, its observation cut at `cap` bytes as the host cuts a one-shot run's output."""
    import traceback

    for line in sys.stdin:
        try:
            rc, out = answer(json.loads(line))
            raw = out.encode("utf-8")  # what a one-shot run's print cannot write (a lone surrogate) fails here too
        except Exception:  # noqa: BLE001 - reported as a one-shot run's traceback would be: the tool failed
            rc, out = 1, traceback.format_exc()[-1000:]
            raw = out.encode("utf-8", "replace")
        reply = {"rc": rc, "out": raw[:cap].decode("utf-8", "replace"), "truncated": len(raw) > cap}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]))
    else:
        main()
