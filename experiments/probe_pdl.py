"""Probe: which launch boundary of `pdl` costs or saves time (BENCHMARKS.md §107). §107's sweep
found `pdl = 1` 12% slower than `pdl = 0` at 2.7b 1×131072 and 7% slower at 1×2048, but not at
4×16384. The suspicion: a walk launched with PDL is dispatched while the prep's programs still
hold SMs, so the scheduler may put two of its 80 programs on one SM (two fit), and its chains then
share an SM's issue slots for the whole walk.

Each variant is a config override and the stages launched *without* PDL (their kernels keep
their griddepcontrol instructions, which are no-ops then). Times eager calls, one replayed
CUDA graph, and a graph of ten calls each followed by another kernel (bench_ssd.py's "mixed"
mode, that kernel's time subtracted), ROUNDS times interleaved; every variant's output is checked against `pdl = 0`'s.

    python experiments/probe_pdl.py [--out DIR] [--shapes mamba2-2.7b:1x131072,...] [--dtypes fp16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd import render  # noqa: E402
from autossd.bench import floor_ms, measure_ceilings, run_meta  # noqa: E402
from autossd.ops.ssd import chunk  # noqa: E402
from autossd.ops.ssd.fwd_knobs import default_config, fit  # noqa: E402
from autossd.testing import make_inputs, rel_err  # noqa: E402
from autossd.tuner.shapes import MODELS  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from bench_ssd import _other_kernel  # noqa: E402  (scripts/, this script's folder)

ROUNDS = 2
THREE = {"launches": 5, "scan_gluon": 1, "state_walk": 1, "fold_prep": 2}
WW = {**THREE, "walk_weights": 1}
# §132: the walk's ring four stages deep takes 208 KB, so no other program fits beside it (two
# walks, or a walk and a chunk-scan program, shared SMs under pdl = 3: §108)
WALK4 = (("_GW_STAGES = ttgl.constexpr(2)", "_GW_STAGES = ttgl.constexpr(4)"),)
VARIANTS = [   # (name, overrides, stages launched without PDL[, source edits (old, new) of the module])
    ("pdl0", {**THREE}, ()),
    ("pdl1", {**THREE, "pdl": 1}, ()),
    ("pdl1 walk plain", {**THREE, "pdl": 1}, ("state_walk",)),
    ("pdl1 prep plain", {**THREE, "pdl": 1}, ("prep",)),
    ("pdl1 scan plain", {**THREE, "pdl": 1}, ("chunk_scan",)),
    ("pdl3", {**THREE, "pdl": 3}, ()),
    ("pdl3 walk plain", {**THREE, "pdl": 3}, ("state_walk",)),
    ("pdl3 walk+prep plain", {**THREE, "pdl": 3}, ("state_walk", "prep")),
    ("ww pdl0", {**WW}, ()),
    ("ww pdl0 sg2", {**WW, "scan_gluon": 2}, ()),
    ("ww pdl0 walk4", {**WW}, (), WALK4),
    ("ww pdl3", {**WW, "pdl": 3}, ()),
    ("ww pdl3 walk4", {**WW, "pdl": 3}, (), WALK4),
]

_plain: tuple = ()
_plan = chunk.plan


def _patched_plan(*args, **kw):
    launches = _plan(*args, **kw)
    for ln in launches:
        if ln.stage in _plain:
            ln.options = {k: v for k, v in ln.options.items() if k != "launch_pdl"}
    return launches


chunk.plan = _patched_plan

_edits: tuple = ()
_render = render.render


def _patched_render(*args, **kw):
    src = _render(*args, **kw)
    for old, new in _edits:
        if old not in src:
            raise RuntimeError(f"probe_pdl: source edit {old!r} matches nothing in the rendered module")
        src = src.replace(old, new)
    return src


render.render = _patched_render


def main():
    global _plain, _edits
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "probe_pdl"),
                    help="output folder (default: scratch/probe_pdl, git-ignored)")
    ap.add_argument("--dtypes", default="fp16")
    ap.add_argument("--shapes", default="mamba2-2.7b:1x131072,mamba2-2.7b:1x2048")
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    a = ap.parse_args()
    names = a.variants.split(",") if a.variants else [v[0] for v in VARIANTS]
    variants = [(v + ((),))[:4] for v in VARIANTS if v[0] in names]
    ceil = measure_ceilings()
    rows = []
    os.makedirs(a.out, exist_ok=True)
    for dtype in a.dtypes.split(","):
        for spec in a.shapes.split(","):
            model, bl = spec.split(":")
            b, l = map(int, bl.split("x"))
            h, p, n, g = MODELS[model]
            prob = Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=dtype,
                           has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=True)
            t = make_inputs(prob, "cuda", seed=11)
            tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                                         "initial_states", "seq_idx")}
            base = default_config("sm90", prob)
            fl = floor_ms(prob, ceil)
            ref = None
            print(f"\n{dtype} {spec} floor {fl:.3f} ms", flush=True)
            graphs = {}
            other_kernel = _other_kernel()   # bench_ssd.py's "mixed" mode, the same kernel
            g_other = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g_other):
                for _ in range(10):
                    other_kernel()
            for name, over, plain, edits in variants:
                _plain, _edits = plain, edits
                chunk._launch_cache.clear()   # a variant's options are not part of the cache key
                render._by_config.clear()     # nor are its source edits
                cfg = fit(base.replace(**over), prob)
                out = chunk.execute(prob, cfg, tensors, poison=True)
                torch.cuda.synchronize()
                if ref is None:
                    ref = [o.clone() for o in out[:2]]
                err = max(rel_err(out[0], ref[0].double()), rel_err(out[1], ref[1].double()))
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    chunk.execute(prob, cfg, tensors)
                gm = torch.cuda.CUDAGraph()   # ten calls, each followed by another kernel (a model's view)
                with torch.cuda.graph(gm):
                    for _ in range(10):
                        chunk.execute(prob, cfg, tensors)
                        other_kernel()
                graphs[name] = (cfg, plain, edits, g, gm, err)
            res = {name: {"eager": [], "graph": [], "mixed": []} for name, *_ in variants}
            for _ in range(ROUNDS):
                other = do_bench(g_other.replay, warmup=10, rep=100, return_mode="median") / 10
                for name, (cfg, plain, edits, g, gm, _) in graphs.items():
                    _plain, _edits = plain, edits
                    chunk._launch_cache.clear()
                    render._by_config.clear()
                    chunk.execute(prob, cfg, tensors)
                    res[name]["eager"].append(do_bench(lambda: chunk.execute(prob, cfg, tensors), warmup=25,
                                                       rep=150, return_mode="median"))
                    res[name]["graph"].append(do_bench(g.replay, warmup=10, rep=150, return_mode="median"))
                    res[name]["mixed"].append(do_bench(gm.replay, warmup=5, rep=150, return_mode="median") / 10
                                              - other)
            for name, (cfg, plain, edits, g, gm, err) in graphs.items():
                r = res[name]
                row = {"model": model, "batch": b, "seqlen": l, "dtype": dtype, "variant": name,
                       "override": dict(cfg.as_dict()), "plain_stages": list(plain), "edits": [list(e) for e in edits],
                       "err_vs_pdl0": err,
                       "eager_ms": r["eager"], "graph_ms": r["graph"], "mixed_graph_ms": r["mixed"],
                       "floor_ms": fl}
                rows.append(row)
                gm = min(r["graph"])
                print(f"  {name:24s} eager {min(r['eager']):8.4f} ms  graph {gm:8.4f} ms "
                      f"({', '.join(f'{v:.4f}' for v in r['graph'])})  {100 * fl / gm:5.1f}% floor  "
                      f"mixed x10 {min(r['mixed']):8.4f} ms ({', '.join(f'{v:.4f}' for v in r['mixed'])})  "
                      f"err vs pdl0 {err:.1e}", flush=True)
            del graphs, g_other, t, tensors, ref
            torch.cuda.empty_cache()
            with open(os.path.join(a.out, "probe_pdl.json"), "w") as f:
                json.dump({"meta": run_meta(ceilings=ceil), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
