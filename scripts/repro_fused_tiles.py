#!/usr/bin/env python
"""Checks the installed Triton for the sm90 miscompile of the forward's single launch that
`fwd_knobs.violations` steps around (the arch flag `wgmma_fused_tile_bug`). Needs a CUDA GPU, an
H100 or H200 to see the bug.

With the headdim split over programs (state_block_m < headdim) beside a chunk-scan tile of
scan_block_m >= 64 and a warpgroup MMA, Triton 3.6 on an H100 gives a y off by O(1) from row 16
of each tile, and an illegal address at 2048 tokens. This runs a grid of such configs and
headdims, each in its own process (an illegal address poisons the CUDA context), each checked
against the float64 reference, and prints which are wrong or fault. Run it after a Triton
upgrade, before lifting the refusal: when it reports 0 wrong, clear the arch flag.

    python scripts/repro_fused_tiles.py [--out DIR] [--headdims 32,64,128] [--tiles 64x64,32x32,128x64]

Writes DIR/repro_fused_tiles.json (default DIR: scratch/repro_fused_tiles, git-ignored); exit
status 1 when any config is wrong or faults.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from autossd.ops.ssd.chunk import ssd_forward  # noqa: E402
from autossd.ops.ssd.naive import ssd_chunked  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.ops.ssd.fwd_knobs import default_config, fit  # noqa: E402
from autossd.testing import call_kwargs, make_inputs, rel_err, tolerance  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def one(p, over, dtype="fp16"):
    prob = Problem(batch=1, seqlen=300, nheads=2, headdim=p, dstate=128, ngroups=1, dtype=dtype,
                   has_D=True, has_dt_bias=True, dt_softplus=True, return_final_states=True)
    cfg = fit(default_config("sm90", prob, launches=over.get("launches", 1)).replace(**over), prob)
    # not filtered by violations(): it refuses exactly these configs on sm90 now (the point here
    # is to see whether the installed Triton still miscompiles them)
    t = make_inputs(prob, DEV, seed=3)
    kw = call_kwargs(prob, t)
    y, fin = ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size, config=cfg, poison=True, **kw)
    ref = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], cfg.chunk_size,
                      **{k: v for k, v in kw.items() if not k.startswith("return_")})
    e = rel_err(y, ref[0])
    return {"p": p, "override": over, "y_err": e, "final_err": rel_err(fin, ref[1]),
            "ok": e <= tolerance(dtype, cfg.state_dtype)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "scratch", "repro_fused_tiles"),
                    help="output folder (default: scratch/repro_fused_tiles, git-ignored)")
    ap.add_argument("--headdims", default="32,64,128", help="headdims to run, comma-separated")
    ap.add_argument("--tiles", default="64x64,32x32,128x64",
                    help="scan_block_m x scan_block_k tiles to run, comma-separated")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if DEV != "cuda":
        print("repro_fused_tiles.py: no GPU here; the miscompile is the GPU compiler's")
        return 2
    if a.one:
        p, over = json.loads(a.one)
        try:
            r = one(p, over)
            if DEV == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # a fault or compile error is a result too
            r = {"p": p, "override": over, "error": repr(e)[:200]}
        print("RESULT " + json.dumps(r))
        return 0
    rows = []
    tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")]
    for p, sbm, warps, (bm, bk) in itertools.product(
            (int(v) for v in a.headdims.split(",")), (16, 32, 64, 128), (2, 4, 8), tiles):
        if sbm > p:
            continue
        over = {"launches": 1, "state_block_m": sbm, "scan_warps": warps, "scan_block_m": bm, "scan_block_k": bk,
                "scan_maxnreg": 0}
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps([p, over])],
                             capture_output=True, text=True).stdout
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        r = json.loads(line[0][7:]) if line else {"p": p, "override": over, "error": "no result"}
        r["env_disable_mma_v3"] = os.environ.get("DISABLE_MMA_V3", "")
        rows.append(r)
        print(json.dumps(r), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "repro_fused_tiles.json"), "w") as f:
        json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r.get("ok")]
    print(f"{len(bad)} wrong of {len(rows)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
