"""Knobs of environment generation and validation for one iteration."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class CurriculumConfig(BaseModel):
    """The RL set's pattern mix, chosen each iteration from what the policy it trains can do (`stages/curriculum.py`):
    the policy iteration N starts from samples `probe_samples` episodes on each of `probe_tasks` fresh tasks of every
    pattern of `envs.rl_patterns` (the ladder), and the RL set's `n_rl` tasks go to the patterns whose samples both
    succeed and fail, in proportion to that signal. A pattern it solves (sampled success ≥ `saturated`) gives way to
    the next rung; one it never solves gets `frontier_share` of the set when it is the first unsolved rung above a
    rung with signal, else nothing. Off: the RL set cycles `envs.rl_patterns` evenly."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    probe_tasks: int = Field(default=10, ge=2)
    probe_samples: int = Field(default=2, ge=2)  # per task: 2 tells whether a task's samples disagree
    saturated: float = Field(default=0.9, gt=0.0, le=1.0)
    frontier_share: float = Field(default=0.05, ge=0.0, le=0.5)
    min_tasks: int = Field(default=4, ge=1)  # a chosen pattern gets at least this many of the RL set's tasks
    # a saturated rung keeps this many of the RL set's tasks (0: it gives way entirely). Where its warm rollouts earn
    # one reward (`sao.constant_pattern_min` of them at least, `sao.constant_pattern_share`) an expert leaves it out of
    # its SAO steps and, with `sao.replay_coef` > 0, anchors on them; otherwise it trains on it like any rung. Against
    # forgetting a rung that gave way; on tiny it changed nothing measurable (docs: benchmarks, #async-chain)
    retain_tasks: int = Field(default=0, ge=0)


class EnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    patterns: list[str] = Field(default_factory=lambda: ["kv-lookup", "calc-chain", "set-const"])
    # held-out patterns; empty: the training patterns (a curriculum may train on easier variants)
    eval_patterns: list[str] = Field(default_factory=list)
    # patterns of the RL set; empty: the training patterns
    rl_patterns: list[str] = Field(default_factory=list)
    n_train: int = Field(default=240, ge=0)
    n_eval: int = Field(default=30, ge=0)
    # fresh environments for RL (rollouts, SAO experts, OPD), gated like the SFT set but never in it: on
    # environments SFT has memorised, RL reinforces remembered answers instead of the skill. 0: RL reuses
    # the SFT set.
    n_rl: int = Field(default=0, ge=0)
    # validation tasks of the held-out patterns, fresh every iteration and never one of the held-out tasks: OPD
    # checks each domain expert against the warm start on them before it teaches (`opd.gate_teachers`), so model
    # selection never reads the held-out set. 0: no validation set
    n_val: int = Field(default=0, ge=0)
    seed: int = 0
    eval_seed: int = 10_007
    rl_seed: int = 20_011
    val_seed: int = 30_013
    sandbox: Literal["auto", "bwrap", "docker", "unsafe-subprocess"] = "auto"
    probes: bool = True
    mine_every: int = Field(default=1, gt=0)  # the trajectory miner reads every k-th rewarded rollout (1: all)
    probe_every: int = Field(default=1, gt=0)  # hack-probe every k-th environment (1: all); the triad runs on all
    validate_workers: int = Field(default=4, gt=0)  # environments validated at once (probes mostly wait on limits)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)

    @field_validator("patterns", "eval_patterns", "rl_patterns")
    @classmethod
    def _patterns_make_tasks(cls, v: list[str]) -> list[str]:
        """Each pattern names a family with valid knobs: one task is drawn from it at config time."""
        from .generator import generate

        for p in v:
            try:
                generate([p], 1)
            except (KeyError, ValueError) as e:
                raise ValueError(f"pattern {p!r}: {str(e).strip(chr(34) + chr(39))}") from None
        return v

    @model_validator(mode="after")
    def _curriculum_fits(self) -> EnvConfig:
        """The curriculum can always share the RL set out: every fixed share (frontier_share of the set each) and every
        signal pattern's min_tasks (or retained rung's retain_tasks) fit, whatever the probe finds. Refused at launch,
        naming the key."""
        cc = self.curriculum
        if not (cc.enabled and self.n_rl):
            return self
        n_pat = len(self.rl_source_patterns)
        if cc.frontier_share * n_pat >= 1:
            raise ValueError(f"envs.curriculum.frontier_share = {cc.frontier_share}: {n_pat} patterns could take "
                             f"{cc.frontier_share * n_pat:.2f} of the RL set; it must be below 1 / {n_pat}")
        need = max(cc.min_tasks, cc.retain_tasks) * n_pat / (1 - cc.frontier_share * n_pat)
        if self.n_rl < need - 1e-9:
            raise ValueError(f"envs.n_rl = {self.n_rl} is too small for the curriculum over {n_pat} patterns: at least "
                             f"{math.ceil(need - 1e-9)} (envs.curriculum.min_tasks = {cc.min_tasks}, retain_tasks = "
                             f"{cc.retain_tasks}, frontier_share = {cc.frontier_share}), or envs.curriculum.enabled = false")
        return self

    @property
    def rl_source(self) -> tuple[int, int]:
        """(count, seed) of the environments RL trains in: the RL set, or the SFT set when there is none."""
        return (self.n_rl, self.rl_seed) if self.n_rl else (self.n_train, self.seed)

    @property
    def rl_source_patterns(self) -> list[str]:
        return (self.rl_patterns or self.patterns) if self.n_rl else self.patterns

    @property
    def held_out_patterns(self) -> list[str]:
        return self.eval_patterns or self.patterns
