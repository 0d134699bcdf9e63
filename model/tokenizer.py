"""Tokenizers and the chat template for agent turns.

`ByteTokenizer` needs no files: ids 0..255 are bytes, then special tokens for roles and tool calls
(named as in GLM's chat format). `HFTokenizer` wraps a `tokenizers` tokenizer.json for real
checkpoints and exposes the same interface. `ChatTemplate` renders messages to token ids plus a loss
mask that is true exactly on the assistant's own tokens (content and its end marker).

Rendered layout of one turn:  <|role|> content <|end|>   (the assistant's <|end|> is its stop token;
`add_generation_prompt` ends the ids with <|assistant|>). Tool calls inside assistant content are
written <tool_call>…</tool_call>; environment replies use the `observation` role.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

ROLES = ("system", "user", "assistant", "observation")
SPECIAL_TOKENS = (
    "<|pad|>",
    "<|endoftext|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|end|>",
    "<tool_call>",
    "</tool_call>",
    "<|summary|>",
)


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int

    def encode(self, text: str, allow_special: bool = False) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str: ...
    def special(self, token: str) -> int: ...


class ByteTokenizer:
    """Bytes 0..255 + special tokens; vocab padded to a multiple of 16."""

    def __init__(self, extra_special: Sequence[str] = ()):
        self.specials = list(SPECIAL_TOKENS) + [t for t in extra_special if t not in SPECIAL_TOKENS]
        self._sid = {t: 256 + i for i, t in enumerate(self.specials)}
        self._by_id = {v: k for k, v in self._sid.items()}
        n = 256 + len(self.specials)
        self.vocab_size = (n + 15) // 16 * 16
        self.pad_id = self._sid["<|pad|>"]
        self.eos_id = self._sid["<|endoftext|>"]
        alts = "|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True))
        self._split = re.compile(f"({alts})")

    def special(self, token: str) -> int:
        try:
            return self._sid[token]
        except KeyError:
            raise KeyError(f"unknown special token {token!r}; known: {self.specials}") from None

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        if not allow_special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for part in self._split.split(text):
            if part in self._sid:
                ids.append(self._sid[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special:
                out.append(self._by_id.get(i, f"<|unk_{i}|>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """Adapter over a `tokenizers` tokenizer.json. Special tokens must exist in its vocabulary."""

    def __init__(self, path: str | Path, eos_token: str = "<|endoftext|>", pad_token: str | None = None):
        from tokenizers import Tokenizer as _T

        p = Path(path)
        self._tok = _T.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self.special(eos_token)
        self.pad_id = self.special(pad_token) if pad_token else self.eos_id

    def special(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
        return i

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._tok.encode(text, add_special_tokens=False).ids
        # keep special-token strings in user text literal: encode around them
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        if not specials or not any(s in text for s in specials):
            return self._tok.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pattern = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        for part in pattern.split(text):
            if not part:
                continue
            if part in specials:  # split the literal so it cannot become one special id
                ids += self._tok.encode(part[0], add_special_tokens=False).ids
                ids += self._tok.encode(part[1:], add_special_tokens=False).ids
            else:
                ids += self._tok.encode(part, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)


@dataclass
class Rendered:
    ids: list[int]
    loss_mask: list[bool]  # true on tokens the policy produced (trainable)
    turn_starts: list[int]  # index of each message's first token


class ChatTemplate:
    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.role_ids = {r: tok.special(f"<|{r}|>") for r in ROLES}
        self.end_id = tok.special("<|end|>")

    @property
    def stop_ids(self) -> list[int]:
        return [self.end_id, self.tok.eos_id]

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> Rendered:
        ids: list[int] = []
        mask: list[bool] = []
        starts: list[int] = []
        for i, msg in enumerate(messages):
            role = msg.get("role")
            if role not in self.role_ids:
                raise ValueError(f"messages[{i}].role: {role!r} is not one of {ROLES}")
            content = msg.get("content")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content: expected a string, got {type(content).__name__}")
            starts.append(len(ids))
            body = self.tok.encode(content, allow_special=(role == "assistant")) + [self.end_id]
            train = role == "assistant" and msg.get("train", True)
            ids.append(self.role_ids[role])
            mask.append(False)
            ids.extend(body)
            mask.extend([train] * len(body))
        if add_generation_prompt:
            ids.append(self.role_ids["assistant"])
            mask.append(False)
        return Rendered(ids, mask, starts)
