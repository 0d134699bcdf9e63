"""A fresh red-team round found five more ways through; each is an attack here that must fail (both sandboxes):

* an undecodable file name (or a verdict with \\udXXX escapes) put a lone surrogate in the reward's details, which
  the trajectory store refused: the whole training stage failed;
* a workspace tmpfs sized in bytes only: empty files and extended attributes took unbounded kernel memory;
* bwrap's own command line (/proc/1/cmdline inside) named the host's temp dirs;
* a family name with ':' (the LLM generator's `llm:<slug>`) made every Docker bind invalid: every episode crashed;
* a "calls" check whose expected values are all None passes a function that does nothing.
"""

import json
import tempfile
from pathlib import Path

import pytest

from envs import FAMILIES, Action, run_script
from envs.sandbox import QUOTA_INODES
from envs.spec import Check

DONE = Action("done", {}).render()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sandbox(each_sandbox):  # bwrap, then Docker (tests/envs/conftest.py)
    return each_sandbox


def _py(code):
    return Action("python", {"code": code}).render()


def _storable(r) -> None:
    """What the trajectory store writes: the reward's details as UTF-8 JSON."""
    json.dumps(r.to_dict(), ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("family", ["fix-bug", "slow-stage"])
def test_an_undecodable_file_name_leaves_storable_details(sandbox, family):
    spec = FAMILIES[family].make(0)
    r, _, _ = run_script(spec, sandbox, [_py("import os\nos.mkfifo(b'\\xff')"), DONE])
    assert r.status == "ok" and r.reward == 0.0
    assert any("is a FIFO" in c.detail for c in r.checks), r.checks
    _storable(r)


def test_a_verdict_with_lone_surrogates_is_garbled_not_stored_raw(sandbox):
    """Code under test steals the nonce and prints verdicts whose strings decode to lone surrogates."""
    spec = FAMILIES["fix-bug"].make(0)
    steal = ("import sys, os, json\nf = sys._getframe()\nnonce = None\nwhile f is not None:\n"
             "    for v in list(f.f_locals.values()):\n"
             "        if isinstance(v, str) and len(v) == 32: nonce = nonce or v\n    f = f.f_back\n"
             "print(f'\\n{nonce} ' + json.dumps({'observations': [{'raised': '\\udc80'}] * 12}), flush=True)\n"
             "os._exit(0)\n")
    r, _, _ = run_script(spec, sandbox, [Action("write", {"path": "pkg/__init__.py", "content": steal}).render(), DONE])
    calls = [c for c in r.checks if c.name == "hidden calls"][0]
    assert r.status == "ok" and r.reward == 0.0 and calls.detail.startswith("garbled observation"), r.checks
    _storable(r)


def test_the_workspace_holds_a_bounded_number_of_files(sandbox):
    spec = FAMILIES["fix-bug"].make(0)
    code = ("n = 0\ntry:\n    for i in range(40000):\n        open(f'f{i}', 'w').close()\n        n += 1\n"
            "except OSError as e:\n    print('stopped', n, e.errno)\nelse:\n    print('made', n)")
    r, _, obs = run_script(spec, sandbox, [_py(code), DONE])
    assert obs[0].startswith("stopped") and int(obs[0].split()[1]) < QUOTA_INODES, obs
    assert r.status == "ok" and r.reward == 0.0


def test_no_process_inside_sees_a_host_path_on_a_command_line(sandbox):
    """bwrap runs as pid 1 inside with the command after `--` on its command line (the agent's own code, which is
    fine); its options (the host's workspace and staged-tools paths) come from a pipe. The needles are written
    reversed in the probe, so the probe's own code (on both command lines) does not contain them."""
    spec = FAMILIES["fix-bug"].make(0)
    needles = [n[::-1] for n in (tempfile.gettempdir() + "/temper-", "temper-stage", "--bind", str(ROOT))]
    code = (f"import os\nneedles = [n[::-1] for n in {needles!r}]\nseen = []\nfor p in os.listdir('/proc'):\n"
            "    if p.isdigit():\n        try:\n"
            "            seen.append(open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace'))\n"
            "        except OSError:\n            pass\n"
            "print('found', [n for n in needles if any(n in c for c in seen)], len(seen))")
    _, _, obs = run_script(spec, sandbox, [_py(code)])
    assert obs[0].startswith("found [] "), obs


def test_a_family_name_with_a_colon_runs_in_every_sandbox(sandbox):
    spec = FAMILIES["fix-bug"].make(0)
    llm = spec.model_copy(update={"family": "llm:fix-bug"}).compute_hashes()
    r, _, obs = run_script(llm, sandbox, llm.reference)
    assert r.status == "ok" and r.reward == 1.0, (r.checks, obs)


def test_a_calls_check_that_expects_only_none_is_refused():
    with pytest.raises(ValueError, match="every expected return value is None"):
        Check(kind="calls", name="weak", calls=[{"module": "test_solution", "fn": "test_add", "args": []}],
              returns=[None])
    Check(kind="calls", name="ok", calls=[{"module": "solution", "fn": "add", "args": [2, 3]}] * 2, returns=[5, None])
