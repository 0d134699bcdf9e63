"""Generated environments are data until proven safe: every path in a spec is checked before anything is written,
a "python" check never runs workspace code (that needs a "calls" check), the gate forges verdicts from a plain
module whatever the layout, a verifier that matches text falls to the wrong-answer leg, and set-const wants the
exact integer. Each test is an attack that must fail."""

import secrets
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from envs import FAMILIES, Action, Check, TaskSpec, Verifier, run_script
from envs import gate as gate_mod
from envs.families.base import wrong_text
from envs.gate import PROBE_LIMITS, PROBES, validate
from envs.generator import generate

BAD_PATHS = {
    "../escape.txt": "'..'", "a/../../b": "'..'", "/etc/cron.d/x": "absolute", "a//b": "empty component",
    "a/./b": "'.' component", "a\\..\\b": "backslash", "a\x00b": "NUL or control", "a\nb": "NUL or control",
    "": "empty", "x" * 300: "300 characters", "/".join("d" * 17): "17 components", "a/": "empty component",
    "\udc80": "UTF-8",
}


@pytest.mark.parametrize("path", sorted(BAD_PATHS))
def test_a_spec_with_an_unsafe_path_is_rejected_naming_it(path):
    base = FAMILIES["fix-bug"].make(0)
    fields = base.model_dump()
    with pytest.raises(ValidationError, match=BAD_PATHS[path]) as e:
        TaskSpec(**{**fields, "files": {**fields["files"], path: "x = 1\n"}})
    assert repr(path[:40])[1:-1] in str(e.value)
    with pytest.raises(ValidationError, match=BAD_PATHS[path]):  # a pinned path is read on the host
        Check(kind="unchanged", name="pin", hashes={path: "0" * 64})
    # a copy that skipped validation is caught again before the gate runs anything
    assert any(BAD_PATHS[path] in p for p in base.model_copy(update={"files": {path: "x"}}).problems())


def test_other_path_bearing_fields_are_checked():
    fields = FAMILIES["fix-bug"].make(0).model_dump()
    with pytest.raises(ValidationError, match="forbidden path '/etc' is absolute"):
        TaskSpec(**{**fields, "forbidden_paths": ["/etc"]})
    assert TaskSpec(**{**fields, "forbidden_paths": ["tests/", "sim.py"]}).forbidden_paths == ["tests/", "sim.py"]
    with pytest.raises(ValidationError, match="both a file and the directory"):
        TaskSpec(**{**fields, "files": {"a": "", "a/b.py": ""}})
    with pytest.raises(ValidationError, match="ids and family names"):
        TaskSpec(**{**fields, "family": "../../tmp/x"})  # names a temporary directory
    with pytest.raises(ValidationError, match="names a module"):
        Check(kind="calls", name="c", calls=[{"module": "..pkg", "fn": "f", "args": []}], returns=[1])


def test_the_gate_writes_nothing_of_an_unsafe_spec(sandbox):
    name = f"temper-escape-{secrets.token_hex(6)}.txt"
    outside = Path(tempfile.gettempdir()) / name
    spec = FAMILIES["set-const"].make(0)
    bad = spec.model_copy(update={"files": {**spec.files, f"../../{name}": "pwned\n"}}).compute_hashes()
    rep = validate(bad, sandbox, probes=False)
    assert not rep.accepted and not rep.legs
    assert any(r.startswith("spec: ") and f"'../../{name}'" in r and "'..'" in r for r in rep.reasons), rep.reasons
    assert not outside.exists()


# ---- "python" checks read workspace files as data; running workspace code needs "calls" ---------------------------
RUNS_WORKSPACE_CODE = {
    "import-after-path": "import sys\nsys.path.insert(0, '.')\nimport solution\nemit({'pass': solution.add(2, 3) == 5})",
    "exec-file": "ns = {}\nexec(open('solution.py').read(), ns)\nemit({'pass': ns['add'](2, 3) == 5})",
    "importlib": "import importlib.util as u\ns = u.spec_from_file_location('s', 'solution.py')\nm = u.module_from_spec(s)\n"
                 "s.loader.exec_module(m)\nemit({'pass': m.add(2, 3) == 5})",
    "runpy": "import runpy\nemit({'pass': runpy.run_path('solution.py')['add'](2, 3) == 5})",
    "dunder-import": "m = __import__('solution')\nemit({'pass': m.add(2, 3) == 5})",
    "subprocess": "import subprocess\nr = subprocess.run(['python', 'solution.py'], capture_output=True, text=True)\n"
                  "emit({'pass': '5' in r.stdout})",
    "os-system": "import os\nemit({'pass': os.system('python solution.py') == 0})",
    "os-exec-alias": "from os import execv as go\ngo('/usr/bin/python3', ['python3', 'solution.py'])",
    "pickle": "import pickle\nemit({'pass': pickle.load(open('state.pkl', 'rb')) == 5})",
    "workspace-module": "import solution\nemit({'pass': solution.add(2, 3) == 5})",
    "relative-import": "from . import solution\nemit({'pass': True})",
    "builtins-dunder": "f = __builtins__['ev' + 'al']\nemit({'pass': f('1') == 1})",
    "subclasses": "emit({'pass': bool(().__class__.__bases__[0].__subclasses__())})",
    "getattr": "import os\ngetattr(os, 'sys' + 'tem')('python solution.py')",
    "frames": "import inspect\nemit({'pass': inspect.currentframe().f_back is None})",
}


@pytest.mark.parametrize("how", sorted(RUNS_WORKSPACE_CODE))
def test_a_python_check_that_runs_workspace_code_is_rejected(how):
    with pytest.raises(ValidationError, match="must be a 'calls' check"):
        Check(kind="python", name="runs it", code=RUNS_WORKSPACE_CODE[how])


