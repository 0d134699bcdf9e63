"""Verdicts no agent can forge: the sandbox reports what the code under test returned as plain data, the host
compares it with expected values that never entered the sandbox, type-strictly; pinned files are checked without
following links; special files are refused; only a sandbox that failed to start is an infrastructure fault.

Each forging attempt below leaves the bugs in place (the agent does not solve the task) and tries to earn the
reward anyway. Every one must end at reward 0 with status "ok" (a failure the trainer learns from), never
"crashed" (which trainers drop, so a failing policy could hide behind it)."""

import json

import pytest

from envs import FAMILIES, Action, run_script
from envs.environment import VERIFY_ATTEMPTS
from envs.gate import FORGERIES, PROBES, validate
from envs.tools.check import tag


def _w(path, content):
    return Action("write", {"path": path, "content": content}).render()


def _py(code):
    return Action("python", {"code": code}).render()


DONE = Action("done", {}).render()

@pytest.fixture(scope="module")
def fixbug():
    return FAMILIES["fix-bug"].make(0)


def test_the_oracle_earns_the_reward(sandbox, fixbug):
    r, _, _ = run_script(fixbug, sandbox, fixbug.reference)
    assert r.reward == 1.0 and r.status == "ok", r.checks
    calls = [c for c in fixbug.verifier.checks if c.kind == "calls"][0]
    assert calls.returns  # the expected values are in the spec, on the host: never in the sandbox request


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdicts_earn_nothing_and_are_failures_not_crashes(sandbox, fixbug, name):
    pkgs = sorted({p.split("/")[0] for p in fixbug.files if p.endswith("__init__.py")})
    acts = [_w(f"{p}/__init__.py", FORGERIES[name]) for p in pkgs] + [DONE]
    r, _, _ = run_script(fixbug, sandbox, acts)
    assert r.reward == 0.0 and r.status == "ok" and r.attempts == 1, (name, r.checks)


def test_the_gate_probes_every_hole_class(sandbox, fixbug):
    """Each forging class is a gate probe for the families that run code; a verifier that fell for one would be
    rejected. The real fix-bug verifier falls for none."""
    for name in [*FORGERIES, "fifo", "symlink-tests"]:
        assert f"forge:{name}" in PROBES or name in PROBES
    rep = validate(fixbug, sandbox)
    assert rep.accepted, rep.reasons
    ran = {n for n, p in rep.probes.items() if p["applicable"]}
    assert {f"forge:{n}" for n in FORGERIES} | {"fifo", "symlink-tests"} <= ran
    assert all(rep.probes[n]["reward"] == 0.0 and rep.probes[n]["status"] == "ok" for n in ran)


def test_symlinked_tests_are_not_untouched(sandbox, fixbug):
    """Visible tests replaced by links to unchanged copies fail the pin: links are never followed."""
    tests = [p for p in fixbug.files if p.startswith("tests/")]
    code = "import os, shutil\n" + "".join(
        f"shutil.copy({p!r}, {p + '.orig'!r}); os.remove({p!r}); os.symlink({p.rsplit('/', 1)[-1] + '.orig'!r}, {p!r})\n"
        for p in tests)
    r, _, obs = run_script(fixbug, sandbox, fixbug.reference + [_py(code)])
    pin = [c for c in r.checks if c.name == "tests untouched"][0]
    assert r.reward == 0.0 and r.status == "ok" and not pin.passed and "not a regular file" in pin.detail, obs


def test_a_fifo_in_the_workspace_is_refused_not_a_hang_or_crash(sandbox, fixbug):
    r, _, _ = run_script(fixbug, sandbox, fixbug.reference + [_py("import os\nos.mkfifo('pipe')")])
    assert r.reward == 0.0 and r.status == "ok"
    assert any("refused: pipe is a FIFO" in c.detail for c in r.checks), r.checks


def test_set_const_check_reads_files_as_data(sandbox):
    """A module named like the stdlib one the check imports, planted in the workspace, is never imported."""
    spec = FAMILIES["set-const"].make(2)
    r, _, _ = run_script(spec, sandbox, [_w("ast.py", "import os\nos._exit(0)\n"), _w("json.py", "x = 1\n")]
                         + spec.reference)
    assert r.reward == 1.0 and r.status == "ok"


class _FlakySandbox:
    """A sandbox whose first `fail` runs die before anything starts (exit 127, no output): infrastructure."""

    def __init__(self, inner, fail):
        self.inner, self.fail, self.runs = inner, fail, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, argv, workspace, stdin=None, **kw):
        if stdin and '"nonce"' in stdin:  # a verifier step, not a tool call
            self.runs += 1
            if self.runs <= self.fail:
                from envs.sandbox import RunResult
                return RunResult(127, "", "bwrap: setting up uid map: Permission denied", False, False, 0.0)
        return self.inner.run(argv, workspace, stdin=stdin, **kw)


@pytest.mark.parametrize("fail", [2, 99])
def test_infrastructure_faults_are_retried_then_crashed(sandbox, fixbug, fail):
    sb = _FlakySandbox(sandbox, fail)
    r, _, _ = run_script(fixbug, sb, fixbug.reference)
    if fail < VERIFY_ATTEMPTS:
        assert r.reward == 1.0 and r.status == "ok" and r.attempts == fail + 1
    else:
        assert r.reward == 0.0 and r.status == "crashed" and r.attempts == VERIFY_ATTEMPTS
        assert "did not start" in r.checks[0].detail


def test_tag_is_type_strict():
    class Liar(int):
        def __eq__(self, o):
            return True

    assert tag(3) != tag(3.0) and tag(True) != tag(1) and tag(0) != tag(False) and tag("1") != tag(1)
    assert tag(Liar(3))[0] == "other" and tag(Liar(3)) != tag(3)
    assert tag((1, 2)) != tag([1, 2]) and tag([[1, 2], [3]]) == tag([[1, 2], [3]])
    assert tag({"a": 1, "b": [2.5]}) == tag({"b": [2.5], "a": 1})  # dicts compare as dicts: order does not matter
    assert tag(float("nan")) == ["float", "nan"] and json.loads(json.dumps(tag({1: None}))) == tag({1: None})
    with pytest.raises(ValueError):
        tag(list(range(20_000)))
