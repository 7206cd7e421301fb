#!/usr/bin/env python
"""Sweep the decode step's knobs on a GPU: graph-timed µs and % of copy bandwidth per config, at
mamba2-2.7b dimensions, for a few batches and state dtypes (every config a measured tune of
ssd_decode could try, as a whole table). Each config is checked against float64 once first; one
that is wrong is reported and not timed. Needs a CUDA GPU.

Run it after changing the decode kernel or its knob space, to see whether the default still
holds, and on a new GPU to ship its decode records:

    python scripts/sweep_decode.py [--out scratch/sweep_decode.json] [--batch 1 16 64] [--state fp32 bf16 fp16]
    python scripts/build_shipped_db.py --decode-sweep scratch/sweep_decode.json ...

The JSON names the device, the call timed (the DecodeProblem fields besides batch and state
dtype), the triton version, the date and each config's kernel hash, so that
`scripts/build_shipped_db.py --decode-sweep FILE` can ship each shape's fastest config as a
measured record that turns stale when the kernels change.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
spec = importlib.util.spec_from_file_location("bench_decode", os.path.join(ROOT, "scripts", "bench_decode.py"))
bd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="scratch/sweep_decode.json", help="the JSON written")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="rows per call")
    ap.add_argument("--state", nargs="+", default=["fp32", "bf16", "fp16"], choices=("fp32", "bf16", "fp16"),
                    help="state dtypes of the cache")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_decode.py: no GPU here; it times the decode step on one")
        return 2
    import datetime

    import triton

    import autossd
    from autossd.ops.ssd.decode_knobs import DecodeConfig, default_config
    from autossd.render import kernel_hash
    from autossd.ops.ssd.naive import state_update_ref
    from autossd.testing import rel_err
    h, p, n, g = 80, 64, 128, 1
    bw = bd.copy_gbps()
    rows = []
    grid = itertools.product((4, 8, 16, 32, 64), (1, 2), (1, 2, 4, 8), (0, 1))
    configs = [DecodeConfig(block_p=bp, heads=hd, warps=w, stream=s) for bp, hd, w, s in grid]
    for sd in a.state:
        for batch in a.batch:
            nsets = max(1, min(16, -(-bd.L2_BYTES // max(1, bd.nbytes(batch, h, p, n, g, sd)))))
            common, sets = bd.make(batch, h, p, n, g, sd, nsets)
            size = bd.nbytes(batch, h, p, n, g, sd)
            best = None
            for cfg in configs:
                fn = lambda *args, **kw: autossd.selective_state_update(*args, **kw, config=cfg)  # noqa: E731
                st = sets[0]
                s0 = st["state"].clone()
                try:
                    y = bd.call_of(fn, common, {**st, "state": s0})()
                except (ValueError, RuntimeError):   # infeasible here (violations), or out of resources
                    continue
                ry, _ = state_update_ref(st["state"], st["x"], common["dt"], common["A"], st["B"], st["C"],
                                         common["D"], st["z"], common["dt_bias"], True, None)
                err = rel_err(y, ry)
                if not err < 2.5e-2:
                    print(f"WRONG {sd} b={batch} {cfg}: {err:.2e}")
                    continue
                us = bd.graph_us([bd.call_of(fn, common, s) for s in sets])
                row = {"state": sd, "batch": batch, "config": cfg.as_dict(), "graph_us": us,
                       "pct_copy": 100 * size / (us * 1e-6) / 1e9 / bw, "kernel_hash": kernel_hash(cfg, "cuda")}
                rows.append(row)
                if best is None or us < best["graph_us"]:
                    best = row
            dflt = default_config("sm90", None)
            print(f"{sd} batch {batch}: best {best['graph_us']:.2f} us ({best['pct_copy']:.1f}% of copy) "
                  f"{ {k: v for k, v in best['config'].items() if v != dflt[k]} }", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        # the call scripts/bench_decode.py's make() builds: bf16 x, z, B and C; D, dt_bias, softplus
        call = dict(nheads=h, headdim=p, dstate=n, ngroups=g, dtype="bf16", has_D=True, has_z=True,
                    has_dt_bias=True, dt_softplus=True, tokens=1)
        json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": bw, "triton": triton.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "call": call, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
