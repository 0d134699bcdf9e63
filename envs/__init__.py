"""Environments room: task specs, families, sandbox, verifiers, the triad gate and hack probes."""

from .actions import Action, ActionError, parse_action
from .environment import Environment, Reward, StepResult, run_script
from .families import FAMILIES, get_family
from .sandbox import Limits, SandboxUnavailable, make_sandbox
from .sandbox_docker import DockerSandbox
from .spec import Check, PublicTask, TaskSpec, Verifier

__all__ = [
    "FAMILIES", "Action", "ActionError", "Check", "DockerSandbox", "Environment", "Limits", "PublicTask", "Reward",
    "SandboxUnavailable", "StepResult", "TaskSpec", "Verifier", "get_family", "make_sandbox", "parse_action",
    "run_script",
]
