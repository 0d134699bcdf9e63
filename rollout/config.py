"""Knobs of the agent loop."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SYSTEM_PROMPT = (
    "You act through tools. Reply with exactly one tool call per turn, e.g. <tool_call>read notes.txt</tool_call>. "
    "Finish with <tool_call>submit ANSWER</tool_call> or <tool_call>done</tool_call>."
)


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_context: int = Field(default=2048, gt=64)  # tokens per segment
    max_action_tokens: int = Field(default=96, gt=0)
    max_total_tokens: int = Field(default=8192, gt=0)  # generated tokens over the whole episode
    compact_margin: int = Field(default=256, ge=0)  # compact when fewer tokens than this remain
    max_compactions: int = Field(default=3, ge=0)
    summary_tokens: int = Field(default=96, gt=0)
    max_obs_tokens: int = Field(default=512, gt=0)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    # rescore each finished segment on the engine with the trainers' own forward: the recorded log-probs are
    # then bit-identical to the trainer's on the same weights (temper's engine; SGLang is detected and skipped)
    rescore: bool = True
    system_prompt: str = SYSTEM_PROMPT
