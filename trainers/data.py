"""Token batches for the LM trainer, and a small generated corpus for smoke runs and learning tests."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator

import torch

_NAMES = ["ada", "bo", "cy", "di", "eve", "fay", "gus", "hal"]
_ITEMS = ["apple", "book", "coin", "drum", "egg", "flag", "gem", "hat"]
_PLACES = ["attic", "barn", "cave", "dock", "farm", "garden"]
_VERBS = ["keeps", "hides", "finds", "drops"]


def generated_corpus(n_lines: int, seed: int = 0) -> str:
    """Short templated facts with a little state: an item mentioned in a fact is asked about later, so
    predicting the answer needs attention back over the line, not only local statistics."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        who, item, place = rng.choice(_NAMES), rng.choice(_ITEMS), rng.choice(_PLACES)
        verb = rng.choice(_VERBS)
        lines.append(f"{who} {verb} the {item} in the {place}. where is the {item}? the {place}.")
    return "\n".join(lines) + "\n"


def unigram_entropy(ids: list[int]) -> float:
    """Entropy (nats) of the token unigram distribution: the loss of the best context-free model."""
    counts = Counter(ids)
    n = len(ids)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def lm_batches(ids: list[int], seq_len: int, batch_size: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, None]]:
    """Endless random windows of `seq_len` tokens from one token stream (no mask: every token trains)."""
    data = torch.tensor(ids, dtype=torch.long)
    if len(data) <= seq_len:
        raise ValueError(f"corpus of {len(data)} tokens is shorter than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=g)
        yield torch.stack([data[s : s + seq_len] for s in starts.tolist()]), None


_KEYS = ["ink", "cup", "map", "gem", "hat", "owl", "fox", "jar", "kit", "log", "net", "oak", "pea", "ram", "sun", "toy"]
_CONSTS = ["RATE", "SIZE", "LIMIT", "DEPTH", "WIDTH", "RETRIES", "BATCH", "STEPS"]
_OPS = [("add", "+"), ("subtract", "-"), ("multiply by", "*")]


def copy_corpus(n_lines: int, seed: int = 0) -> str:
    """A pretraining corpus of lookup and copy patterns — the skills agent tasks are made of (find a key's
    value in a listing, carry numbers and names from a sentence into a call, repeat the latest result) —
    in free text, not in the tool-call format and not from any task family's generator."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.randrange(4)
        if kind == 0:
            keys = rng.sample(_KEYS, 3)
            vals = [str(rng.randint(100, 999)) for _ in keys]
            k = rng.randrange(3)
            f = f"box{rng.randint(1, 9)}.txt"
            listing = " ".join(f"{a}={b}" for a, b in zip(keys, vals))
            lines.append(f"in {f}: {listing}. so {keys[k]} in {f} is {vals[k]}.")
        elif kind == 1:
            a, b = rng.randint(11, 99), rng.randint(2, 99)
            word, sym = rng.choice(_OPS)
            lines.append(f"start with {a}, {word} {b}: that is {a}{sym}{b}.")
        elif kind == 2:
            c = rng.choice(_CONSTS)
            old, new = rng.sample(range(1, 10), 2)
            lines.append(f"set {c} (now {old}) to {new}: change '{c} = {old}' into '{c} = {new}'.")
        else:
            v = rng.randint(-99, 9999)
            lines.append(f"the result was {v}. the answer is {v}.")
    return "\n".join(lines) + "\n"
