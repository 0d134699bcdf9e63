"""In-sandbox verifier step (stdlib only). Reads {"nonce", "kind", ...} as JSON on stdin and prints
`<nonce> ready` before anything else runs, then `<nonce> <json result>` as its last line. The nonce never
appears in argv, the environment or a file, so output printed by the code under test cannot pass for a
verdict line; a missing `ready` line means the sandbox itself failed (an infrastructure fault).

"calls" never judges: it imports the workspace's code, calls the named functions, and reports what came back
as plain, type-tagged data (`tag`). The expected values stay on the host, which compares them (type-strict).
Code under test runs in this process, so nothing it could forge here is trusted: it would have to produce the
expected values without ever seeing them, which is solving the task.

"python" runs generated check code (the environment's own verifier, never the agent's code) over a copy of
the final workspace; it reads files as data and emits {"pass", "detail"}.

The copy is made here, inside the sandbox, after the `ready` line: the agent's workspace is mounted read-only at
req["src"] and copied into the current directory (a sized tmpfs on the host), so the host never walks a tree the
agent made. The walk is iterative (no depth limit to overflow), links are copied as links (never followed), holes
in sparse files stay holes, and a special file (FIFO, socket, device) is refused: {"refused": why}. Whatever goes
wrong here went wrong with what the agent left behind: a failure, never an infrastructure fault."""

import json
import os
import stat
import sys
import traceback

MAX_ITEMS = 10_000


def tag(v, _depth=0, _count=None):
    """`v` as JSON-able, type-tagged plain data. Only exact built-in types are data (a subclass of int with an
    `__eq__` that always says yes is "other"); anything else is ["other", its type name]."""
    count = [0] if _count is None else _count
    count[0] += 1
    if _depth > 32 or count[0] > MAX_ITEMS:
        raise ValueError("value too deep or too large to report")
    t = type(v)
    if v is None:
        return ["none"]
    if t is bool:
        return ["bool", v]
    if t is int:
        return ["int", str(v)]
    if t is float:
        return ["float", repr(v)]
    if t is str:
        return ["str", v]
    if t is list or t is tuple:
        return [t.__name__, [tag(x, _depth + 1, count) for x in v]]
    if t is dict:
        items = [[tag(k, _depth + 1, count), tag(x, _depth + 1, count)] for k, x in v.items()]
        return ["dict", sorted(items, key=lambda kv: json.dumps(kv[0]))]
    return ["other", f"{t.__module__}.{t.__qualname__}"]


class Refused(Exception):
    pass


def copy_file(src, dst, size):
    """Copy a regular file's data extents only (SEEK_DATA / SEEK_HOLE): a sparse file stays sparse."""
    fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fi, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(fi, start, os.SEEK_HOLE)
            os.lseek(fi, start, os.SEEK_SET)
            os.lseek(fo, start, os.SEEK_SET)
            left = end - start
            while left > 0:
                chunk = os.read(fi, min(left, 1 << 20))
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fo, view):]
                left -= len(chunk)
            pos = end
        os.ftruncate(fo, size)
    finally:
        os.close(fi)
        os.close(fo)


def copy_tree(src, dst, max_entries=16_384):
    """The agent's workspace `src` into the empty directory `dst`, walked with a stack (see the module docstring)."""
    todo, n = [""], 0
    while todo:
        rel = todo.pop()
        with os.scandir(os.path.join(src, rel) if rel else src) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            n += 1
            if n > max_entries:
                raise Refused(f"the workspace holds more than {max_entries} entries")
            r = os.path.join(rel, e.name) if rel else e.name
            st = e.stat(follow_symlinks=False)
            to = os.path.join(dst, r)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(e.path), to)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir(to, 0o777)
                todo.append(r)
            elif stat.S_ISREG(st.st_mode):
                copy_file(e.path, to, st.st_size)
            else:
                kind = "FIFO" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
                raise Refused(f"{os.fsencode(r).decode('utf-8', 'backslashreplace')} is a {kind}")


def run_calls(req):
    import importlib

    sys.path.insert(0, req["work"])
    out = []
    for c in req["calls"]:
        try:
            fn = getattr(importlib.import_module(c["module"]), c["fn"])
            out.append({"value": tag(fn(*c["args"]))})
        except BaseException as e:  # noqa: BLE001 - whatever the code under test raised is an observation
            out.append({"raised": type(e).__name__})
    return {"observations": out}


def run_python(req):
    ns = {"__name__": "__check__"}
    lines = []

    def emit(obj):
        lines.append(obj)

    ns["emit"] = emit
    exec(compile(req["code"], "<check>", "exec"), ns)  # generated check code, already inside the sandbox
    if not lines:
        return {"pass": False, "detail": "check emitted no verdict"}
    v = lines[-1]
    return {"pass": bool(v.get("pass")), "detail": str(v.get("detail", ""))[:500]}


def main():
    req = json.loads(sys.stdin.readline())
    nonce = req.pop("nonce")
    print(f"\n{nonce} ready", flush=True)
    try:
        if req.get("src") is not None:
            os.umask(0)
            copy_tree(req["src"], ".")
        res = run_calls(req) if req["kind"] == "calls" else run_python(req)
    except Refused as e:
        res = {"refused": str(e)[:500]}
    except BaseException as e:  # noqa: BLE001 - every failure is an observation, including SystemExit
        res = {"pass": False, "detail": f"check raised {type(e).__name__}: {e}"[:500],
               "trace": traceback.format_exc()[-1500:]}
    sys.stdout.flush()
    print(f"\n{nonce} {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main()
