"""Probe: why the tune's graph timing of some large shapes comes out above the eager timing of
the same config (BENCHMARKS.md §75, §78). In one process, as the measured runner does it (inputs,
float64 reference, gate, eager time, then `_graph_ms`), and the same replay timed in other ways:

  eager        back-to-back eager calls (the runner's eager time)
  tune_graph   the runner's _graph_ms (empty_cache, capture, do_bench of the replay)
  keep_cache   the same capture without empty_cache first
  one_graph    one graph captured once and replayed for every round (as sweep_depths.py does)

Each is taken ROUNDS times, interleaved; prints ms per call and writes DIR/probe_graph_timing.json.

    python experiments/probe_graph_timing.py [--out DIR] [--shapes "mamba2-2.7b:b=4,l=16384;codestral-7b:b=1,l=131072"]
        [--dtypes fp16,bf16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.bench import back_to_back_ms, run_meta  # noqa: E402
from autossd.ops.ssd.fwd_knobs import default_config  # noqa: E402
from autossd.tuner.gate import check, default_run, make_inputs, reference  # noqa: E402
from autossd.tuner.runners import measured  # noqa: E402
from autossd.tuner.shapes import parse_shape  # noqa: E402

ROUNDS = 3


def graph_ms(fn, warm, rep, empty_cache: bool) -> float:
    if empty_cache:
        torch.cuda.empty_cache()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    try:
        return float(triton.testing.do_bench(g.replay, warmup=warm, rep=rep, return_mode="median"))
    finally:
        del g
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "probe_graph_timing"),
                    help="output folder (default: scratch/probe_graph_timing, git-ignored)")
    ap.add_argument("--shapes", default="mamba2-2.7b:b=4,l=16384;codestral-7b:b=1,l=131072",
                    help="as `autossd tune --shapes`, ';' between shapes")
    ap.add_argument("--dtypes", default="fp16,bf16", help="one per shape")
    a = ap.parse_args()
    rows = []
    for spec, dtype in zip(a.shapes.split(";"), a.dtypes.split(","), strict=True):
        prob = parse_shape(spec, dtype)
        cfg = default_config("sm90", prob)
        t = make_inputs(prob, "cuda", seed=0)
        ref = reference(prob, t)
        gate = check(prob, cfg, t, ref, lambda p_, c_, t_: default_run(p_, c_, t_, "cuda"))
        fn = lambda: default_run(prob, cfg, t, "cuda")  # noqa: E731
        times = {k: [] for k in ("eager", "tune_graph", "keep_cache", "one_graph")}
        g1 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1):
            fn()
        for _ in range(ROUNDS):
            eager = back_to_back_ms(fn, 1, 25, 100)
            times["eager"].append(eager)
            times["tune_graph"].append(measured._graph_ms(fn, 1, eager, 25, 100))
            times["keep_cache"].append(graph_ms(fn, 25, 100, empty_cache=False))
            times["one_graph"].append(float(triton.testing.do_bench(g1.replay, warmup=25, rep=100,
                                                                     return_mode="median")))
        del g1
        row = {"shape": spec, "dtype": dtype, "gate_ok": gate.ok, "ms": times}
        rows.append(row)
        print(spec, dtype, "gate", "ok" if gate.ok else gate.why, flush=True)
        for k, v in times.items():
            print(f"  {k:11s} " + "  ".join(f"{x:.4f}" for x in v), flush=True)
        t = ref = fn = None   # free the inputs and the reference before the next shape
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "probe_graph_timing.json"), "w") as f:
        json.dump({"meta": run_meta(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
