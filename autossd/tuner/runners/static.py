"""Static mode: for an arch that is not present. Each candidate is cross-compiled for the arch
(`autossd.compile.compile_config`), rejected when the report is not ok (resource limits,
occupancy 0; spills are recorded, not refused: the model cannot price them), and ranked by the
performance model in `autossd.tuner.model`. Results are predictions: records carry provenance
"static"."""
from __future__ import annotations

from typing import Any

from ...arch import get_arch
from ...problem import Problem
from ...knobs import BaseConfig as Config
from ..model import floor_ms, predict
from .base import Outcome, report_from, shared_pool


class StaticRunner:
    mode = "static"
    provenance = "static"

    def __init__(self, arch: str, problem: Problem, compile_workers: int = 2) -> None:
        self.arch = get_arch(arch).name
        self.problem = problem
        self.device = f"{get_arch(arch).reference_part} model"   # whose datasheet the model uses
        self.pool = shared_pool(compile_workers)
        self.floor_ms = floor_ms(self.arch, problem)

    def prepare(self, configs: list[Config]) -> list[Any]:
        return self.pool.map(configs, self.arch, self.problem)

    def evaluate(self, config: Config, prepared: Any) -> Outcome:
        if isinstance(prepared, str):
            return Outcome(False, why=prepared)
        rep = report_from(prepared, self.arch, config)
        if not rep.ok:
            return Outcome(False, why="; ".join(rep.why()), info={"stage": "compile"})
        ms, stages = predict(self.arch, self.problem, config, rep)
        info = {"predicted": True,
                "stages_ms": {s.stage: round(s.seconds * 1e3, 5) for s in stages},
                "registers": {s.stage: s.registers for s in rep.stages},
                "occupancy": {s.stage: s.occupancy for s in rep.stages},
                "spill_bytes": {s.stage: s.spill_bytes for s in rep.stages}}
        return Outcome(True, ms, info=info)

    def close(self) -> None:
        pass   # the pool is the process's (base.shared_pool), kept for the next shape
