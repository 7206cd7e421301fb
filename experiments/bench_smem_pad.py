"""Time the chunk-state stage with smem_pad 0 (the tl kernel, compiler-chosen shared layout)
against each padded Gluon variant, on the local GPU, at production shapes.

    python experiments/bench_smem_pad.py [--out DIR] [--shapes 2.7b:1x131072,2.7b:8x2048]
                                     [--dtype bf16] [--pads 2,4,8] [--tiles 64x64x64x4,...]

--tiles: state_block_m x state_block_n x state_block_k x state_warps points to time each pad at
(default: the arch's default config only). Every padded run's local states are checked against
the tl kernel's first (relative error at the input dtype's tolerance), so a time is never reported
for a wrong kernel. Prints a table; writes bench_smem_pad.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.arch import local_arch  # noqa: E402
from autossd.ops.ssd import chunk as ssd_chunk  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.render import load  # noqa: E402
from autossd.ops.ssd.fwd_knobs import KNOB_BY_NAME, default_config, violations  # noqa: E402
from autossd.testing import make_inputs, rel_err, tolerance  # noqa: E402

MODELS = {"130m": (24, 64, 128, 1), "2.7b": (80, 64, 128, 1), "codestral": (128, 64, 128, 8)}


def local_states(prob, cfg, t, backend):
    """Run the stages up to chunk state; returns its launch, the module and the local states
    (state passing would overwrite them in place, so it is not run)."""
    mod = load(cfg, backend)
    buf = ssd_chunk.allocate(prob, cfg, "cuda", poison=True)
    launches = ssd_chunk.plan(prob, cfg, t, buf, backend)
    upto = [ln.stage for ln in launches].index("chunk_state") + 1
    ssd_chunk.run(launches[:upto], mod)
    torch.cuda.synchronize()
    return launches[upto - 1], mod, buf.states.clone()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "bench_smem_pad"),
                    help="output folder (default: scratch/bench_smem_pad, git-ignored)")
    ap.add_argument("--shapes", default="2.7b:1x131072,2.7b:8x2048,codestral:1x32768")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--pads", default=",".join(str(v) for v in KNOB_BY_NAME["smem_pad"].values if v))
    ap.add_argument("--tiles", default="", help="MxNxKxWARPS points, comma separated")
    a = ap.parse_args()
    arch = local_arch()
    if arch is None:
        sys.exit("bench_smem_pad: needs a CUDA or ROCm GPU of a known arch (sm80, sm90, gfx90a, gfx942)")
    backend = "hip" if getattr(torch.version, "hip", None) else "cuda"
    pads = [int(v) for v in a.pads.split(",") if v]
    points = [dict(zip(("state_block_m", "state_block_n", "state_block_k", "state_warps"),
                       (int(v) for v in p.split("x")))) for p in a.tiles.split(",") if p]
    rows = []
    print(f"{'shape':<22} {'tiles (m,n,k,warps)':<20} {'pad':>4} {'ms':>9} {'vs pad 0':>9} {'err':>9}")
    for spec in a.shapes.split(","):
        model, bl = spec.split(":")
        b, l = (int(v) for v in bl.split("x"))
        h, p, n, g = MODELS[model]
        prob = Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=a.dtype,
                       has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=True)
        t = make_inputs(prob, "cuda", seed=0)
        t = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")}
        base = default_config(arch, prob)
        for point in points or [{}]:
            ref_ms = ref = None
            for pad in [0] + pads:
                cfg = base.replace(**point, smem_pad=pad)
                tiles = f"{cfg.state_block_m},{cfg.state_block_n},{cfg.state_block_k},{cfg.state_warps}"
                row = {"shape": spec, "dtype": a.dtype, "arch": arch, "smem_pad": pad, "config": cfg.as_dict()}
                why = violations(cfg, arch, prob)
                if why:
                    row["error"] = "; ".join(why)
                else:
                    try:
                        ln, mod, states = local_states(prob, cfg, t, backend)
                        if ref is None:
                            ref = states
                        row["err"] = rel_err(states, ref.double())
                        kern = getattr(mod, ln.kernel)
                        row["ms"] = do_bench(lambda: kern[ln.grid](**ln.args, **ln.constexprs, **ln.options),
                                             warmup=10, rep=100, return_mode="median")
                        if row["err"] > tolerance(a.dtype):
                            row["error"] = f"local states differ from the tl kernel's: {row['err']:.2e}"
                    except Exception as e:  # record and go on: one failure must not hide the others
                        row["error"] = repr(e)[:500]
                if pad == 0:
                    ref_ms = row.get("ms")
                if "ms" in row and ref_ms:
                    row["speedup_vs_pad0"] = ref_ms / row["ms"]
                rows.append(row)
                ms = f"{row['ms']:.4f}" if "ms" in row else "-"
                sp = f"{row['speedup_vs_pad0']:.3f}x" if "speedup_vs_pad0" in row else "-"
                err = f"{row['err']:.1e}" if "err" in row else "-"
                print(f"{spec:<22} {tiles:<20} {pad:>4} {ms:>9} {sp:>9} {err:>9} {row.get('error', '')}",
                      flush=True)
            del ref
        del t
        torch.cuda.empty_cache()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": torch.cuda.get_device_name(),
            "arch": arch, "torch": torch.__version__, "triton": __import__("triton").__version__,
            "command": " ".join(sys.argv)}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_smem_pad.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    bad = [r for r in rows if "error" in r]
    print(f"{len(rows) - len(bad)} timed, {len(bad)} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
