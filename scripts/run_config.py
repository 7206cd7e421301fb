"""Run the forward of one shape with its shipped config (or with knobs overridden), for a
profiler to attach to (ncu, nsys): a warm-up call, then --calls calls, synchronized.

    ncu -k regex:ssd_chunk_scan -c 1 python scripts/run_config.py --shape 'mamba2-2.7b:b=1,l=131072' \
        --dtype fp16 [--set scan_gluon=3 ...] [--mode graph]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autossd.ops.ssd.chunk import execute  # noqa: E402
from autossd.runtime import get_kernel  # noqa: E402
from autossd.space import KNOB_BY_NAME, fit  # noqa: E402
from autossd.testing import call_kwargs, make_inputs  # noqa: E402
from autossd.tuner.shapes import parse_shape  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, help="preset:b=..,l=.. as `autossd tune --shape` takes")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--mode", default="graph", choices=("eager", "graph"), help="which launch mode's record")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a knob")
    ap.add_argument("--calls", type=int, default=1)
    a = ap.parse_args()
    prob = parse_shape(a.shape, a.dtype)
    cfg = get_kernel(prob, arch="sm90", launch_mode=a.mode).config
    for kv in a.set:
        k, _, v = kv.partition("=")
        if k not in KNOB_BY_NAME:
            sys.exit(f"--set {kv}: no knob named {k!r}")
        cfg = cfg.replace(**{k: type(KNOB_BY_NAME[k].default)(v) if not isinstance(KNOB_BY_NAME[k].default, bool)
                             else v.lower() in ("1", "true")})
    cfg = fit(cfg, prob)
    print(prob.key(), cfg.as_dict(), flush=True)
    t = make_inputs(prob, "cuda", seed=1)
    kw = call_kwargs(prob, t)
    tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")}
    lim = kw.get("dt_limit", (0.0, float("inf")))
    execute(prob, cfg, tensors, cu_seqlens=t["cu_seqlens"], dt_limit=lim)   # compile, warm
    torch.cuda.synchronize()
    for _ in range(a.calls):
        execute(prob, cfg, tensors, cu_seqlens=t["cu_seqlens"], dt_limit=lim)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
