"""Benchmark: autossd's SSD forward against mamba_ssm (optional peer) and the speed-of-light
floor, in one run, on the local GPU.

    python scripts/bench_ssd.py --out DIR [--dtypes fp16,bf16] [--shapes mamba2-2.7b:1x2048,...]
        [--stages] [--sweep JSON] [--depths 3,1] [--no-default]

Ceilings are measured in the same run: a device-to-device copy (bytes read + written) and a bf16
matmul. floor = max(min HBM bytes / copy rate, causal FLOPs / matmul rate), min bytes = x + y +
B + C + dt. The call is Mamba2's: D (h,), dt_bias, dt_softplus, chunk 256, no z. "default" is the
five-launch default config; --depths also times each other fusion depth's default; "drop-in" is
autossd.mamba_chunk_scan_combined choosing from the tuned databases: timed by eager calls (its
eager pick) and by replaying CUDA graphs (its graph pick), as mamba_ssm is: of one call (each
replay pays the graph's launch), of ten calls back to back (per call), and of ten calls each
followed by another library's small kernel (its time subtracted), as in a model captured whole.
The headline (share of the floor, speed-up over mamba_ssm) is the drop-in's, in each mode.
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
import autossd  # noqa: E402
from autossd.bench import ClockLog, floor_ms, measure_ceilings, run_meta, stage_times  # noqa: E402
from autossd.ops.ssd import chunk as ssd_chunk  # noqa: E402
from autossd.peer import load_mamba_ssm  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.tuner.shapes import MODELS, PRESET_SHAPES  # noqa: E402
from autossd.ops.ssd.fwd_knobs import Config, default_config  # noqa: E402
from autossd.testing import make_inputs  # noqa: E402

DESIGN_SHAPES = [(m, b, l) for m, shapes in PRESET_SHAPES.items() for b, l in shapes]  # the benchmark's model shapes


def problem_for(model, b, l, dtype):
    h, p, n, g = MODELS[model]
    return Problem(batch=b, seqlen=l, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=dtype,
                   chunk_size=256, has_D=True, has_dt_bias=True, dt_softplus=True)


def bench_autossd(prob, t, cfg: Config, stages: bool):
    def call():
        return ssd_chunk.ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"],
                                     dt_bias=t["dt_bias"], dt_softplus=True, config=cfg)
    res = {"ms": do_bench(call, warmup=25, rep=200, return_mode="median")}
    if stages:
        tensors = {k: t[k] for k in ssd_chunk.INPUTS}
        res.update({f"stage_{k}_ms": v for k, v in stage_times(prob, cfg, tensors).items()})
    return res


def _vs(row: dict, ours: str, peer: str) -> str:
    """'autossd T ms (F% of floor), mamba_ssm T ms, Sx' for one timing mode of a row."""
    ms, pm = row[ours], row.get(peer)
    out = f"autossd {ms:8.3f} ms ({100 * row['floor_ms'] / ms:5.1f}% of floor)"
    return out + ("" if pm is None else f"  mamba_ssm {pm:8.3f} ms  {pm / ms:5.2f}x")


def graph_ms(fn, calls: int = 1, between=None) -> float:
    """Median ms per call replayed from a CUDA graph of `calls` calls (a warm eager call first:
    it compiles and autotunes). One call per graph pays the graph's launch on every replay; ten
    calls in one graph are what a model captured whole sees (its other kernels sit between the
    SSD calls: `between`, run after each call and its own time subtracted, stands in for them)."""
    fn()
    torch.cuda.synchronize()

    def timed(body):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                body()
        ms = do_bench(g.replay, warmup=10, rep=100, return_mode="median") / calls
        del g
        return ms
    if between is None:
        return timed(fn)
    return timed(lambda: (fn(), between())) - timed(between)


def _other_kernel():
    """One small kernel of another library (an in-place add on 64 K floats): between two SSD calls
    it ends any overlap of one call's last launch with the next call's first (PDL), as the rest
    of a model's layer does."""
    sink = torch.zeros(1 << 16, device="cuda")
    return lambda: sink.add_(1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--dtypes", default="fp16,bf16")
    ap.add_argument("--stages", action="store_true", help="also time each stage alone")
    ap.add_argument("--sweep", default="", help="JSON list of config overrides to time too")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--depths", default="3,1", help="other fusion depths to time at their defaults ('': none)")
    ap.add_argument("--shapes", default="", help="only these of the benchmark's model shapes, model:BxL,... (default: all)")
    ap.add_argument("--no-default", action="store_true", help="do not time the five-launch default config")
    a = ap.parse_args()
    shapes = DESIGN_SHAPES
    if a.shapes:
        want = {(m, int(bl.split("x")[0]), int(bl.split("x")[1]))
                for m, bl in (v.split(":") for v in a.shapes.split(","))}
        unknown = want - set(DESIGN_SHAPES)
        if unknown:
            ap.error(f"--shapes: {sorted(unknown)} not among the benchmark's model shapes {DESIGN_SHAPES}")
        shapes = [v for v in DESIGN_SHAPES if v in want]
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
          flush=True)
    peer = None if a.no_peer else load_mamba_ssm()
    sweep = json.loads(a.sweep) if a.sweep else []
    rows = []
    other = _other_kernel()
    clocks = ClockLog()
    for dtype in a.dtypes.split(","):
        for model, b, l in shapes:
            prob = problem_for(model, b, l, dtype)
            t = make_inputs(prob, "cuda", seed=7)
            row = {"model": model, "batch": b, "seqlen": l, "dtype": dtype, "floor_ms": floor_ms(prob, ceil)}
            cfg = default_config("sm90", prob)
            if not a.no_default:
                row["autossd"] = bench_autossd(prob, t, cfg, a.stages)
                row["autossd_config"] = cfg.as_dict()
            for d in [int(v) for v in a.depths.split(",") if v]:
                c = default_config("sm90", prob, launches=d)
                row[f"launches{d}"] = {"config": c.as_dict(), **bench_autossd(prob, t, c, False)}
            # the user's path: validation, lookup in the tuned databases, launch
            k = autossd.get_kernel(prob.replace(chunk_size=256), "sm90")
            kg = autossd.get_kernel(prob.replace(chunk_size=256), "sm90", launch_mode="graph")

            def dropin():
                return autossd.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"],
                                                         dt_bias=t["dt_bias"], dt_softplus=True)
            # each drop-in timing with the SM clock it ran at (ten-call graphs of 3-5 ms calls reach the power limit and clock lower)
            for key, timing in (("dropin_ms", lambda: do_bench(dropin, warmup=25, rep=200, return_mode="median")),
                                ("dropin_graph_ms", lambda: graph_ms(dropin)),
                                ("dropin_graph10_ms", lambda: graph_ms(dropin, 10)),
                                ("dropin_graph10_mixed_ms", lambda: graph_ms(dropin, 10, other))):
                t0 = clocks.mark()
                row[key] = timing()
                row.setdefault("clocks", {})[key] = clocks.window(t0)
            row["dropin_choice"] = {"source": k.source, "provenance": k.provenance, "config": k.config.as_dict()}
            row["dropin_graph_choice"] = {"source": kg.source, "provenance": kg.provenance,
                                          "config": kg.config.as_dict()}
            for i, over in enumerate(sweep):
                try:
                    c = default_config("sm90", prob).replace(**over)
                    row[f"sweep_{i}"] = {"override": over, **bench_autossd(prob, t, c, False)}
                except Exception as e:
                    row[f"sweep_{i}"] = {"override": over, "error": repr(e)[:300]}
            if peer is not None:
                try:
                    t0 = time.perf_counter()
                    peer(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"], dt_bias=t["dt_bias"],
                         dt_softplus=True)
                    torch.cuda.synchronize()
                    row["peer_first_call_s"] = time.perf_counter() - t0
                    def peer_call():
                        return peer(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"], dt_bias=t["dt_bias"],
                                    dt_softplus=True)
                    row["peer_ms"] = do_bench(peer_call, warmup=25, rep=200, return_mode="median")
                    row["peer_graph_ms"] = graph_ms(peer_call)
                    row["peer_graph10_ms"] = graph_ms(peer_call, 10)
                    row["peer_graph10_mixed_ms"] = graph_ms(peer_call, 10, other)
                except Exception as e:
                    row["peer_error"] = repr(e)[:300]
            rows.append(row)
            extra = " ".join(f"s{i}={row[f'sweep_{i}'].get('ms', float('nan')):.3f}" for i in range(len(sweep)))
            extra += " " + " ".join(f"L{k[8:]}={v['ms']:.3f}" for k, v in row.items() if k.startswith("launches"))
            if "autossd" in row:
                extra += f" default={row['autossd']['ms']:.3f}"
            mhz = " ".join(f"{k[7:-3] or 'eager'}={v.get('sm_mhz_median', 0):.0f}" for k, v in row["clocks"].items())
            print(f"{dtype} {model:13s} {b}x{l:<7d} floor {row['floor_ms']:.3f} ms | "
                  f"{_vs(row, 'dropin_ms', 'peer_ms')} eager | "
                  f"{_vs(row, 'dropin_graph_ms', 'peer_graph_ms')} graph | "
                  f"{_vs(row, 'dropin_graph10_ms', 'peer_graph10_ms')} graph x10 | "
                  f"{_vs(row, 'dropin_graph10_mixed_ms', 'peer_graph10_mixed_ms')} graph x10 mixed | {extra} | MHz {mhz}",
                  flush=True)
            t = None   # its tensors freed before empty_cache (the closures above still name t)
            torch.cuda.empty_cache()
            # rewritten after every shape: a run cut by its time limit keeps the shapes it timed
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "bench_ssd.json"), "w") as f:
                json.dump({"meta": run_meta(ceilings=ceil), "rows": rows}, f, indent=1)
    clocks.close()


if __name__ == "__main__":
    main()
