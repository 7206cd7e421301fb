"""Simulation mode (Kernel Tuner's idea): replay measurements taken before — e.g. a brute-forced
grid — so samplers can be compared without re-measuring. Configs not in the table fail."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...knobs import BaseConfig as Config
from .base import Outcome


class SimulatedRunner:
    mode = "simulated"
    provenance = "measured"

    def __init__(self, table: Mapping[str, float | None], device: str = "replay") -> None:
        self.table = dict(table)   # config.key() -> time ms, or None for a failed candidate
        self.device = device

    def prepare(self, configs: list[Config]) -> list[Any]:
        return [None] * len(configs)

    def evaluate(self, config: Config, prepared: Any) -> Outcome:
        key = config.key()
        if key not in self.table:
            return Outcome(False, why="not in the replay table")
        t = self.table[key]
        return Outcome(t is not None, t, "" if t is not None else "failed when measured")

    def close(self) -> None:
        pass
