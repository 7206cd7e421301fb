#!/usr/bin/env python
"""Cross-compile report of one config of any op, per kernel launch (no GPU needed): warps,
registers, spill bytes, shared memory, occupancy (blocks per SM on NVIDIA, waves per SIMD on
AMD) and, for NVIDIA targets, SASS instruction counts that say where time goes without running:
tensor-core MMAs (HGMMA: sm90 wgmma; HMMA: mma.sync), fp32 FMAs (an fp32 "ieee" dot lowers to
FFMA), special-function ops (MUFU: the scans' exponentials), cross-lane shuffles (SHFL) and
local-memory loads and stores (spills).

Run it when a config is slower than expected or a knob's default is in question (does a tile spill?
does a register cap cost occupancy?), after a Triton upgrade, or before changing a template.

    python scripts/compile_report.py                                   # the backward, sm90 default
    python scripts/compile_report.py --op ssd_bwd --set dx_block_m=32 dx_warps=8 --stages dx dcb
    python scripts/compile_report.py --op ssd_fwd --arch gfx942 --shape "mamba2-2.7b:b=1,l=16k"
    python scripts/compile_report.py --op ssd_decode --shape "mamba2-2.7b:b=64" --state-dtype bf16
    python scripts/compile_report.py --op ssd_bwd --config '{"dx_maxnreg": 128}' --json
    python scripts/compile_report.py --op sscan_bwd --shape "mamba-2.8b:b=1,l=64k" --set seq_split=8

--shape takes what `autossd tune --op OP --shapes` takes (default: Mamba-2 2.7b's layer at the
op's training or serving size). --set and --config override knobs of the arch's default config
for that shape. Compiling every stage of the backward takes 15-45 s on one core. Exit status 1
when the config is refused or a stage fails to compile.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# the op's problem at Mamba-2 2.7b's layer: the backward at a training shape with the gate and
# final states, the decode step at a serving batch, packed prefill at 8192 tokens in 16 sequences;
# Mamba-1's selective scan at Mamba 2.8b's layer, 8x2048
DEFAULT_SHAPES = {"ssd_fwd": "mamba2-2.7b:b=1,l=16k", "ssd_bwd": "mamba2-2.7b:b=8,l=2048,z=1,final=1",
                  "ssd_decode": "mamba2-2.7b:b=64", "ssd_varlen": "mamba2-2.7b:t=8192,s=16",
                  "sscan_fwd": "mamba-2.8b:b=8,l=2048", "sscan_bwd": "mamba-2.8b:b=8,l=2048"}
# MUFU (exp2 and other special functions) and SHFL (cross-lane moves) bound the scans
SASS_OPS = ("HGMMA", "HMMA", "FFMA", "MUFU", "SHFL", "LDL", "STL")


def knob_value(space, name: str, text: str):
    """A knob's value from its text form (`dx_block_m=32`), as one of the values it takes."""
    knob = next((k for k in space.knobs if k.name == name), None)
    if knob is None:
        raise SystemExit(f"--set {name}: no such knob of {space.op}; expected one of "
                         f"{sorted(k.name for k in space.knobs)}")
    for v in knob.values:
        if str(v) == text:
            return v
    raise SystemExit(f"--set {name}={text}: expected one of {list(knob.values)}")


def sass_counts(compiled) -> dict[str, int]:
    """SASS instruction counts of one compiled NVIDIA kernel (empty for other targets)."""
    from autossd import compile as _compile
    cubin = compiled.asm.get("cubin") if hasattr(compiled, "asm") else None
    if not cubin:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([_compile._cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return {k: sum(1 for o in ops if o == k) for k in SASS_OPS}


def report(config, arch: str, problem, stages=None):
    """compile_config's report, with each launch's SASS counts gathered as it compiles:
    (report, [counts per launch, in the report's order]; several launches can share a stage's
    name, e.g. a split scan's summary, chain and main launches)."""
    from autossd import compile as _compile
    counts: list[dict[str, int]] = []
    orig = _compile._report_stage

    def spy(arch_, launch, compiled):
        counts.append(sass_counts(compiled))
        return orig(arch_, launch, compiled)
    _compile._report_stage = spy
    try:
        rep = _compile.compile_config(config, arch, problem, stages=tuple(stages) if stages else None)
    finally:
        _compile._report_stage = orig
    # a launch that failed to compile has a report but no counts
    it = iter(counts)
    return rep, [{} if any(r.startswith("compile error") for r in s.reasons) else next(it, {}) for s in rep.stages]


def print_report(rep, counts, out=sys.stdout) -> None:
    occ = "waves/SIMD" if rep.arch.startswith("gfx") else "blocks/SM"
    print(f"{rep.arch}  {json.dumps(rep.config.as_dict())}", file=out)
    if rep.reasons:
        print("  refused:", "; ".join(rep.reasons), file=out)
    print(f"  {'stage':<18} {'warps':>5} {'regs':>5} {'agpr':>5} {'spill':>6} {'smem':>7} {occ:>10} "
          + " ".join(f"{k.lower():>5}" for k in SASS_OPS) + "  notes", file=out)
    for s, c in zip(rep.stages, counts):
        print(f"  {s.stage:<18} {s.num_warps:>5} {s.registers:>5} {s.agprs:>5} {s.spill_bytes:>6} "
              f"{s.shared_bytes:>7} {s.occupancy:>10g} " + " ".join(f"{c.get(k, ''):>5}" for k in SASS_OPS)
              + f"  {'; '.join(s.reasons)}", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", default="ssd_bwd", choices=sorted(DEFAULT_SHAPES))
    ap.add_argument("--arch", default="sm90", help="target arch (sm90, sm80, gfx942, gfx90a); default sm90")
    ap.add_argument("--shape", default=None, help="one shape as `autossd tune --shapes` takes it")
    ap.add_argument("--dtype", default="bf16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--state-dtype", default=None, choices=("fp32", "bf16", "fp16"),
                    help="ssd_decode / ssd_varlen: the dtype the caller keeps its states in")
    ap.add_argument("--init", action="store_true",
                    help="ssd_fwd / ssd_bwd: the call passes initial states")
    ap.add_argument("--stages", nargs="*", help="only these launches (default: every launch of the config)")
    ap.add_argument("--config", help="JSON of knobs over the arch default")
    ap.add_argument("--set", nargs="*", default=[], metavar="KNOB=VALUE", help="knobs over the arch default")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)

    from autossd.arch import get_arch
    from autossd.ops.registry import get_op
    from autossd.tuner.shapes import parse_shape
    get_arch(a.arch)   # a clear error for an unknown arch
    op = get_op(a.op)
    prob = parse_shape(a.shape or DEFAULT_SHAPES[a.op], a.dtype, op=a.op, state_dtype=a.state_dtype)
    if a.init:
        if not hasattr(prob, "has_initial_states"):
            raise SystemExit(f"--init: {a.op}'s problems take no initial states flag")
        prob = prob.replace(has_initial_states=True)
    cfg = op.fn("default_config")(a.arch, prob)
    over = json.loads(a.config) if a.config else {}
    for kv in a.set:
        k, eq, v = kv.partition("=")
        if not eq:
            raise SystemExit(f"--set {kv!r}: expected KNOB=VALUE")
        over[k] = knob_value(op.space, k, v)
    if over:
        cfg = cfg.replace(**over)
    print(f"{a.op} {prob}", file=sys.stderr)
    rep, counts = report(cfg, a.arch, prob, a.stages)
    if a.json:
        out = rep.as_dict()
        out["sass"] = counts
        print(json.dumps(out, indent=1))
    else:
        print_report(rep, counts)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
