"""The stages of one post-training iteration as plain functions (no Dagster): the assets in `assets/`
call these and record what they return as metadata. Every stage reads and writes files under the
iteration's run directory, so a stage can be re-run (or inspected) on its own. One module per stage or group of
stages; the names are re-exported here (`stages.step` and `stages.ranks` find a stage by its name here).
"""

from __future__ import annotations

from .common import (
    ITERATION_SEED_STRIDE,
    ROLLOUT_CHUNK,
    SAO_CURVES,
    WARM_VERSION,
    _backend,
    _dump,
    _no_metrics,
    _quiet,
    under_torchrun,
)
from .distill import WARM_TEACHER, opd_student, taught_domains, teacher_cell, teacher_gate
from .environments import env_specs, rl_set, verified_envs
from .evaluating import evaluation
from .experts import _mismatch_summary, _read_warm, constant_patterns, replay_ids, sao_expert, skip_reason
from .recorder import Recorder
from .rollouts import rewards, rollout_batches, trajectory_actions
from .warm import _rank_checksums, _same_model, check_base, hand_off, hand_off_of, resolve_base, warm_start

__all__ = [
    'ITERATION_SEED_STRIDE', 'ROLLOUT_CHUNK', 'SAO_CURVES', 'WARM_TEACHER', 'WARM_VERSION', '_backend', '_dump',
    '_mismatch_summary', '_no_metrics', '_quiet', '_rank_checksums', '_read_warm', '_same_model',
    'check_base', 'constant_patterns', 'env_specs', 'evaluation', 'hand_off', 'hand_off_of', 'opd_student', 'replay_ids',
    'resolve_base', 'rewards', 'rl_set', 'rollout_batches', 'sao_expert', 'skip_reason', 'taught_domains',
    'teacher_cell', 'teacher_gate', 'trajectory_actions', 'under_torchrun', 'verified_envs', 'warm_start',
    'Recorder',
]
