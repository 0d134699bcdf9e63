"""Reasoning families: key lookups through files (tiny) and multi-hop questions over tables."""

from __future__ import annotations

import random
from typing import Any

from ..actions import Action
from ..spec import Check, PublicTask, Verifier
from .base import Family, Sampled

WORDS = ["gem", "key", "map", "cup", "hat", "pen", "box", "owl", "fox", "jar", "kit", "log", "net", "orb", "rug",
         "saw", "tin", "urn", "van", "wax", "ant", "bee", "cod", "dye", "elk", "fig", "gnu", "hen", "ink", "jet",
         "kiwi", "lamp", "mole", "nut", "oak", "pea", "quay", "ram", "sun", "toy"]


class KVLookup(Family):
    """box*.txt files hold `key=value` lines (`keys` per file, default 3); a value may point on with
    `->FILE:KEY`. Submit the value."""

    name, domain, tiny = "kv-lookup", "reasoning", True
    tools = ("read", "ls")
    essential = ("read",)
    horizon = (1, 8)

    def knobs(self, rng: random.Random, knobs: dict[str, Any] | None) -> dict[str, Any]:
        k = super().knobs(rng, knobs)
        k.setdefault("keys", 3)
        if not (isinstance(k["keys"], int) and 1 <= k["keys"] <= 6):
            raise ValueError(f"{self.name}: knob keys={k['keys']!r} outside [1, 6] (key=value lines per file)")
        return k

    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        hops = knobs["horizon"]
        n_files = hops + 2
        names = [f"box{i}.txt" for i in range(1, n_files + 1)]
        keys = rng.sample(WORDS, knobs.get("keys", 3) * n_files)
        table: dict[str, dict[str, str]] = {f: {} for f in names}
        for i, k in enumerate(keys):
            table[names[i % n_files]][k] = str(rng.randint(100, 999))
        chain_files = rng.sample(names, hops)
        chain_keys = [rng.choice(sorted(table[f])) for f in chain_files]
        for j in range(hops - 1):  # link the chain
            table[chain_files[j]][chain_keys[j]] = f"->{chain_files[j + 1]}:{chain_keys[j + 1]}"
        files = {f: "".join(f"{k}={v}\n" for k, v in sorted(table[f].items())) for f in names}
        instr = (f"Find the value of {chain_keys[0]} in {chain_files[0]} and submit it. "
                 "A value ->FILE:KEY means: look up KEY in FILE instead.")
        return Sampled(instr, files, {"table": table, "start": [chain_files[0], chain_keys[0]]})

    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        f, k = hidden["start"]
        v = hidden["table"][f][k]
        for _ in range(len(hidden["table"])):
            if not v.startswith("->"):
                break
            f, k = v[2:].split(":")
            v = hidden["table"][f][k]
        return Verifier(checks=[Check(kind="answer", name="value", expected=v, normalize="strip")])

    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        f, k = hidden["start"]
        acts = []
        while True:
            acts.append(Action("read", {"path": f}))
            v = hidden["table"][f][k]
            if not v.startswith("->"):
                return acts + [Action("submit", {"answer": v})]
            f, k = v[2:].split(":")

    def sloppy(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        """Stops at the first file: submits the value found there, a `->FILE:KEY` pointer included (the oracle's
        own solution when the chain has one hop)."""
        f, k = hidden["start"]
        return [Action("read", {"path": f}), Action("submit", {"answer": hidden["table"][f][k]})]


PEOPLE = ["ana", "ben", "cho", "dev", "eli", "fen", "gia", "hugo", "ivy", "jon", "kai", "lea", "max", "nia"]
TEAMS = ["atlas", "boreal", "cinder", "delta", "ember", "fjord"]
OFFICES = ["north wing", "south wing", "annex", "tower", "lab 2", "loft"]
CITIES = ["oslo", "lima", "kyoto", "quito", "perth", "turin"]


class MultiHop(Family):
    """Chained lookups across four tables with distractors: person → team → lead → office → city."""

    name, domain, tiny = "multihop", "reasoning", False
    tools = ("ls", "read")
    essential = ("read",)
    horizon = (1, 4)
    QUESTIONS = {
        1: "Which team is {p} on?",
        2: "Who leads the team that {p} is on?",
        3: "In which office does the lead of {p}'s team sit?",
        4: "In which city is the office of the lead of {p}'s team?",
    }

    def sample(self, rng: random.Random, knobs: dict[str, Any]) -> Sampled:
        people = rng.sample(PEOPLE, 10)
        teams = rng.sample(TEAMS, 5)
        leads = rng.sample([p for p in PEOPLE if p not in people[:4]], 5)
        offices = rng.sample(OFFICES, 5)
        cities = [rng.choice(CITIES) for _ in offices]
        team_of = {p: rng.choice(teams) for p in people}
        lead_of = dict(zip(teams, leads))
        office_of = {lead: rng.choice(offices) for lead in leads}
        city_of = dict(zip(offices, cities))
        p = people[0]
        files = {
            "people.txt": "".join(f"{x}: team {team_of[x]}\n" for x in sorted(people)),
            "teams.txt": "".join(f"team {t}: lead {lead_of[t]}\n" for t in sorted(teams)),
            "desks.txt": "".join(f"{x}: {office_of[x]}\n" for x in sorted(leads)),
            "sites.txt": "".join(f"{o}: {city_of[o]}\n" for o in sorted(offices)),
        }
        instr = (self.QUESTIONS[knobs["horizon"]].format(p=p) + " The answer is in the workspace files; "
                 "submit just the name.")
        return Sampled(instr, files, {"person": p, "team_of": team_of, "lead_of": lead_of,
                                      "office_of": office_of, "city_of": city_of, "hops": knobs["horizon"]})

    @staticmethod
    def _chain(hidden: dict[str, Any]) -> list[str]:
        team = hidden["team_of"][hidden["person"]]
        lead = hidden["lead_of"][team]
        office = hidden["office_of"][lead]
        return [team, lead, office, hidden["city_of"][office]][: hidden["hops"]]

    def build_verifier(self, task: PublicTask, hidden: dict[str, Any]) -> Verifier:
        ans = self._chain(hidden)[-1]
        return Verifier(checks=[Check(kind="answer", name="answer", expected=ans, normalize="casefold")])

    def solve(self, task: PublicTask, hidden: dict[str, Any]) -> list[Action]:
        files = ["people.txt", "teams.txt", "desks.txt", "sites.txt"][: hidden["hops"]]
        return [Action("read", {"path": f}) for f in files] + [Action("submit", {"answer": self._chain(hidden)[-1]})]

    def corrupt(self, act: Action, rng: random.Random) -> Action:
        if act.tool == "submit":
            wrong = [x for x in OFFICES + CITIES + TEAMS + PEOPLE if x != act.args["answer"]]
            return Action("submit", {"answer": rng.choice(wrong)})
        return super().corrupt(act, rng)
