"""Runners evaluate candidates: measured (local GPU), static (cross-compile + model),
simulated (replay of earlier measurements)."""
from .base import Outcome, Runner

__all__ = ["Outcome", "Runner"]
