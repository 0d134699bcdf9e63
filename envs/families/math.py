"""Math families: a chain of calculator steps (tiny) and multi-step word problems with a calculator."""

from __future__ import annotations

import random
from typing import Any

from ..actions import Action
from ..spec import Check, PublicTask, Verifier
from .base import Family, Sampled

OPS = {"add": ("+", "add {n}"), "sub": ("-", "subtract {n}"), "mul": ("*", "multiply by {n}")}


def _apply(v: int, op: str, n: int) -> int:
    return v + n if op == "add" else v - n if op == "sub" else v * n


class CalcChain(Family):
    """Start from a number and apply 1-4 operations with the calculator, then submit."""

    name, domain, tiny = "calc-chain", "math", True
    tools = ("calc",)
    essential = ("calc",)
    horizon = (1, 16)

    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        start = rng.randint(11, 99)
        steps = []
        for _ in range(knobs["horizon"]):
            op = rng.choice(list(OPS))
            n = rng.randint(2, 9) if op == "mul" else rng.randint(11, 99)
            steps.append([op, n])
        words = ", then ".join(OPS[op][1].format(n=n) for op, n in steps)
        instr = f"Use calc. Start with {start}, {words}. Submit the result."
        return Sampled(instr, {}, {"start": start, "steps": steps})

    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        v = hidden["start"]
        for op, n in hidden["steps"]:
            v = _apply(v, op, n)
        return Verifier(checks=[Check(kind="answer", name="result", expected=str(v), normalize="number")])

    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        v, acts = hidden["start"], []
        for op, n in hidden["steps"]:
            acts.append(Action("calc", {"expr": f"{v}{OPS[op][0]}{n}"}))
            v = _apply(v, op, n)
        return acts + [Action("submit", {"answer": str(v)})]

    def sloppy(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        """Stops one operation early: the calls before the last, then submits the value it has."""
        acts = self.solve(task, hidden)[:-2]
        v = hidden["start"]
        for op, n in hidden["steps"][:-1]:
            v = _apply(v, op, n)
        return acts + [Action("submit", {"answer": str(v)})]


ITEMS = [("pen", 3), ("notebook", 7), ("ruler", 2), ("stapler", 12), ("folder", 4), ("marker", 5),
         ("lamp", 19), ("mug", 8)]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Emil", "Femi"]


class WordProblem(Family):
    """A shopping problem: several items × quantities, an optional discount, change from a bill."""

    name, domain, tiny = "word-problem", "math", False
    tools = ("calc",)
    essential = ("calc",)
    horizon = (1, 6)

    def max_turns(self, knobs: dict[str, Any]) -> int:
        return 3 * knobs["horizon"] + 8

    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        items = rng.sample(ITEMS, knobs["horizon"])
        qty = [rng.randint(2, 9) for _ in items]
        who = rng.choice(NAMES)
        discount = rng.choice([0, 0, 10, 20]) if knobs["horizon"] > 1 else 0
        total = sum(q * p for q, (_, p) in zip(qty, items))
        after = total * (100 - discount) // 100 if discount else total
        bill = next(b for b in (20, 50, 100, 200, 500) if b > after)
        prices = "; ".join(f"a {n} costs ${p}" for n, p in items)
        buys = ", ".join(f"{q} {n}s" for q, (n, _) in zip(qty, items))
        disc = f" The shop takes {discount}% off the whole purchase (round down to whole dollars)." if discount else ""
        instr = (f"At a shop {prices}. {who} buys {buys}.{disc} {who} pays with a ${bill} bill. "
                 "How many dollars of change? Submit the number.")
        return Sampled(instr, {}, {"items": [[n, p] for n, p in items], "qty": qty, "discount": discount,
                                   "bill": bill})

    @staticmethod
    def _answer(h: dict[str, Any]) -> int:
        total = sum(q * p for q, (_, p) in zip(h["qty"], h["items"]))
        if h["discount"]:
            total = total * (100 - h["discount"]) // 100
        return h["bill"] - total

    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        return Verifier(checks=[Check(kind="answer", name="change", expected=str(self._answer(hidden)),
                                      normalize="number")])

    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        acts, parts = [], []
        for q, (_, p) in zip(hidden["qty"], hidden["items"]):
            acts.append(Action("calc", {"expr": f"{q}*{p}"}))
            parts.append(q * p)
        total = sum(parts)
        if len(parts) > 1:
            acts.append(Action("calc", {"expr": "+".join(map(str, parts))}))
        if hidden["discount"]:
            acts.append(Action("calc", {"expr": f"{total}*{100 - hidden['discount']}//100"}))
            total = total * (100 - hidden["discount"]) // 100
        acts.append(Action("calc", {"expr": f"{hidden['bill']}-{total}"}))
        return acts + [Action("submit", {"answer": str(self._answer(hidden))})]
