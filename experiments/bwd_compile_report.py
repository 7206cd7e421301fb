"""Per-stage cross-compile report of an ssd_bwd config (no GPU needed): registers, spill bytes,
shared memory and occupancy (blocks per SM on NVIDIA, waves per SIMD on AMD) of every launch.

    python experiments/bwd_compile_report.py                       # sm90 default, mamba2-2.7b 8x2048 bf16
    python experiments/bwd_compile_report.py --arch sm80 --stages dx db dc
    python experiments/bwd_compile_report.py --set dx_block_m=32 dx_warps=8
    python experiments/bwd_compile_report.py --config '{"dx_block_m": 32}' --json

The problem is mamba2-2.7b's layer (h=80, p=64, n=128, g=1, chunk 256, D, z, dt_bias + softplus,
initial and final states) unless overridden. Compiling every stage takes ~15-45 s on one core.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autossd import compile as _compile  # noqa: E402
from autossd.compile import compile_config  # noqa: E402
from autossd.ops.ssd.bwd_knobs import KNOB_BY_NAME, default_config  # noqa: E402
from autossd.problem import Problem  # noqa: E402


def _value(name: str, text: str):
    for v in KNOB_BY_NAME[name].values:
        if str(v) == text:
            return v
    raise SystemExit(f"{name}={text}: not one of {KNOB_BY_NAME[name].values}")


def problem_of(a) -> Problem:
    return Problem(a.batch, a.seqlen, a.nheads, a.headdim, a.dstate, a.ngroups, a.dtype, chunk_size=a.chunk,
                   has_D=True, has_z=not a.no_z, has_dt_bias=True, dt_softplus=True,
                   has_initial_states=True, return_final_states=True, has_seq_idx=a.seq_idx)


_SASS: dict[str, dict[str, int]] = {}


def _count_sass(stage: str, compiled) -> None:
    """Instruction counts of a stage's SASS that say where its time goes without a GPU: tensor-core
    MMAs (HGMMA: sm90 wgmma; HMMA: mma.sync), fp32 FMAs (an fp32 "ieee" dot lowers to FFMA),
    and local-memory loads and stores (spills)."""
    cubin = compiled.asm.get("cubin") if hasattr(compiled, "asm") else None
    if not cubin:
        return
    import os
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([_compile._cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    _SASS[stage] = {k: sum(1 for o in ops if o == k) for k in ("HGMMA", "HMMA", "FFMA", "LDL", "STL")}


def report(config, arch, prob, stages=None):
    orig = _compile._report_stage

    def spy(arch_, launch, compiled):
        _count_sass(launch.stage, compiled)
        return orig(arch_, launch, compiled)
    _compile._report_stage = spy
    try:
        return compile_config(config, arch, prob, stages=tuple(stages) if stages else None)
    finally:
        _compile._report_stage = orig


def print_report(rep, out=sys.stdout):
    occ = "waves/SIMD" if rep.arch.startswith("gfx") else "blocks/SM"
    print(f"{rep.arch}  {json.dumps(rep.config.as_dict())}", file=out)
    if rep.reasons:
        print("  rejected:", "; ".join(rep.reasons), file=out)
    print(f"  {'stage':<18} {'warps':>5} {'regs':>5} {'agpr':>5} {'spill':>6} {'smem':>7} {occ:>10} {'hgmma':>5} {'hmma':>5} {'ffma':>5} {'ldl':>4} {'stl':>4}  notes",
          file=out)
    for s in rep.stages:
        print(f"  {s.stage:<18} {s.num_warps:>5} {s.registers:>5} {s.agprs:>5} {s.spill_bytes:>6} "
              f"{s.shared_bytes:>7} {s.occupancy:>10g} "
              + " ".join(f"{_SASS.get(s.stage, {}).get(k, ''):>{w}}" for k, w in
                         (("HGMMA", 5), ("HMMA", 5), ("FFMA", 5), ("LDL", 4), ("STL", 4)))
              + f"  {'; '.join(s.reasons)}", file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--nheads", type=int, default=80)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=128)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--no-z", action="store_true", help="no gate (the gate stage is left out)")
    ap.add_argument("--seq-idx", action="store_true")
    ap.add_argument("--stages", nargs="*", help="only these launches (default: all)")
    ap.add_argument("--config", help="JSON of knobs over the arch default")
    ap.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE", help="knobs over the arch default")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    prob = problem_of(a)
    cfg = default_config(a.arch, prob)
    over = json.loads(a.config) if a.config else {}
    for kv in a.set:
        k, v = kv.split("=", 1)
        over[k] = _value(k, v)
    if over:
        cfg = cfg.replace(**over)
    rep = report(cfg, a.arch, prob, a.stages)
    if a.json:
        print(json.dumps(rep.as_dict(), indent=1))
    else:
        print_report(rep)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
