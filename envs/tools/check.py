"""In-sandbox verifier check runner (stdlib + pytest). Reads {"nonce", "kind", ...} as JSON on stdin and
prints `<nonce> <json result>` as its last line. The nonce never appears in argv, the environment or a
file, so output printed by the code under test cannot pass for a verdict."""

import json
import sys
import traceback


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


def run_pytest(req):
    sys.path.append(req["site"])
    sys.path.append(req["work"])
    import pytest

    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}

    class Count:
        def pytest_runtest_logreport(self, report):
            if report.when == "call":
                counts[report.outcome] = counts.get(report.outcome, 0) + 1
            elif report.outcome == "failed":
                counts["error"] += 1
            elif report.outcome == "skipped":
                counts["skipped"] += 1

    args = [req["tests"], "-q", "-p", "no:cacheprovider", "--rootdir", req["tests"], "-o", "addopts=",
            "-o", "python_files=test_*.py", "--noconftest"]
    rc = pytest.main(args, plugins=[Count()])
    want = req["expect_passed"]
    ok = rc == 0 and counts["passed"] == want and counts["failed"] == 0 and counts["error"] == 0
    return {"pass": ok, "detail": f"exit {int(rc)}, passed {counts['passed']}/{want}, failed {counts['failed']}, "
                                  f"errors {counts['error']}, skipped {counts['skipped']}"}


def main():
    req = json.loads(sys.stdin.readline())
    nonce = req.pop("nonce")
    try:
        res = run_pytest(req) if req["kind"] == "pytest" else run_python(req)
    except BaseException as e:  # noqa: BLE001 - every failure is a verdict, including SystemExit
        res = {"pass": False, "crashed": True, "detail": f"check raised {type(e).__name__}: {e}"[:500],
               "trace": traceback.format_exc()[-1500:]}
    sys.stdout.flush()
    print(f"\n{nonce} {json.dumps(res)}", flush=True)


if __name__ == "__main__":
    main()