def test_python_checks_that_read_files_as_data_stay_allowed():
    reads = ("import ast, json, re, os\nsrc = open('solution.py').read()\ntree = ast.parse(src)\n"
             "names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]\n"
             "cfg = json.load(open('cfg.json')) if os.path.exists('cfg.json') else {}\n"
             "emit({'pass': names == ['add'] and re.search(r'a \\+ b', src) is not None, 'detail': str(cfg)})")
    Check(kind="python", name="reads", code=reads)
    for spec in generate(None, 14, seed=0):  # every family's own checks
        assert spec.problems() == [], spec.id


def _plain_module_spec() -> TaskSpec:
    """A non-package layout (a top-level solution.py) whose careless verifier imports the module it grades."""
    files = {"solution.py": "def add(a, b):\n    return a - b\n"}
    weak = Check.model_construct(kind="python", name="imports solution", normalize="strip", calls=[], returns=[],
                                 hashes={}, expected=None,
                                 code="import sys\nsys.path.insert(0, '.')\nimport solution\n"
                                      "emit({'pass': solution.add(2, 3) == 5, 'detail': 'add(2, 3)'})")
    spec = FAMILIES["set-const"].make(0).model_copy(update={
        "id": "plain-module-000000", "family": "plain-module", "instruction": "Fix add in solution.py.",
        "files": files, "tools": ["read", "write", "replace"], "knobs": {}, "hidden": {},
        "reference": [Action("replace", {"path": "solution.py", "old": "a - b", "new": "a + b"}).render()],
        "verifier": Verifier.model_construct(checks=[weak]), "essential": [], "forbidden_paths": []})
    return spec.compute_hashes()


def test_a_check_that_imports_workspace_code_is_refused_at_the_gate(sandbox):
    """A hand-made spec that skipped validation (model_construct) is refused before it runs."""
    rep = validate(_plain_module_spec(), sandbox, probes=False)
    assert not rep.accepted and not rep.legs
    assert any("verifier.checks.0" in r and "'calls' check" in r for r in rep.reasons), rep.reasons


def test_the_gate_forges_a_verdict_from_a_plain_module(sandbox, monkeypatch):
    """Whatever the layout, a verifier that computes its verdict where workspace code runs is caught by a probe:
    the module steals the nonce from the stack and turns the verdict into a pass (atexit and stdout)."""
    spec = _plain_module_spec()
    calls = PROBES["forge:atexit-module"](spec.public())
    assert calls and calls[0].startswith("<tool_call>write solution.py")
    r, _, _ = run_script(spec, sandbox, calls, PROBE_LIMITS)
    assert r.reward == 1.0, r.checks  # the forgery works against such a verifier: bugs left in place
    monkeypatch.setattr(gate_mod, "spec_problems", lambda s: [])  # as if the static rule had missed it
    monkeypatch.setattr(gate_mod, "PROBES", {"forge:atexit-module": PROBES["forge:atexit-module"]})
    rep = validate(spec, sandbox)
    assert rep.legs["oracle"]["reward"] == 1.0
    assert not rep.accepted and any(x.startswith("probe forge:atexit-module earned the reward") for x in rep.reasons)


# ---- wrong-answer leg ---------------------------------------------------------------------------------------------
def test_wrong_text_keeps_the_right_value_inside_a_different_one():
    assert wrong_text("391") == "3917" and wrong_text("-12") == "-127" and wrong_text("oslo") == "oslox"
    assert wrong_text("SIZE = 3", code=True) == "SIZE = 37" and wrong_text("3.14") == "13.14"
    assert wrong_text("    return y % 400 == 0", code=True) == "    return y % 400 == 10"
    assert wrong_text("x = 1  # see 9\n", code=True) == "x = 17  # see 9\n"


def test_a_text_match_verifier_is_rejected_by_the_wrong_answer_leg(sandbox):
    """A verifier that looks for `NAME = VALUE` as a substring of settings.py passes the oracle, the no-op, every
    prefix and the corruption legs; `SIZE = 37` contains `SIZE = 3`, and only the wrong-answer leg sees it."""
    spec = FAMILIES["set-const"].make(1, {"horizon": 1})
    want = {**spec.hidden["values"], **spec.hidden["targets"]}
    text_match = (f"want = {want!r}\ntext = open('settings.py').read()\n"
                  "emit({'pass': all(f'{k} = {v}' in text for k, v in want.items()), 'detail': 'substring'})")
    weak = spec.model_copy(update={"verifier": Verifier(checks=[Check(kind="python", name="text", code=text_match)])})
    rep = validate(weak.compute_hashes(), sandbox, probes=False)
    assert rep.reasons == ["wrong-answer: reward 1.0, expected 0.0"]
    assert rep.legs["oracle"]["reward"] == 1.0 and rep.legs["corrupt-last"]["reward"] == 0.0


# ---- set-const: the exact literal ---------------------------------------------------------------------------------
def test_set_const_wants_the_exact_integer(sandbox):
    spec = next(s for s in generate(["set-const?horizon=1"], 40, seed=3) if 1 in s.hidden["targets"].values())
    (name, value), = spec.hidden["targets"].items()
    old = f"{name} = {spec.hidden['values'][name]}"
    for new in (f"{name} = {float(value)}", f"{name} = True", f"{name} = {value}"):
        r, _, _ = run_script(spec, sandbox, [Action("replace", {"path": "settings.py", "old": old, "new": new}).render()])
        assert r.reward == (1.0 if new.endswith(f"= {value}") else 0.0), (new, r.checks)
