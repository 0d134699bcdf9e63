"""Byte-level pretraining data for the base recipe: synthetic recall and copy sequences.

The task distribution's actions mostly copy: a value read from a file into `submit`, numbers from the prompt
into `calc`, a result from an observation into the next call. Oracle trajectories carry only a few copied
tokens each (about 3 of ~150), so a small model trained on them alone learns the formats long before it
learns to copy (the held-out pass@1 of kv-lookup and calc-chain stayed at 0.00 after 1,400 steps, with
90% of tokens right and the misses all copied digits). These sequences are dense in exactly that skill:

* **recall** — `ant=245 bee=913 cat=77\\nbee?913\\nant?245\\n`: an associative lookup, the values trained;
* **echo** — `say 4821 7 → 4821 7`: copy a span verbatim, the copy trained;
* **bind** — the environments' own instruction phrasing with 2–4 items (`set RATE (now 4) to 1 and DEPTH (now 3) to
  4.`, `Start with 39, multiply by 6, then add 90.`), then every item asked for by name or place in random order
  (`DEPTH: 3 -> 4`, `step 2: add 90`), the values trained: picking the right value among several, which the
  tiny base misses on the second constant of a two-constant edit and on a chain's later operands.

A pattern named `synth:recall` or `synth:echo` in `base.curriculum` draws from these instead of from
environments. The data are a pure function of (kind, n, seed): no files, nothing downloaded.
"""

from __future__ import annotations

import random

from envs.families.code import CONSTS
from envs.families.math import OPS
from model.tokenizer import Tokenizer
from rollout.types import Segment

KINDS = ("recall", "echo", "bind")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 4)))


def _number(rng: random.Random) -> str:
    return str(rng.randint(0, 10 ** rng.randint(1, 4) - 1))


def _segment(parts: list[tuple[str, bool]], tok: Tokenizer) -> Segment:
    ids: list[int] = []
    mask: list[bool] = []
    for text, train in parts:
        t = tok.encode(text)
        ids += t
        mask += [train] * len(t)
    n = len(ids)
    return Segment(ids, mask, [0.0] * n, [-1] * n)


def recall(rng: random.Random, tok: Tokenizer) -> Segment:
    """2–5 `key=value` pairs, then 2–4 queries `key?` whose value (and newline) is the target."""
    pairs: dict[str, str] = {}
    n = rng.randint(2, 5)
    while len(pairs) < n:
        pairs.setdefault(_key(rng), _number(rng))
    keys = list(pairs)
    parts = [(" ".join(f"{k}={pairs[k]}" for k in keys) + "\n", False)]
    for k in rng.sample(keys, min(len(keys), rng.randint(2, 4))):
        parts += [(f"{k}?", False), (f"{pairs[k]}\n", True)]
    return _segment(parts, tok)


def echo(rng: random.Random, tok: Tokenizer) -> Segment:
    """A number (sometimes two, or a word) after a little filler half the time, then the same span again as the
    target. (Copying a span from a fixed place first: with 0–6 filler words from the start, a from-scratch tiny
    model stayed at chance for 450 steps; without filler it copied 82% of digits by step 200.)"""
    span = " ".join(_number(rng) if rng.random() < 0.8 else _key(rng) for _ in range(rng.choice((1, 1, 2))))
    filler = " ".join(_key(rng) for _ in range(rng.randint(1, 3))) if rng.random() < 0.5 else ""
    return _segment([(f"{filler} say {span}.\n" if filler else f"say {span}.\n", False), (f"{span}\n", True)], tok)


def bind(rng: random.Random, tok: Tokenizer) -> Segment:
    """2–4 items in an environment's phrasing, then each asked for in random order with its values as the target."""
    n = rng.randint(2, 4)
    if rng.random() < 0.5:
        names = rng.sample(CONSTS, n)
        now = {k: rng.randint(1, 9) for k in names}
        to = {k: rng.choice([v for v in range(1, 10) if v != now[k]]) for k in names}
        parts = [("set " + " and ".join(f"{k} (now {now[k]}) to {to[k]}" for k in names) + ".\n", False)]
        for k in rng.sample(names, n):
            parts += [(f"{k}:", False), (f" {now[k]} -> {to[k]}\n", True)]
    else:
        start = rng.randint(2, 99)
        steps = [(rng.choice(list(OPS)), rng.randint(2, 99)) for _ in range(n)]
        said = ", then ".join(OPS[op][1].format(n=x) for op, x in steps)  # calc-chain's own phrasing
        parts = [(f"Start with {start}, {said}.\n", False)]
        asks = [("start", str(start))] + [(f"step {i + 1}", f"{op} {x}") for i, (op, x) in enumerate(steps)]
        for q, a in rng.sample(asks, len(asks)):
            parts += [(f"{q}:", False), (f" {a}\n", True)]
    return _segment(parts, tok)


def synthetic_segments(kind: str, n: int, seed: int, tok: Tokenizer) -> list[Segment]:
    """`n` sequences of `kind` (one of KINDS), a pure function of (kind, n, seed)."""
    if kind not in KINDS:
        raise ValueError(f"base.curriculum: unknown synthetic pattern 'synth:{kind}' (have: "
                         f"{', '.join('synth:' + k for k in KINDS)})")
    make = {"recall": recall, "echo": echo, "bind": bind}[kind]
    rng = random.Random(f"synth:{kind}:{seed}")
    return [make(rng, tok) for _ in range(n)]
