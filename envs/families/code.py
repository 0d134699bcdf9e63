"""Code families: set constants (tiny), fix bugs so the hidden calls return the right values, and an ML-infra task
(find the slow data-pipeline stage in a profile, patch the config, the verifier re-runs the model)."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from ..actions import Action
from ..spec import Check, PublicTask, Verifier
from .base import Family, Sampled

CONSTS = ["RATE", "SIZE", "LIMIT", "DEPTH", "WIDTH", "RETRIES", "BATCH", "STEPS"]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class SetConst(Family):
    """settings.py holds integer constants; set the named ones to new values (integers: `3`, not `3.0` or `"3"`),
    leave the rest."""

    name, domain, tiny = "set-const", "code", True
    tools = ("read", "replace")
    essential = ("replace|write",)
    horizon = (1, 3)

    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        names = rng.sample(CONSTS, 4)
        values = {n: rng.randint(1, 9) for n in names}
        targets = {}
        for n in rng.sample(names, knobs["horizon"]):
            targets[n] = rng.choice([v for v in range(1, 10) if v != values[n]])
        files = {"settings.py": "".join(f"{n} = {values[n]}\n" for n in names)}
        asks = " and ".join(f"{n} (now {values[n]}) to {v}" for n, v in targets.items())
        return Sampled(f"In settings.py set {asks}.", files, {"values": values, "targets": targets})

    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        want = {**hidden["values"], **hidden["targets"]}
        code = (
            "import ast\n"
            f"want = {json.dumps(want)}\n"
            "try:\n"
            "    tree = ast.parse(open('settings.py').read())\n"
            "except Exception as e:\n"
            "    emit({'pass': False, 'detail': f'settings.py does not parse: {e}'})\n"
            "else:\n"
            "    got = {}\n"
            "    other = 0\n"
            "    for node in tree.body:\n"
            "        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0],"
            " ast.Name) and isinstance(node.value, ast.Constant)):\n"
            "            got[node.targets[0].id] = node.value.value\n"
            "        else:\n"
            "            other += 1\n"
            "    # type-exact: 3.0 == 3 and True == 1 in Python, but a float or a bool is not the integer asked for\n"
            "    same = set(got) == set(want) and all(type(got[k]) is type(want[k]) and got[k] == want[k] for k in want)\n"
            "    emit({'pass': same and other == 0, 'detail': f'got {got!r}, other statements {other}'})\n"
        )
        return Verifier(checks=[Check(kind="python", name="constants", code=code)])

    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        acts = []
        for n, v in hidden["targets"].items():
            acts.append(Action("replace", {"path": "settings.py", "old": f"{n} = {hidden['values'][n]}",
                                           "new": f"{n} = {v}"}))
        return acts

    def sloppy(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        """Writes each new value as a string (`LIMIT = "6"`): the file parses, the constant has the wrong type."""
        return [Action("replace", {"path": "settings.py", "old": f"{n} = {hidden['values'][n]}",
                                   "new": f'{n} = "{v}"'}) for n, v in hidden["targets"].items()]


# ---- fix-bug -------------------------------------------------------------------------------------------
# Each function: module, source, (buggy line, fixed line), symptom, visible tests (pytest, the agent sees and runs
# them), hidden calls ((args, expected return value), compared on the host, type-strictly: 3.0 is not 3).
FUNCS = {
    "clamp": ("mathx", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
              ("    return max(lo, min(x, lo))", "    return max(lo, min(x, hi))"),
              "clamp(5, 0, 10) should be 5",
              ["assert clamp(5, 0, 10) == 5"],
              [((5, 0, 10), 5), ((-3, 0, 10), 0), ((42, 0, 10), 10)]),
    "mean": ("mathx", "def mean(xs):\n    return sum(xs) / len(xs)\n",
             ("    return sum(xs) / (len(xs) - 1)", "    return sum(xs) / len(xs)"),
             "mean([2, 4]) should be 3",
             ["assert mean([2, 4]) == 3"],
             [(([2, 4],), 3.0), (([5],), 5.0), (([1, 2, 3, 6],), 3.0)]),
    "is_leap": ("mathx", "def is_leap(y):\n    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)\n",
                ("    return y % 4 == 0 and y % 100 != 0", "    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)"),
                "is_leap(2000) should be True",
                ["assert is_leap(2000)"],
                [((2000,), True), ((1900,), False), ((2024,), True), ((2023,), False)]),
    "fib": ("mathx", "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
            ("    for _ in range(n - 1):", "    for _ in range(n):"),
            "fib(10) should be 55",
            ["assert fib(10) == 55"],
            [((0,), 0), ((1,), 1), ((10,), 55)]),
    "slugify": ("textx", "def slugify(s):\n    return '-'.join(s.lower().split())\n",
                ("    return '_'.join(s.lower().split())", "    return '-'.join(s.lower().split())"),
                "slugify('Hello World') should be 'hello-world'",
                ["assert slugify('Hello World') == 'hello-world'"],
                [(("Hello World",), "hello-world"), (("  A  b ",), "a-b"), (("x",), "x")]),
    "word_count": ("textx", "def word_count(text):\n    return len(text.split())\n",
                   ("    return len(text.split(' '))", "    return len(text.split())"),
                   "word_count('a  b') should be 2",
                   ["assert word_count('a  b') == 2"],
                   [(("a  b",), 2), (("",), 0), (("one",), 1)]),
    "chunk": ("listx", "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n",
              ("    return [xs[i:i + n] for i in range(0, len(xs) - n, n)]",
               "    return [xs[i:i + n] for i in range(0, len(xs), n)]"),
              "chunk([1, 2, 3], 2) should be [[1, 2], [3]]",
              ["assert chunk([1, 2, 3], 2) == [[1, 2], [3]]"],
              [(([1, 2, 3], 2), [[1, 2], [3]]), (([], 3), []), (([1, 2], 2), [[1, 2]])]),
    "dedupe": ("listx", "def dedupe(xs):\n    seen = []\n    for x in xs:\n        if x not in seen:\n"
                        "            seen.append(x)\n    return seen\n",
               ("        if x in seen:", "        if x not in seen:"),
               "dedupe([1, 1, 2]) should be [1, 2]",
               ["assert dedupe([1, 1, 2]) == [1, 2]"],
               [(([1, 1, 2],), [1, 2]), (([],), []), (([3, 2, 3],), [3, 2])]),
}


def _module_source(funcs: list[str], bugs: set[str]) -> str:
    parts = []
    for f in funcs:
        src = FUNCS[f][1]
        if f in bugs:
            bad, good = FUNCS[f][2]
            src = src.replace(good, bad, 1)
        parts.append(src)
    return "\n\n".join(parts)


def _tests(module_funcs: dict[str, list[str]]) -> dict[str, str]:
    """The visible pytest files, one per module."""
    out = {}
    for mod, fs in module_funcs.items():
        body = [f"from pkg.{mod} import {', '.join(fs)}\n"]
        for f in fs:
            for i, line in enumerate(FUNCS[f][4]):
                body.append(f"\ndef test_{f}_{i}():\n    {line}\n")
        out[f"test_{mod}.py"] = "".join(body)
    return out


class FixBug(Family):
    """A small package with injected bugs; fix them so hidden calls of its functions return the right values."""

    name, domain, tiny = "fix-bug", "code", False
    tools = ("ls", "read", "replace", "write", "pytest", "python")
    essential = ("replace|write", "read")
    forbidden = ("tests/",)
    horizon = (1, 5)

    def max_turns(self, knobs: dict[str, Any]) -> int:
        return 5 * knobs["horizon"] + 8

    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        names = sorted(rng.sample(sorted(FUNCS), max(4, knobs["horizon"] + 1)))
        bugs = set(rng.sample(names, knobs["horizon"]))
        by_mod: dict[str, list[str]] = {}
        for f in names:
            by_mod.setdefault(FUNCS[f][0], []).append(f)
        files = {"pkg/__init__.py": ""}
        for mod, fs in by_mod.items():
            files[f"pkg/{mod}.py"] = _module_source(fs, bugs)
        files.update({f"tests/{k}": v for k, v in _tests(by_mod).items()})
        symptoms = "; ".join(FUNCS[f][3] for f in sorted(bugs))
        instr = (f"Tests of the package in pkg/ fail: {symptoms}. Fix the code in pkg/ so that all tests pass "
                 "(there are more tests than the ones in tests/). Do not edit the tests.")
        return Sampled(instr, files, {"functions": by_mod, "bugs": sorted(bugs)})

    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        calls, returns = [], []
        for mod, fs in sorted(hidden["functions"].items()):
            for f in fs:
                for args, want in FUNCS[f][5]:
                    calls.append({"module": f"pkg.{mod}", "fn": f, "args": list(args)})
                    returns.append(want)
        visible = {p: _sha(c) for p, c in task.files.items() if p.startswith("tests/")}
        return Verifier(checks=[Check(kind="calls", name="hidden calls", calls=calls, returns=returns),
                                Check(kind="unchanged", name="tests untouched", hashes=visible)])

    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        acts = [Action("ls", {})]
        for mod, fs in sorted(hidden["functions"].items()):
            buggy = [f for f in fs if f in hidden["bugs"]]
            if not buggy:
                continue
            acts.append(Action("read", {"path": f"pkg/{mod}.py"}))
            for f in buggy:
                bad, good = FUNCS[f][2]
                acts.append(Action("replace", {"path": f"pkg/{mod}.py", "old": bad, "new": good}))
        return acts


# ---- slow-stage (ML infra) -----------------------------------------------------------------------------
STAGES = ["read", "decode", "resize", "augment", "tokenize", "collate", "transfer"]


class SlowStage(Family):
    """profile.log shows per-stage milliseconds of a data pipeline; raise the workers of the bottleneck
    stages in pipeline.cfg so sim.py meets the step budget, without touching the other stages."""

    name, domain, tiny = "slow-stage", "code", False
    tools = ("ls", "read", "replace", "write", "python")
    essential = ("read", "replace|write")
    forbidden = ("sim.py", "profile.log")
    horizon = (1, 4)
    MAX_WORKERS = 8

    def max_turns(self, knobs: dict[str, Any]) -> int:
        return 3 * knobs["horizon"] + 8

    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        stages = rng.sample(STAGES, 5)
        workers = {s: rng.choice([1, 2]) for s in stages}
        base = {s: rng.randint(5, 25) * workers[s] for s in stages}  # fast stages: 5-25 ms per step
        slow = rng.sample(stages, knobs["horizon"])
        need = {}
        for s in slow:
            need[s] = rng.randint(3, self.MAX_WORKERS)  # workers that bring this stage to ~25-30 ms
            base[s] = rng.randint(25, 30) * need[s]
        budget = sum(base[s] / (need.get(s) or workers[s]) for s in stages) + 5
        cur = sum(base[s] / workers[s] for s in stages)
        log = ["# step profile (ms per stage, 3 steps)"]
        for step in range(3):
            log += [f"step={step} stage={s} ms={base[s] / workers[s] * rng.uniform(0.97, 1.03):.1f}" for s in stages]
        cfg = "".join(f"{s}_workers: {workers[s]}\n" for s in stages)
        sim = (
            "# Simulated step time of the data pipeline for pipeline.cfg.\n"
            f"BASE_MS = {json.dumps(base)}\n"
            f"BUDGET_MS = {budget:.1f}\n"
            "cfg = {}\n"
            "for line in open('pipeline.cfg'):\n"
            "    if ':' in line:\n"
            "        k, v = line.split(':')\n"
            "        cfg[k.strip().removesuffix('_workers')] = int(v)\n"
            "total = sum(ms / cfg[s] for s, ms in BASE_MS.items())\n"
            "print(f'step {total:.1f} ms, budget {BUDGET_MS} ms:', 'OK' if total < BUDGET_MS else 'TOO SLOW')\n"
        )
        files = {"profile.log": "\n".join(log) + "\n", "pipeline.cfg": cfg, "sim.py": sim}
        instr = (f"The input pipeline is too slow: a step takes {cur:.0f} ms, the budget is {budget:.0f} ms. "
                 f"profile.log shows where the time goes. Raise the workers of the slowest stage(s) in pipeline.cfg "
                 f"(at most {self.MAX_WORKERS} per stage) until `python sim.py` prints OK. Leave other stages as they are.")
        return Sampled(instr, files, {"base": base, "workers": workers, "slow": slow, "need": need,
                                      "budget": round(budget, 1)})

    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        code = (
            f"base = {json.dumps(hidden['base'])}\n"
            f"orig = {json.dumps(hidden['workers'])}\n"
            f"budget = {hidden['budget']}\n"
            f"cap = {self.MAX_WORKERS}\n"
            "cfg = {}\n"
            "try:\n"
            "    for line in open('pipeline.cfg'):\n"
            "        if line.strip():\n"
            "            k, v = line.split(':')\n"
            "            cfg[k.strip().removesuffix('_workers')] = int(v)\n"
            "except Exception as e:\n"
            "    emit({'pass': False, 'detail': f'pipeline.cfg unreadable: {e}'})\n"
            "else:\n"
            "    if set(cfg) != set(base) or any(not 1 <= w <= cap for w in cfg.values()):\n"
            "        emit({'pass': False, 'detail': f'bad stages or workers: {cfg}'})\n"
            "    else:\n"
            "        total = sum(ms / cfg[s] for s, ms in base.items())\n"
            f"        slow = {json.dumps(sorted(hidden['slow']))}\n"
            "        touched = [s for s in cfg if cfg[s] != orig[s]]\n"
            "        fast = [s for s in touched if s not in slow]\n"
            "        ok = total < budget and not fast\n"
            "        emit({'pass': ok, 'detail': f'step {total:.1f} ms vs {budget}; changed {touched}'})\n"
        )
        pinned = {p: _sha(task.files[p]) for p in ("sim.py", "profile.log")}
        return Verifier(checks=[Check(kind="python", name="re-run step model", code=code),
                                Check(kind="unchanged", name="sim and profile untouched", hashes=pinned)])

    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        acts = [Action("read", {"path": "profile.log"}), Action("read", {"path": "pipeline.cfg"})]
        for s in hidden["slow"]:
            acts.append(Action("replace", {"path": "pipeline.cfg", "old": f"{s}_workers: {hidden['workers'][s]}",
                                           "new": f"{s}_workers: {hidden['need'][s]}"}))
        return acts

    def corrupt(self, act: Action, rng: random.Random) -> Action:
        if act.tool == "replace":  # raise the workers too little to meet the budget
            old = act.args["old"]
            return Action("replace", {**act.args, "new": old})
        return super().corrupt(act, rng)
