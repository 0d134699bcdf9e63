"""The HTTP server's request bodies (pydantic, unknown fields refused) and field parsers: split out of
rollout/server.py."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(default=0, ge=0, le=0)
    stream: bool = False
    rid: str | list[str] | None = None
    session_id: str | None = None
    routing_key: str | None = None
    # Fields real SGLang accepts (sglang-router forwards them): harmless ones are accepted, features this
    # engine lacks are refused when switched on.
    model: str | None = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    no_logs: bool = False
    return_bytes: bool = False
    return_hidden_states: bool = False
    return_entropy: bool = False
    background: bool = False


UNSUPPORTED_FLAGS = ("return_hidden_states", "return_entropy", "background", "return_bytes")


class UpdateFromDisk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str
    weight_version: Any = None  # checked by parse_version (a bool or float is refused there, not coerced)
    verify: StrictBool = True  # false: load a checkpoint that records no checksums (trusted by the caller, logged)
    abort_all_requests: bool = False
    flush_cache: bool = False
    load_format: str | None = None


class UpdateFromTensor(BaseModel):
    model_config = ConfigDict(extra="forbid")

    serialized_named_tensors: str  # base64 of a safetensors blob
    weight_version: Any = None  # checked by parse_version (a bool or float is refused there, not coerced)
    flush_cache: bool = False
    abort_all_requests: bool = False


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    n: int = Field(default=1, ge=1, le=1)
    session_id: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str


class ChatBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    stop: str | list[str] | None = None
    stream: bool = False
    logprobs: bool = False
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    n: int = Field(default=1, ge=1, le=1)
    session_id: str | None = None
    response_format: dict | None = None  # only {"type": "text"}: no constrained decoding here (see chat handler)


def parse_version(v) -> int | None:
    """A weight version from JSON: an integer in [0, 2**31) or its decimal string; None for anything else (floats,
    booleans, 1e999 — which JSON decodes to inf, once a 500 here; negatives: -1 means "no version" in the store;
    2**31 and above: the store keeps versions as int32)."""
    if isinstance(v, str) and v.strip().isdigit() and len(v.strip()) <= 12:
        v = int(v.strip())
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**31:
        return None
    return v
