#!/usr/bin/env python
"""The drop-in under its two launch modes, on the local GPU: what a caller that launches eagerly
and one that captures the forward in a CUDA graph each get from the tuning databases, against
the other mode's pick, mamba_ssm (when importable) and the speed-of-light floor, in one run.

    python experiments/bench_launch_modes.py [--out DIR] [--shapes mamba2-2.7b:b=1,l=2048;...] [--dtype fp16,bf16]

Per shape, in a fresh state of the kernel caches:
  1. the drop-in is called eagerly three times (the eager pick compiles and warms up);
  2. the drop-in is captured in a CUDA graph: the runtime sees the capture and runs the graph
     pick, which may compile for the first time inside the capture (the torch.compile
     "reduce-overhead" path); the graph is replayed on new inputs and checked against the float64
     reference and, bitwise, against the graph pick run eagerly;
  3. timings (medians of CUDA-event timings): each pick eagerly (batches of back-to-back calls,
     so the host's launch cost counts as it does for an eager caller; one input set, so a small
     problem's inputs may sit in L2) and by graph replay (triton.testing.do_bench), mamba_ssm
     the same two ways, and the floor from ceilings measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import autossd  # noqa: E402
from autossd import runtime  # noqa: E402
from autossd.bench import back_to_back_ms, floor_ms, measure_ceilings, run_meta  # noqa: E402
from autossd.ops.ssd.naive import ssd_chunked  # noqa: E402
from autossd.peer import load_mamba_ssm  # noqa: E402
from autossd.testing import call_kwargs, make_inputs, rel_err, tolerance  # noqa: E402
from autossd.tuner.shapes import parse_shapes  # noqa: E402

SHAPES = "mamba2-130m:b=1,l=2048;mamba2-2.7b:b=1,l=2048;mamba2-2.7b:b=8,l=2048"


def _graph(fn):
    """A CUDA graph of one call of fn (warmed on a side stream first, as torch advises)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _ms(fn) -> float:
    """A graph replay: do_bench (L2 cleared before each replay)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _eager(fn) -> float:
    """Eager calls back to back (host launch cost included; see autossd.bench.back_to_back_ms)."""
    return back_to_back_ms(fn, 1, 25, 200)


def one(prob, ceilings, peer) -> dict:
    runtime.clear_cache()
    arch = runtime.arch_of_device(torch.device("cuda"))
    ke = autossd.get_kernel(prob, arch, launch_mode="eager")
    kg = autossd.get_kernel(prob, arch, launch_mode="graph")
    res = {"problem": prob.key(), "eager_pick": ke.config.as_dict(), "eager_reason": ke.reason,
           "graph_pick": kg.config.as_dict(), "graph_reason": kg.reason,
           "same_config": ke.config == kg.config}
    t = make_inputs(prob, "cuda", seed=0)
    kw = call_kwargs(prob, t)
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], prob.chunk_size)
    drop_in = lambda: autossd.mamba_chunk_scan_combined(*args, **kw)  # noqa: E731
    for _ in range(3):
        drop_in()
    torch.cuda.synchronize()
    # the capture: the graph pick's first launch may happen here
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = drop_in()
    fresh = make_inputs(prob, "cuda", seed=1)
    for k, v in t.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v.copy_(fresh[k])
    g.replay()
    torch.cuda.synchronize()
    ref = ssd_chunked(*args, **{k: v for k, v in kw.items() if not k.startswith("return_")})[0]
    direct = kg(*args[:5], **kw)   # the graph pick run eagerly on the same inputs
    res["check"] = {"rel_err": rel_err(captured, ref), "tol": tolerance(prob.dtype),
                    "bitwise_vs_graph_pick_eager": bool(torch.equal(captured, direct))}
    res["check"]["ok"] = res["check"]["rel_err"] < res["check"]["tol"] and res["check"]["bitwise_vs_graph_pick_eager"]
    del ref, direct
    # timings
    call = {"eager_pick": lambda: ke(*args[:5], **kw), "graph_pick": lambda: kg(*args[:5], **kw)}
    ms = {}
    for name, fn in call.items():
        ms[f"{name}_eager_ms"] = _eager(fn)
        gr, _ = _graph(fn)
        ms[f"{name}_graph_ms"] = _ms(gr.replay)
        del gr
    ms["drop_in_eager_ms"] = _eager(drop_in)
    ms["drop_in_graph_ms"] = _ms(g.replay)   # the captured drop-in: the graph pick
    if peer is not None:
        pfn = lambda: peer(*args, **kw)  # noqa: E731
        for _ in range(3):   # its triton.autotune runs here, never inside the capture
            pfn()
        ms["mamba_ssm_eager_ms"] = _eager(pfn)
        try:
            gp, _ = _graph(pfn)
            ms["mamba_ssm_graph_ms"] = _ms(gp.replay)
            del gp
        except Exception as e:  # noqa: BLE001 - the peer's failure is reported, not ours
            res["mamba_ssm_graph_error"] = f"{type(e).__name__}: {e}"
    ms["floor_ms"] = floor_ms(prob, ceilings, kg.config.chunk_size)
    res["ms"] = ms
    del g, captured
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scratch", "bench_launch_modes"),
                    help="output folder (default: scratch/bench_launch_modes, git-ignored)")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--dtype", default="fp16,bf16")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    ceilings = measure_ceilings()
    peer = load_mamba_ssm()
    rows = []
    for dtype in a.dtype.split(","):
        for prob in parse_shapes([a.shapes], dtype):
            prob = prob.replace(chunk_size=256)
            r = one(prob, ceilings, peer)
            rows.append(r)
            m = r["ms"]
            p = prob
            peer_s = (f"mamba_ssm eager {m['mamba_ssm_eager_ms']:.4f} graph {m.get('mamba_ssm_graph_ms', float('nan')):.4f}"
                      if "mamba_ssm_eager_ms" in m else "mamba_ssm n/a")
            print(f"h={p.nheads} b={p.batch} L={p.seqlen} {dtype}: picks eager d{r['eager_pick']['launches']} "
                  f"graph d{r['graph_pick']['launches']}{' (same)' if r['same_config'] else ''} | "
                  f"eager ms: eager-pick {m['eager_pick_eager_ms']:.4f} graph-pick {m['graph_pick_eager_ms']:.4f} | "
                  f"graph ms: eager-pick {m['eager_pick_graph_ms']:.4f} graph-pick {m['graph_pick_graph_ms']:.4f} "
                  f"captured drop-in {m['drop_in_graph_ms']:.4f} | {peer_s} | floor {m['floor_ms']:.4f} | "
                  f"check {'ok' if r['check']['ok'] else 'FAIL'} err {r['check']['rel_err']:.1e}", flush=True)
    with open(os.path.join(a.out, "bench_launch_modes.json"), "w") as f:
        json.dump({"meta": run_meta(ceilings=ceilings), "rows": rows}, f, indent=1)
    return 0 if all(r["check"]["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
