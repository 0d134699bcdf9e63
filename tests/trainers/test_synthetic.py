"""The base recipe's synthetic drills: each target is the value the prompt binds to its query, and the data are a pure
function of (kind, n, seed)."""

import re

import pytest

from model import ByteTokenizer
from trainers.synthetic import KINDS, synthetic_segments

TOK = ByteTokenizer()
OPS = {"add": "add", "subtract": "sub", "multiply by": "mul"}


def test_bind_targets_are_the_values_the_prompt_binds():
    segs = synthetic_segments("bind", 400, 3, TOK)
    forms = set()
    for seg in segs:
        text = TOK.decode(seg.tokens)
        first = text.split("\n", 1)[0]
        if first.startswith("set "):
            forms.add("set")
            bound = {n: f" {a} -> {b}\n" for n, a, b in re.findall(r"([A-Z]+) \(now (\d)\) to (\d)", first)}
        else:
            forms.add("chain")
            m = re.fullmatch(r"Start with (\d+), (.*)\.", first)
            steps = re.findall(r"(add|subtract|multiply by) (\d+)", m.group(2))
            bound = {"start": f" {m.group(1)}\n"} | {f"step {i + 1}": f" {OPS[op]} {x}\n"
                                                     for i, (op, x) in enumerate(steps)}
        items = len(bound) - (not first.startswith("set "))  # a chain also asks for its start
        assert 2 <= items <= 4
        # every item is asked exactly once, and each trained answer is the asked item's value
        lines = text.split("\n")[1:-1]
        assert sorted(line.split(":")[0] for line in lines) == sorted(bound)
        for line in lines:
            name, ans = line.split(":", 1)
            assert ans + "\n" == bound[name]
        trained = "".join(TOK.decode([t]) for t, m in zip(seg.tokens, seg.loss_mask) if m)
        assert trained == "".join(bound[line.split(":")[0]] for line in lines)
    assert forms == {"set", "chain"}


@pytest.mark.parametrize("kind", KINDS)
def test_drills_are_pure_functions_of_kind_n_and_seed(kind):
    a, b, c = (synthetic_segments(kind, 50, s, TOK) for s in (5, 5, 6))
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert [s.tokens for s in a] != [s.tokens for s in c]
    assert all(any(s.loss_mask) and not s.loss_mask[0] for s in a)


def test_an_unknown_drill_names_the_pattern():
    with pytest.raises(ValueError, match=r"synth:bogus.*synth:bind"):
        synthetic_segments("bogus", 1, 0, TOK)
