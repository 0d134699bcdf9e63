"""Every family: the triad, every hack probe, determinism, and a verifier builder blind to the reference."""

import inspect

import pytest

from envs import FAMILIES, Environment, PublicTask
from envs.gate import PROBES, validate
from envs.generator import generate, parse_pattern

DOMAINS = {"code", "math", "reasoning"}


def test_families_cover_every_domain_tiny_and_realistic():
    assert len(FAMILIES) >= 6
    for d in DOMAINS:
        fams = [f for f in FAMILIES.values() if f.domain == d]
        assert any(f.tiny for f in fams) and any(not f.tiny for f in fams), d


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triad_and_every_probe(family, sandbox):
    spec = FAMILIES[family].make(7)
    rep = validate(spec, sandbox)
    assert rep.accepted, rep.reasons
    assert rep.legs["oracle"]["reward"] == 1.0
    assert rep.legs["no-op"]["reward"] == 0.0
    prefixes = [k for k in rep.legs if k.startswith("prefix:")]
    assert len(prefixes) == len(spec.reference) - 1
    assert all(rep.legs[k]["reward"] == 0.0 for k in prefixes)
    assert rep.legs["corrupt-last"]["reward"] == 0.0
    assert set(rep.probes) == set(PROBES)
    applicable = [p for p, r in rep.probes.items() if r["applicable"]]
    assert all(rep.probes[p]["reward"] == 0.0 for p in applicable)
    if "python" in spec.tools:  # the containment probes really ran here, and came back in bounded time
        for p in ("fork-bomb", "sleep-past-timeout", "flood-output", "network", "memory-hog"):
            assert rep.probes[p]["applicable"] and rep.probes[p]["seconds"] < 10


def test_horizons_are_long_tailed_and_reach_16_calls():
    from collections import Counter

    lengths = Counter(len(s.reference) for s in generate(None, 700, seed=1))
    assert min(lengths) == 1 and max(lengths) >= 9
    short = sum(v for k, v in lengths.items() if k <= 4)
    long = sum(v for k, v in lengths.items() if k >= 8)
    assert short > 4 * long > 0  # a long tail, not a uniform spread
    longest = {name: len(f.make(0, {"horizon": f.horizon[1]}).reference) for name, f in FAMILIES.items()}
    assert max(longest.values()) >= 16, longest
    assert min(len(f.make(0, {"horizon": f.horizon[0]}).reference) for f in FAMILIES.values()) == 1


def test_generation_is_deterministic_by_seed():
    a = [s.spec_hash for s in generate(None, 21, seed=5)]
    b = [s.spec_hash for s in generate(None, 21, seed=5)]
    c = [s.spec_hash for s in generate(None, 21, seed=6)]
    assert a == b and a != c
    assert [s.family for s in generate(["kv-lookup", "fix-bug?horizon=2"], 4, 0)] == ["kv-lookup", "fix-bug"] * 2
    assert all(s.knobs["horizon"] == 2 for s in generate(["fix-bug?horizon=2"], 3, 0))
    with pytest.raises(KeyError, match="unknown task family"):
        parse_pattern("nope")
    with pytest.raises(ValueError, match="outside"):
        generate(["kv-lookup?horizon=9"], 1)


