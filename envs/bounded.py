"""Parsing what an agent produced, within bounds: every text from an agent (a tool call, a verdict line printed where
its code ran) is checked for size, nesting depth and encoding before the host parses it, so no input can make a
host-side parse raise (a deeply nested JSON document exhausts `json.loads`'s recursion; a lone surrogate or a NUL
byte makes `exec` and `str.encode` raise) or take unbounded time.

    loads(text, max_chars=..., max_depth=...)   -> the JSON value, or raises BoundsError (a ValueError)
    check_text(s, what)                         -> s, or raises BoundsError for NUL bytes and lone surrogates
"""

from __future__ import annotations

import json

MAX_DEPTH = 32  # deeper than any verdict or tool call temper writes (a type-tagged value is capped at 32 too)


class BoundsError(ValueError):
    """The text is too long, too deep or badly encoded to be parsed; the message says which."""


def depth(text: str) -> int:
    """The deepest nesting of JSON arrays and objects in `text` (brackets inside strings not counted), in one
    pass without recursion."""
    deepest = level = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    return deepest


def loads(text: str, max_chars: int, max_depth: int = MAX_DEPTH):
    """`json.loads(text)` for text of at most `max_chars` characters nested at most `max_depth` deep."""
    if len(text) > max_chars:
        raise BoundsError(f"{len(text)} characters, more than {max_chars}")
    d = depth(text)
    if d > max_depth:
        raise BoundsError(f"nested {d} deep, more than {max_depth}")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError cannot happen below max_depth; kept as a backstop
        raise BoundsError(f"not valid JSON ({str(e)[:80]})") from None
    _no_surrogates(value)
    return value


def _no_surrogates(value) -> None:
    """BoundsError if a string in `value` (keys included) holds a lone surrogate (JSON's \\udXXX escapes decode to
    them): such a string cannot be encoded, stored or logged downstream. Walked with a stack."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            check_text(v.replace("\x00", ""), "a string")
        elif isinstance(v, dict):
            todo += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            todo += v


def check_text(s: str, what: str) -> str:
    """`s` if it can be passed to a process (UTF-8 encodable, no NUL byte); BoundsError naming `what` otherwise."""
    if "\x00" in s:
        raise BoundsError(f"{what} contains a NUL byte")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BoundsError(f"{what} is not valid UTF-8 (a lone surrogate at {e.start})") from None
    return s
