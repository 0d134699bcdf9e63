"""Presets (`configs/presets/*.yaml`) and the loader of the composed `IterationConfig`.

    cfg = configs.load("tiny", ["model.hidden_size=64", "train.lr=1e-3"])

Unknown keys and bad values raise `ConfigError` naming the key path (e.g. `model.n_group`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from envs.config import EnvConfig
from model.config import ModelConfig
from rollout.config import AgentConfig
from trainers.config import BaseConfig, LoopConfig, OPDConfig, SAOConfig, TrainConfig, TrainerConfig

PRESET_DIR = Path(__file__).parent / "presets"


class ConfigError(ValueError):
    pass


class IterationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelConfig
    train: TrainConfig = TrainConfig()
    envs: EnvConfig = EnvConfig()
    agent: AgentConfig = AgentConfig()
    sao: SAOConfig = SAOConfig()
    opd: OPDConfig = OPDConfig()
    loop: LoopConfig = LoopConfig()
    base: BaseConfig = BaseConfig()
    trainer: TrainerConfig = TrainerConfig()
    seed: int = 0
    # what iteration N hands to iteration N+1 as its warm start, from N's decision on the validation set. "better": its
    # student when it gained more validation tasks than it lost with no domain significantly down (the policy that
    # validates best goes on). "champion": its student only if it became the champion (a significant paired gain
    # over its warm start, at a pass@1 above the champion's). Otherwise its own warm start carries over, and N+1
    # retries from it on fresh RL environments, so a regressed student never becomes a starting point. "student":
    # the student, whatever it scored
    hand_off: Literal["better", "champion", "student"] = "better"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _set(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {k} is not a section")
        d = nxt
    d[keys[-1]] = value


def _fields_at(loc: tuple) -> list[str]:
    """The field names of the config section that holds `loc`'s last key (for "did you mean")."""
    from pydantic import BaseModel

    model: type[BaseModel] = IterationConfig
    for part in loc[:-1]:
        f = model.model_fields.get(str(part))
        if f is None or not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)):
            return []
        model = f.annotation
    return list(model.model_fields)


def _format(source: str, err: ValidationError) -> str:
    import difflib

    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden" and e["loc"]:
            near = difflib.get_close_matches(str(e["loc"][-1]), _fields_at(e["loc"]), n=1, cutoff=0.6)
            if near:
                msg += f"; did you mean `{'.'.join([*map(str, e['loc'][:-1]), near[0]])}`?"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return f"{source}: " + "; ".join(lines)


def load(preset: str | Path = "tiny", overrides: Sequence[str] | Mapping[str, Any] = ()) -> IterationConfig:
    """Load a preset by name (or a YAML path) and apply `key.path=value` overrides."""
    path = Path(preset)
    if not path.suffix:
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.exists():
        raise ConfigError(f"preset {str(preset)!r} not found (known: {', '.join(preset_names())})")
    data = yaml.safe_load(path.read_text()) or {}
    items = overrides.items() if isinstance(overrides, Mapping) else []
    if not isinstance(overrides, Mapping):
        parsed = []
        for o in overrides:
            if "=" not in o:
                raise ConfigError(f"override {o!r}: expected key.path=value")
            k, v = o.split("=", 1)
            parsed.append((k.strip(), yaml.safe_load(v)))
        items = parsed
    for k, v in items:
        _set(data, k, v)
    try:
        return IterationConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(path.stem, e)) from None
