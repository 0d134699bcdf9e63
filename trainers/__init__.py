"""Trainers room: LM/SFT trainer core (SAO and OPD build on it)."""

from .config import TrainConfig

__all__ = ["TrainConfig"]
