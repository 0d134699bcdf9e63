"""Task families, by name."""

from .base import Family, Sampled
from .code import FixBug, SetConst, SlowStage
from .math import CalcChain, WordProblem
from .reasoning import KVLookup, MultiHop

FAMILIES: dict[str, Family] = {f.name: f for f in (KVLookup(), CalcChain(), SetConst(), MultiHop(), WordProblem(),
                                                    FixBug(), SlowStage())}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown task family {name!r}; known: {', '.join(FAMILIES)}") from None


__all__ = ["FAMILIES", "Family", "Sampled", "get_family"]
