"""Fusion depths on the local GPU: for each shape, time the five-launch default and variants of
the middle (3 launches) and single-launch depths; every variant's y and final states are checked
against the five-launch result of the same inputs (itself checked against float64 by
gpu_validate.py) before it is timed. Prints a table per shape and the floor from ceilings measured
in the same run; writes the raw numbers to DIR/sweep_depths.json.

    python experiments/sweep_depths.py [--out DIR] [--dtypes fp16] [--shapes design] [--variants JSON]
        [--stages] [--no-final-states]

--no-final-states: the calls return y alone, as the drop-in's default and the shipped records'
problems do (the walk then stops at the last chunk's entering state, BENCHMARKS.md §156).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.bench import floor_ms, measure_ceilings, run_meta, stage_times  # noqa: E402
from autossd.ops.ssd.chunk import execute  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.tuner.shapes import MODELS, PRESET_SHAPES  # noqa: E402
from autossd.ops.ssd.fwd_knobs import default_config, fit, violations  # noqa: E402
from autossd.testing import make_inputs, rel_err, tolerance  # noqa: E402

DESIGN = [(m, b, l) for m, shapes in PRESET_SHAPES.items() for b, l in shapes]  # the benchmark's model shapes
# overrides of the arch default; chunk sizes and warps of the fused kernels first
VARIANTS = [
    {"launches": 5},
    {"launches": 3},
    {"launches": 3, "state_warps": 4},
    {"launches": 3, "chunk_size": 128},
    {"launches": 1, "chunk_size": 256, "scan_warps": 8},
    {"launches": 1, "chunk_size": 128, "scan_warps": 4},
    {"launches": 1, "chunk_size": 128, "scan_warps": 8},
    {"launches": 1, "chunk_size": 64, "scan_warps": 4},
    {"launches": 1, "chunk_size": 128, "scan_warps": 8, "state_block_m": 32},
    {"launches": 1, "chunk_size": 128, "scan_warps": 8, "scan_stages": 1},
]


def problem(model, b, l, dtype, final: bool = True):
    h, p, n, g = MODELS[model]
    return Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=dtype,
                   has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=final)


def outputs(o) -> tuple:
    return o if isinstance(o, tuple) else (o,)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "sweep_depths"),
                    help="output folder (default: scratch/sweep_depths, git-ignored)")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--shapes", default="design", help="'design' or model:BxL,...")
    ap.add_argument("--variants", default="", help="JSON list of config overrides")
    ap.add_argument("--stages", action="store_true", help="also time each launch alone")
    ap.add_argument("--no-final-states", action="store_true", help="calls return y alone")
    a = ap.parse_args()
    variants = json.loads(a.variants) if a.variants else VARIANTS
    shapes = DESIGN if a.shapes == "design" else [
        (s.split(":")[0], *map(int, s.split(":")[1].split("x"))) for s in a.shapes.split(",")]
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    rows = []
    for dtype in a.dtypes.split(","):
        for model, b, l in shapes:
            prob = problem(model, b, l, dtype, not a.no_final_states)
            t = make_inputs(prob, "cuda", seed=11)
            tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states",
                                         "seq_idx")}
            base = default_config("sm90", prob)
            ref = outputs(execute(prob, base, tensors))
            fl = floor_ms(prob, ceil)
            print(f"\n{dtype} {model} {b}x{l}  floor {fl:.3f} ms", flush=True)
            for over in variants:
                cfg = fit(base.replace(**over), prob)
                row = {"model": model, "batch": b, "seqlen": l, "dtype": dtype, "override": over,
                       "config": cfg.as_dict(), "floor_ms": fl}
                why = violations(cfg, "sm90", prob)
                if why:
                    row["error"] = "; ".join(why)
                else:
                    try:
                        out = outputs(execute(prob, cfg, tensors, poison=True))
                        torch.cuda.synchronize()
                        row["y_err"] = rel_err(out[0], ref[0].double())
                        row["final_err"] = rel_err(out[1], ref[1].double()) if len(out) > 1 else 0.0
                        row["ok"] = max(row["y_err"], row["final_err"]) <= tolerance(dtype, cfg.state_dtype)
                        row["ms"] = do_bench(lambda: execute(prob, cfg, tensors), warmup=25, rep=150,
                                             return_mode="median")
                        g = torch.cuda.CUDAGraph()  # GPU time without the host: one replayed graph
                        with torch.cuda.graph(g):
                            execute(prob, cfg, tensors)
                        row["graph_ms"] = do_bench(g.replay, warmup=10, rep=100, return_mode="median")
                        del g
                        if a.stages:
                            row["stages_ms"] = stage_times(prob, cfg, tensors)
                    except Exception as e:  # record and go on
                        row["error"] = repr(e)[:300]
                rows.append(row)
                if "ms" in row:
                    print(f"  {json.dumps(over):70s} {row['ms']:8.3f} ms  graph {row['graph_ms']:8.3f} ms "
                          f"{100 * fl / row['graph_ms']:5.1f}% floor  err y {row['y_err']:.1e} "
                          f"fin {row['final_err']:.1e} {'ok' if row['ok'] else 'WRONG'} "
                          f"{json.dumps({k: round(v, 3) for k, v in row.get('stages_ms', {}).items()})}", flush=True)
                else:
                    print(f"  {json.dumps(over):70s} error {row['error']}", flush=True)
            del t, tensors, ref
            torch.cuda.empty_cache()
            # rewritten after every shape: a run cut by its time limit keeps the shapes it timed
            os.makedirs(a.out, exist_ok=True)  # a fresh folder under $OUT on the device
            with open(os.path.join(a.out, "sweep_depths.json"), "w") as f:
                json.dump({"meta": run_meta(ceilings=ceil), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