def test_kv_lookup_keys_knob_sets_lines_per_file():
    one = generate(["kv-lookup?horizon=1&keys=1"], 3, seed=2)
    assert all(f.count("\n") == 1 for s in one for f in s.files.values())
    assert all(s.verifier.checks[0].expected in s.files[s.hidden["start"][0]] for s in one)
    default = generate(["kv-lookup?horizon=1"], 3, seed=2)
    assert all(f.count("\n") == 3 for s in default for f in s.files.values())
    with pytest.raises(ValueError, match="keys=0 outside"):
        generate(["kv-lookup?keys=0"], 1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_verifier_builder_never_sees_the_reference(family):
    fam = FAMILIES[family]
    params = list(inspect.signature(fam.build_verifier).parameters)
    assert params == ["task", "hidden"]
    assert "reference" not in PublicTask.model_fields
    spec = fam.make(3)
    task, hidden = spec.public(), dict(spec.hidden)
    assert not any(isinstance(v, str) and "<tool_call>" in v for v in hidden.values())
    # the verifier depends on (task, hidden) only: rebuilding it gives the spec's verifier exactly
    assert fam.build_verifier(task, hidden).hash() == spec.verifier_hash


def test_malformed_actions_become_observations(sandbox):
    spec = FAMILIES["set-const"].make(0)
    with Environment(spec, sandbox) as env:
        env.reset()
        for bad in ["hello", "<tool_call>rm -rf /</tool_call>", "<tool_call>replace settings.py nope nope</tool_call>",
                    "<tool_call>read ../../etc/shadow</tool_call>", "<tool_call>python\nprint(1)</tool_call>"]:
            step = env.step(bad)
            assert step.observation.startswith("error:"), step.observation
        assert not env.done
        r = env.verify()
    assert r.reward == 0.0 and r.status == "ok"


def test_max_turns_ends_the_episode(sandbox):
    spec = FAMILIES["kv-lookup"].make(0)
    with Environment(spec, sandbox) as env:
        env.reset()
        steps = [env.step("<tool_call>ls</tool_call>") for _ in range(spec.max_turns)]
    assert steps[-1].done and not any(s.done for s in steps[:-1])


def _episode(spec, sandbox, actions: list[str]) -> tuple[float, list[str]]:
    """Run rendered tool calls (`<tool_call>…</tool_call>`) through the environment: (reward, observations)."""
    obs = []
    with Environment(spec, sandbox) as env:
        env.reset()
        for a in actions:
            obs.append(env.step(a).observation)
            if env.done:
                break
        return env.verify().reward, obs


def _sloppy(spec) -> list[str]:
    return [a.render() for a in FAMILIES[spec.family].sloppy(spec.public(), spec.hidden)]


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_careless_calc_stops_one_operation_early(horizon, sandbox):
    import re

    for seed in range(3):
        spec = generate([f"calc-chain?horizon={horizon}"], 1, seed)[0]
        sloppy = _sloppy(spec)
        # the oracle's calls without its last calc, then the value it had: the previous calc's observation, or the
        # start number read from the instruction
        assert sloppy[:-1] == spec.reference[:-2] and sloppy[-1].startswith("<tool_call>submit ")
        _, obs = _episode(spec, sandbox, spec.reference)
        had = obs[-3] if horizon > 1 else re.search(r"Start with (\d+)", spec.instruction).group(1)
        assert sloppy[-1] == f"<tool_call>submit {had.strip()}</tool_call>"
        assert _episode(spec, sandbox, sloppy)[0] == 0.0 and _episode(spec, sandbox, spec.reference)[0] == 1.0


def test_careless_kv_lookup_submits_the_pointer_it_found(sandbox):
    import re

    for seed in range(3):
        spec = generate(["kv-lookup?horizon=2&keys=1"], 1, seed)[0]
        sloppy = _sloppy(spec)
        key, f = re.search(r"value of (\w+) in (\S+) and", spec.instruction).groups()
        line = re.search(rf"^{key}=(.*)$", spec.files[f], re.M).group(1)  # what the first read shows
        assert line.startswith("->") and sloppy == [spec.reference[0], f"<tool_call>submit {line}</tool_call>"]
        assert _episode(spec, sandbox, sloppy)[0] == 0.0
    assert FAMILIES["multihop"].sloppy(None, {}) is None  # only the tiny families have a careless demonstrator


def test_careless_set_const_writes_strings(sandbox):
    import ast

    for h in (1, 2):
        spec = generate([f"set-const?horizon={h}"], 1, 5)[0]
        sloppy = _sloppy(spec)
        assert [s.replace('"', "") for s in sloppy] == spec.reference  # the oracle's edits, the value in quotes
        with Environment(spec, sandbox) as env:
            env.reset()
            for a in sloppy:
                env.step(a)
            got = {t.targets[0].id: t.value.value for t in ast.parse((env.workspace / "settings.py").read_text()).body}
            assert env.verify().reward == 0.0
        targets = spec.hidden["targets"]
        assert {k: got[k] for k in targets} == {k: str(v) for k, v in targets.items()}  # right digits, wrong type
