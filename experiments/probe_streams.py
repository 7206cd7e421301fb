"""Diagnostic probe (no autossd code path uses it): how much of the small-shape forward two CUDA
streams could overlap. Captures the sm90 five-launch default in CUDA graphs:

  serial   cumsum, bmm, chunk state, state passing, chunk scan on one stream (what ships);
  bmm||    bmm on a second stream, beside cumsum -> chunk state -> state passing; then the scan;
  scan||   cumsum -> chunk state -> state passing on one stream, bmm -> chunk scan on the other
           (the scan stands in for an intra-chunk-only scan, an upper bound of its time: it also
           does C·state, and reads states still being written, so its output is not checked);
  scan||+  scan|| followed by one more chunk scan (an upper bound of a split's inter-chunk kernel).

Prints GPU time per forward by graph replay. python experiments/probe_streams.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.ops.ssd import chunk as ssd_chunk  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.render import load  # noqa: E402
from autossd.ops.ssd.fwd_knobs import default_config  # noqa: E402
from autossd.testing import make_inputs  # noqa: E402
from autossd.tuner.shapes import MODELS  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "probe_streams"),
                    help="output folder (default: scratch/probe_streams, git-ignored)")
    ap.add_argument("--shapes", default="mamba2-2.7b:1x2048,mamba2-130m:1x2048,mamba2-2.7b:8x2048")
    a = ap.parse_args()
    res = []
    for s in a.shapes.split(","):
        model, bl = s.split(":")
        b, l = map(int, bl.split("x"))
        h, p, n, g = MODELS[model]
        prob = Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype="fp16",
                       has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=True)
        cfg = default_config("sm90", prob)
        t = make_inputs(prob, "cuda", seed=0)
        buf = ssd_chunk.allocate(prob, cfg, "cuda")
        mod = load(cfg, "cuda")
        lns = {ln.stage: ln for ln in ssd_chunk.plan(prob, cfg, t, buf)}

        def go(*stages):
            for st in stages:
                ln = lns[st]
                getattr(mod, ln.kernel)[ln.grid](**ln.args, **ln.constexprs, **ln.options)

        side = torch.cuda.Stream()

        def fork(a_stages, b_stages, after=()):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                go(*b_stages)
            go(*a_stages)
            main.wait_stream(side)
            go(*after)

        chain = ("cumsum", "chunk_state", "state_passing")
        variants = {
            "serial": lambda: go("cumsum", "bmm", "chunk_state", "state_passing", "chunk_scan"),
            "bmm||": lambda: fork(chain, ("bmm",), ("chunk_scan",)),
            "scan||": lambda: fork(chain, ("bmm", "chunk_scan")),
            "scan||+": lambda: fork(chain, ("bmm", "chunk_scan"), ("chunk_scan",)),
            "chain alone": lambda: go(*chain),
            "bmm+scan alone": lambda: go("bmm", "chunk_scan"),
        }
        row = {"shape": s}
        for name, fn in variants.items():
            fn()
            torch.cuda.synchronize()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                fn()
            times = [do_bench(gr.replay, warmup=10, rep=100, return_mode="median") * 1e3 for _ in range(3)]
            row[name] = times
            print(f"{s:22s} {name:16s} " + " ".join(f"{v:7.1f}" for v in times) + " us", flush=True)
        res.append(row)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "probe_streams.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": res}, f, indent=1)


if __name__ == "__main__":
    main()
