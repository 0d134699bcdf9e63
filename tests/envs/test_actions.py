import random

import pytest

from envs.actions import USAGE, Action, ActionError, parse_action


@pytest.mark.parametrize(
    "text,tool,args",
    [
        ("<tool_call>read notes.txt</tool_call>", "read", {"path": "notes.txt"}),
        ("thinking... <tool_call>ls</tool_call> trailing", "ls", {}),
        ("<tool_call>calc (3+4)*2</tool_call>", "calc", {"expr": "(3+4)*2"}),
        ("<tool_call>submit the north wing</tool_call>", "submit", {"answer": "the north wing"}),
        ("<tool_call>replace a.py 'X = 1' 'X = 2'</tool_call>", "replace", {"path": "a.py", "old": "X = 1", "new": "X = 2"}),
        ("<tool_call>write a.txt\nline1\nline2</tool_call>", "write", {"path": "a.txt", "content": "line1\nline2"}),
        ("<tool_call>python\nprint(1)</tool_call>", "python", {"code": "print(1)"}),
        ("<tool_call>python sim.py --fast</tool_call>", "python", {"path": "sim.py", "argv": ["--fast"]}),
        ("<tool_call>pytest -q tests", "pytest", {"argv": ["-q", "tests"]}),  # missing close tag tolerated
        ('<tool_call>{"name": "read", "arguments": {"path": "b.txt"}}</tool_call>', "read", {"path": "b.txt"}),
        ('<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"1+1\\"}"}</tool_call>', "calc", {"expr": "1+1"}),
        ("<tool_call>done</tool_call>", "done", {}),
    ],
)
def test_parses_both_forms(text, tool, args):
    a = parse_action(text)
    assert isinstance(a, Action) and a.tool == tool and a.args == args


@pytest.mark.parametrize(
    "text,needle",
    [
        ("no call here", "no tool call found"),
        ("<tool_call></tool_call>", "empty tool call"),
        ("<tool_call>fly away</tool_call>", "unknown tool 'fly'"),
        ("<tool_call>read</tool_call>", "read: takes one path, got 0 arguments. usage: read PATH"),
        ("<tool_call>read a b</tool_call>", "takes one path, got 2"),
        ("<tool_call>replace a.py x</tool_call>", "replace: takes PATH OLD NEW"),
        ("<tool_call>replace a.py 'unclosed</tool_call>", "cannot split arguments"),
        ("<tool_call>submit</tool_call>", "submit: missing argument"),
        ("<tool_call>done now</tool_call>", "done: takes no arguments"),
        ('<tool_call>{"name": "read"</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "read", "arguments": {"file": "x"}}</tool_call>', "unknown argument(s) ['file']"),
        ('<tool_call>{"name": "write", "arguments": {"path": 3}}</tool_call>', "path must be a string"),
        ('<tool_call>{"arguments": {}}</tool_call>', '{"name": TOOL'),
    ],
)
def test_malformed_actions_say_what_is_wrong(text, needle):
    a = parse_action(text)
    assert isinstance(a, ActionError)
    assert needle in a.message


def test_unavailable_tool_is_named():
    a = parse_action("<tool_call>python\nprint(1)</tool_call>", allowed={"read", "submit"})
    assert isinstance(a, ActionError) and "not available here" in a.message and "read" in a.message


def test_render_round_trip():
    acts = [Action("read", {"path": "dir/a b.txt"}), Action("replace", {"path": "x.py", "old": "A = 'q'", "new": "A = 2"}),
            Action("write", {"path": "f", "content": "x\ny\n"}), Action("calc", {"expr": "2**8 - 1"}),
            Action("python", {"code": "import os\nprint(os.getcwd())"}), Action("submit", {"answer": "42"}),
            Action("pytest", {"argv": ["-k", "a or b"]}), Action("ls", {})]
    for a in acts:
        back = parse_action(a.render())
        assert isinstance(back, Action) and (back.tool, back.args) == (a.tool, a.args)


def test_parser_never_raises_on_noise():
    rng = random.Random(0)
    alphabet = list("<>/{}[]\"':, \n\\") + list("tool_call") + list(USAGE)
    for _ in range(3000):
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        parse_action("<tool_call>" + body + rng.choice(["", "</tool_call>"]))


def test_every_rendered_action_parses_back_to_itself_multi_line_arguments_included():
    """A `replace` whose old or new text spans lines cannot be said in the compact form (its arguments sit on the
    first line): it renders as JSON, so oracles and the gate's corrupted calls apply as written."""
    from envs.actions import Action

    for act in [Action("replace", {"path": "a.py", "old": "x = 1\ny = 2", "new": "x = 3\ny = 4"}),
                Action("replace", {"path": "a b.py", "old": "p", "new": "q"}),
                Action("write", {"path": "m.py", "content": "a\nb\n"}), Action("python", {"code": "print(1)\n"}),
                Action("submit", {"answer": "42"}), Action("pytest", {"argv": ["-k", "a b"]})]:
        got = parse_action(act.render())
        assert (got.tool, got.args) == (act.tool, act.args), act
