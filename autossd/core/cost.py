"""What an op's cost model returns per launch (`StageCost`), which the static model
(autossd.tuner.model) turns into a predicted time: the op declares it, the tuner reads it."""
from __future__ import annotations

from dataclasses import dataclass

SECTOR = 32        # bytes per DRAM sector


@dataclass
class StageCost:
    stage: str
    grid: int
    unique_bytes: float
    reread_bytes: float
    flops: float
    block: tuple[int, int, int] = (64, 64, 64)   # (m, n, k) tile of its main dot
    stages: int = 1
    sector_eff: float = 1.0
    chain: int = 0                                # dependent steps per program (state passing)
    ordered: bool = False                         # chain crosses programs (fused depths' hand-off)
    # Streaming stages (the decode step): bytes one resident program has loading at once. Non-zero
    # switches stage_time from the warp-count view of latency hiding to a bytes-in-flight bound.
    inflight: float = 0.0
    resident_cap: int = 0                         # programs per SM the launch itself keeps to (0: none)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
