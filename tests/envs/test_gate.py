"""The gate rejects bad verifiers; the miner flags shortcut trajectories; crashes are contained."""

import pytest

from envs import FAMILIES, Action, Check, Verifier, run_script
from envs.dataset import read_dataset, write_dataset
from envs.gate import mine, validate
from envs.generator import generate


def _with_verifier(spec, checks):
    return spec.model_copy(update={"verifier": Verifier(checks=checks)}).compute_hashes()


def test_always_true_verifier_is_rejected(sandbox):
    spec = _with_verifier(FAMILIES["set-const"].make(1),
                          [Check(kind="python", name="lazy", code="emit({'pass': True})")])
    rep = validate(spec, sandbox, probes=False)
    assert not rep.accepted and any(r.startswith("no-op: reward 1.0") for r in rep.reasons)


def test_verifier_that_accepts_a_guess_is_rejected(sandbox):
    base = FAMILIES["kv-lookup"].make(2)
    assert validate(base, sandbox).accepted
    # a task whose answer is a common guess: oracle, no-op and corruption all look fine, a probe does not
    weak = Check(kind="answer", name="value", expected="42", normalize="strip")
    spec = base.model_copy(update={"verifier": Verifier(checks=[weak]),
                                   "reference": [Action("submit", {"answer": "42"}).render()]}).compute_hashes()
    rep = validate(spec, sandbox)
    assert not rep.accepted and any("probe guess:42 earned the reward" in r for r in rep.reasons)


def test_verifier_that_trusts_file_content_is_caught_by_a_probe(sandbox):
    base = FAMILIES["slow-stage"].make(3)
    gullible = ("import os\nok = any('OK' in open(f).read() for f in os.listdir('.') if os.path.isfile(f))\n"
                "ok = ok and '_workers: 1\\n' not in open('pipeline.cfg').read()\n"
                "emit({'pass': ok, 'detail': 'looked for OK'})")
    spec = _with_verifier(base, [Check(kind="python", name="gullible", code=gullible)])
    rep = validate(spec, sandbox)
    assert not rep.accepted
    assert any(r.startswith("probe write-everywhere earned the reward") for r in rep.reasons), rep.reasons


def test_a_verifier_that_raises_fails_the_oracle_and_is_rejected(sandbox):
    """A broken generated check is a failed check (reward 0, its error named), never a "crash" a policy could
    shelter behind; the gate rejects it because the oracle does not earn the reward."""
    spec = _with_verifier(FAMILIES["set-const"].make(0),
                          [Check(kind="python", name="boom", code="raise RuntimeError('bug in verifier')")])
    reward, _, _ = run_script(spec, sandbox, spec.reference)
    assert reward.reward == 0.0 and reward.status == "ok" and reward.attempts == 1
    assert "bug in verifier" in reward.checks[0].detail
    rep = validate(spec, sandbox, probes=False)
    assert not rep.accepted and any("oracle" in r for r in rep.reasons)


def test_tampered_spec_is_rejected(sandbox):
    spec = FAMILIES["calc-chain"].make(0)
    tampered = spec.model_copy(update={"hidden": {**spec.hidden, "start": 1}})
    rep = validate(tampered, sandbox)
    assert not rep.accepted and "hash mismatch" in rep.reasons[0]


def test_miner_flags_shortcuts():
    spec = FAMILIES["fix-bug"].make(0)
    genuine = [Action("read", {"path": "pkg/mathx.py"}), Action("replace", {"path": "pkg/mathx.py", "old": "a", "new": "b"})]
    assert mine(spec, genuine, 1.0) == []
    hacks = [Action("write", {"path": "conftest.py", "content": "x"}),
             Action("write", {"path": "tests/test_mathx.py", "content": "def test(): pass"}),
             Action("read", {"path": "../verify/tests/test_mathx.py"}),
             Action("python", {"code": "import os; os._exit(0)"})]
    flags = mine(spec, hacks, 1.0)
    assert any("essential action replace|write" not in f for f in flags)
    assert any("writes test machinery conftest.py" in f for f in flags)
    assert any("forbidden path tests/test_mathx.py" in f for f in flags)
    assert any("outside the workspace" in f for f in flags)
    assert any("os._exit" in f for f in flags)
    calc = FAMILIES["calc-chain"].make(0)
    assert mine(calc, [Action("submit", {"answer": "5"})], 1.0) == ["rewarded without essential action calc"]
    assert mine(calc, [Action("submit", {"answer": "5"})], 0.0) == []


def test_dataset_round_trip_and_tamper_detection(tmp_path):
    specs = generate(None, 7, seed=2)
    man = write_dataset(specs, tmp_path / "ds")
    assert man["n"] == 7 and len(man["specs"]) == 7
    back = read_dataset(tmp_path / "ds")
    assert [s.spec_hash for s in back] == [s.spec_hash for s in specs]
    p = tmp_path / "ds" / "specs.jsonl"
    p.write_text(p.read_text().replace("Start with", "Begin with", 1))
    with pytest.raises(ValueError, match="does not match the manifest"):
        read_dataset(tmp_path / "ds")
