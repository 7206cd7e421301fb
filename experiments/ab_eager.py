"""Eager drop-in time per call, A/B between two checkouts of autossd, interleaved in rounds (one
subprocess per round and tree, so each imports its own code). Per call: the host's enqueue time
(back-to-back calls, no sync) and the eager time between CUDA events (autossd.bench.back_to_back_ms),
with the pick's GPU time by graph replay beside them.

    python experiments/ab_eager.py [--out DIR] --trees OLD_DIR,. [--shapes 2.7b:1x2048,130m:1x2048]
        [--dtype fp16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# (heads, headdim, dstate, groups), as autossd.tuner.shapes.MODELS. Kept here, not imported: this
# file must not put any tree's autossd on sys.path, or a child would import it instead of its own.
MODELS = {"130m": (24, 64, 128, 1), "2.7b": (80, 64, 128, 1), "codestral": (128, 64, 128, 8)}


def one(shape: str, dtype: str) -> dict:
    """Runs inside the tree's interpreter: times that tree's drop-in."""
    import time

    import torch

    import autossd
    from autossd.bench import back_to_back_ms
    from autossd.problem import Problem
    from autossd.testing import make_inputs
    model, bl = shape.split(":")
    b, l = (int(v) for v in bl.split("x"))
    h, p, n, g = MODELS[model]
    prob = Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=dtype,
                   chunk_size=256, has_D=True, has_dt_bias=True, dt_softplus=True)
    sets = [make_inputs(prob, "cuda", seed=s) for s in range(4)]
    calls = [lambda t=t: autossd.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 256,
                                                           D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
             for t in sets]
    it = iter(range(1 << 62))
    fn = lambda: calls[next(it) % len(calls)]()   # noqa: E731
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        host.append((time.perf_counter() - t0) / 200 * 1e6)
        torch.cuda.synchronize()
    eager = back_to_back_ms(fn, n_sets=len(calls)) * 1e3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls[0]()
    g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(100):
        g.replay()
    en.record()
    torch.cuda.synchronize()
    return {"host_enqueue_us": sorted(host)[len(host) // 2], "eager_us": eager,
            "graph_us": st.elapsed_time(en) / 100 * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "ab_eager"),
                    help="output folder (default: scratch/ab_eager, git-ignored)")
    ap.add_argument("--trees", default=".", help="comma-separated autossd checkouts (repo roots)")
    ap.add_argument("--shapes", default="2.7b:1x2048,130m:1x2048")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(*a.one)))
        return
    trees = [os.path.abspath(t) for t in a.trees.split(",")]
    res = {s: {t: [] for t in trees} for s in a.shapes.split(",")}
    for r in range(a.rounds):
        for s in res:
            for t in (trees if r % 2 == 0 else trees[::-1]):   # alternate the order: no tree always runs first
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([t, os.environ.get("PYTHONPATH", "")]))
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", s, a.dtype],
                                     env=env, cwd=t, capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"{t} {s}: exit {out.returncode}\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                res[s][t].append(row)
                print(f"round {r} {s:12s} {os.path.basename(t) or t:10s} host {row['host_enqueue_us']:6.1f} us  "
                      f"eager {row['eager_us']:6.1f} us  graph {row['graph_us']:6.1f} us", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ab_eager.json"), "w") as f:
        json.dump({"dtype": a.dtype, "trees": trees, "rows": res}, f, indent=1)


if __name__ == "__main__":
    main()
