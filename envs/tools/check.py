"""In-sandbox verifier step (stdlib only). Reads {"nonce", "kind", ...} as JSON on stdin and prints
`<nonce> ready` before anything else runs, then `<nonce> <json result>` as its last line. The nonce never
appears in argv, the environment or a file, so output printed by the code under test cannot pass for a
verdict line; a missing `ready` line means the sandbox itself failed (an infrastructure fault).

"calls" never judges: it imports the workspace's code, calls the named functions, and reports what came back
as plain, type-tagged data (`tag`). The expected values stay on the host, which compares them (type-strict).
Code under test runs in this process, so nothing it could forge here is trusted: it would have to produce the
expected values without ever seeing them, which is solving the task.

"python" runs generated check code (the environment's own verifier, never the agent's code) over a copy of
the final workspace; it reads files as data and emits {"pass", "detail"}."""

import json
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
        res = run_calls(req) if req["kind"] == "calls" else run_python(req)
    except BaseException as e:  # noqa: BLE001 - every failure is an observation, including SystemExit
        res = {"pass": False, "detail": f"check raised {type(e).__name__}: {e}"[:500],
               "trace": traceback.format_exc()[-1500:]}
    sys.stdout.flush()
    print(f"\n{nonce} {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main()
