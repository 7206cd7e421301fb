"""Roofline of a benchmark run: autossd and mamba_ssm for every shape of bench_ssd.json, under the
roofline of the ceilings measured in that run (copy bandwidth, bf16 matmul rate). A point's
intensity is causal FLOPs / min HBM bytes, its rate FLOPs / measured time; the distance below the
line is the gap to the floor.

    python scripts/plot_bench.py docs/bench-data/bench_ssd_2026-11-24.json [more.json ...] --out roofline.png

Times: CUDA-graph replay where the run has it for both (the drop-in's graph pick, mamba_ssm in a
graph), else the eager times (the drop-in, or the default config where it was faster). Several
files (one run split by dtype or shape) plot together under the first file's ceilings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.problem import Problem  # noqa: E402
from autossd.tuner.shapes import MODELS  # noqa: E402


def _times(r: dict) -> tuple[float, float | None]:
    """(autossd ms, mamba_ssm ms or None) of a row, in one timing mode: graph replay where both
    were timed so (ten calls per graph among another library's kernels, as in a model, where the
    run has it), else eager."""
    if r.get("dropin_graph10_mixed_ms") and (r.get("peer_graph10_mixed_ms") or not r.get("peer_ms")):
        return r["dropin_graph10_mixed_ms"], r.get("peer_graph10_mixed_ms")
    if r.get("dropin_graph_ms") and (r.get("peer_graph_ms") or not r.get("peer_ms")):
        return r["dropin_graph_ms"], r.get("peer_graph_ms")
    ours = min([r["dropin_ms"]] + ([r["autossd"]["ms"]] if "autossd" in r else []))
    return ours, r.get("peer_ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_json", nargs="+")
    ap.add_argument("--out", default="roofline.png")
    a = ap.parse_args()
    runs = [json.load(open(p)) for p in a.bench_json]
    data = {"meta": runs[0]["meta"], "rows": [r for run in runs for r in run["rows"]]}
    ceil = data["meta"]["ceilings"]
    bw, peak = ceil["copy_GBps"] * 1e9, ceil["bf16_matmul_TFLOPs"] * 1e12
    fig, ax = plt.subplots(figsize=(8, 5.5))
    xs = [2.0 ** (k / 8) for k in range(40, 81)]   # 32 .. 1024 FLOP/byte: where SSD shapes sit
    ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], color="k", lw=1,
            label=f"roofline: {ceil['copy_GBps']:.0f} GB/s, {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    marks = {"fp16": "o", "bf16": "s"}
    for i, r in enumerate(data["rows"]):
        h, p, n, g = MODELS[r["model"]]
        prob = Problem(batch=r["batch"], seqlen=r["seqlen"], nheads=h, headdim=p, dstate=n, ngroups=g,
                       dtype=r["dtype"])
        flops, ai = prob.flops(256), prob.flops(256) / prob.min_bytes()
        ours, theirs = _times(r)
        label = f"{r['model']} {r['batch']}x{r['seqlen']}"
        ax.scatter([ai], [flops / (ours * 1e-3) / 1e12], marker=marks[r["dtype"]], color="tab:blue",
                   s=36, zorder=3)
        if theirs:
            ax.scatter([ai], [flops / (theirs * 1e-3) / 1e12], marker=marks[r["dtype"]],
                       facecolors="none", edgecolors="tab:red", s=36, zorder=3)
        if r["dtype"] == "fp16":
            ax.annotate(label, (ai, flops / (ours * 1e-3) / 1e12), fontsize=6, xytext=(8, 10 * (i % 4) - 12),
                        textcoords="offset points", arrowprops=dict(arrowstyle="-", lw=0.3))
    ax.scatter([], [], color="tab:blue", label="autossd (filled)")
    ax.scatter([], [], facecolors="none", edgecolors="tab:red", label="mamba_ssm (hollow)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (causal FLOP / min HBM byte)")
    ax.set_ylabel("TFLOP/s")
    mixed = any(r.get("dropin_graph10_mixed_ms") for r in data["rows"])
    mode = "10 calls per CUDA graph among another kernel" if mixed else "one call per CUDA graph, or eager"
    ax.set_title(f"SSD forward, {data['meta']['device']}, {data['meta']['date']} (o fp16, □ bf16)\n"
                 f"time per call: {mode}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=130)
    print(a.out)


if __name__ == "__main__":
    main()
