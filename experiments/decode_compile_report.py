"""The decode step's cross-compile report for its default config and neighbours (no GPU needed):
registers per thread, programs per SM (occupancy) and the state bytes those programs have in
flight per SM, per state dtype, at mamba2-2.7b dimensions. What BENCHMARKS' decode ceiling
paragraph reads from the sm90 compiles: the step's tile holds its fp32 state and its operands'
pointers in registers, which caps how many programs an SM holds and so the state loads in flight.

    python experiments/decode_compile_report.py [--arch sm90] [--batch 64]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.compile import compile_config  # noqa: E402
from autossd.ops.ssd.decode_knobs import DecodeConfig, DecodeProblem, default_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    print(f"{'state':>5} {'block_p':>7} {'heads':>5} {'warps':>5} {'regs':>5} {'progs/SM':>8} {'KB in flight/SM':>16}")
    for sd in ("bf16", "fp32"):
        pr = DecodeProblem(a.batch, 80, 64, 128, 1, "bf16", sd, has_D=True, has_z=True, has_dt_bias=True,
                           dt_softplus=True)
        d = default_config(a.arch, pr)
        for cfg in (d, d.replace(block_p=max(1, d.block_p // 2)), d.replace(warps=d.warps * 2),
                    DecodeConfig(block_p=32, heads=2, warps=2, stages=3)):
            rep = compile_config(cfg, a.arch, pr)
            st = rep.stages[0]
            tile = cfg.heads * cfg.block_p * 128 * (4 if sd == "fp32" else 2)
            print(f"{sd:>5} {cfg.block_p:7d} {cfg.heads:5d} {cfg.warps:5d} {st.registers:5d} "
                  f"{st.occupancy:8.0f} {st.occupancy * tile / 1024:16.0f}")


if __name__ == "__main__":
    main()
