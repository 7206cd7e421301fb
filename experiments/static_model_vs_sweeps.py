"""The static model's ranking of the decode step's and packed prefill's configs (sm90) against
the H200 sweeps in docs/bench-data (no GPU needed: cross-compiles and predicts each swept config):
per case the Spearman correlation of predicted and measured graph time, the measured time of the
model's top-1 and of the arch default over the measured best. The top-1 is what a static tune
would store: the default unless a config is predicted at least STATIC_MIN_GAIN (2%) faster. This decides whether static records of those ops are worth
shipping for arches nobody measured. The decode step is checked against both H200 sweeps: 38
configs per case at batch 16 and 64 (the streaming-policy sweep's plain half) and 60 per case
at batch 1, 16 and 64 (the first sweep).

    python experiments/static_model_vs_sweeps.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
DATA = os.path.join(ROOT, "docs", "bench-data")


def _score(runner, configs, measured, default):
    from model_quality import spearman
    pred, meas, keep = [], [], []
    for c, p, m in zip(configs, runner.prepare(configs), measured):
        o = runner.evaluate(c, p)
        if o.ok and m:
            pred.append(o.time_ms)
            meas.append(m)
            keep.append(c)
    best = min(meas)
    dm = next((m for c, m in zip(keep, meas) if c == default), None)
    # what a static tune stores: the default unless a config is predicted STATIC_MIN_GAIN faster
    from autossd.tuner.study import static_keeps_default
    top = min(range(len(pred)), key=lambda i: (pred[i], keep[i] != default, i))
    if default in keep and static_keeps_default(pred[top], pred[keep.index(default)]):
        top = keep.index(default)
    return dict(n=len(meas), spearman=round(spearman(pred, meas), 3),
                top1_over_best=round(meas[top] / best, 3), top1_is_default=keep[top] == default,
                default_over_best=round(dm / best, 3) if dm else None)


def decode_rows() -> list[dict]:
    from autossd.ops.ssd.decode_knobs import DecodeConfig, DecodeProblem, default_config
    from autossd.tuner.runners.static import StaticRunner
    out = []
    for sweep in ("sweep_decode_stream_h200_2026-11-26.json", "sweep_decode_h200_2026-11-26.json"):
        d = json.load(open(os.path.join(DATA, sweep)))
        groups: dict = {}
        for r in d["rows"]:
            if not r["config"].get("stream", 0):   # the model cannot see the cache policy
                groups.setdefault((r["batch"], r["state"]), []).append(r)
        for (batch, state), rows in sorted(groups.items()):
            pr = DecodeProblem(batch, 80, 64, 128, 1, "bf16", state, has_D=True, has_z=True, has_dt_bias=True,
                               dt_softplus=True)
            row = _score(StaticRunner("sm90", pr), [DecodeConfig(r["config"]) for r in rows],
                         [r.get("graph_us") for r in rows], default_config("sm90", pr))
            out.append(dict(op="ssd_decode", sweep=sweep, batch=batch, state=state, **row))
            print(out[-1], flush=True)
    return out


def varlen_rows() -> list[dict]:
    from autossd.ops.ssd.varlen_knobs import VarlenConfig, default_config
    from autossd.tuner.runners.static import StaticRunner
    from autossd.tuner.shapes import parse_shape
    d = json.load(open(os.path.join(DATA, "bench_varlen_h200_2026-11-26.json")))
    pr = parse_shape("mamba2-2.7b:t=8192,s=16,z=1", "bf16", "ssd_varlen")
    row = _score(StaticRunner("sm90", pr), [VarlenConfig(r["config"]) for r in d["sweep"]],
                 [r["graph_ms"] for r in d["sweep"]], default_config("sm90", pr))
    out = [dict(op="ssd_varlen", tokens=8192, seqs=16, **row)]
    print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = decode_rows() + varlen_rows()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"what": "static sm90 model vs the H200 decode and packed-prefill sweeps", "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
