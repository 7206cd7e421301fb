#!/usr/bin/env python
"""Time to a model's first SSD result in a fresh process: autossd (the shipped database picks the
config, nothing is benchmarked) against mamba_ssm (autotunes on its first call per config).

Each implementation runs in new processes, twice per round:
    cold   empty Triton and autossd kernel caches (a new machine, or a new Triton version)
    warm   the caches the cold process left (the same machine, a later process)
Per process: the import (torch is imported first and not counted), the first call until its
result is on the GPU (synchronized), and a later call. The same run also prints the call's
speed-of-light floor (min HBM bytes / measured copy bandwidth), for scale.

    python scripts/bench_cold_start.py --out DIR [--shape mamba2-2.7b:b=1,l=2048] [--dtype fp16]
        [--rounds 2] [--no-peer] [--trees OLD_DIR,.]

--trees: autossd checkouts (repo roots) whose code the autossd processes import, interleaved in
each round (an A/B of two versions in one run); default: this checkout.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--child" not in sys.argv:   # a child imports the tree its PYTHONPATH names (--trees), not ROOT
    sys.path.insert(0, str(ROOT))

IMPLS = ("autossd", "mamba_ssm")


def child(impl: str, shape: str, dtype: str) -> dict:
    """One fresh process: import, first call, a later call."""
    import torch
    torch.zeros(1, device="cuda")   # the CUDA context: paid by any GPU program, not counted
    torch.cuda.synchronize()
    if impl == "autossd":
        t0 = time.perf_counter()
        import autossd
        fn = autossd.mamba_chunk_scan_combined
        import_s = time.perf_counter() - t0
    else:
        import autossd
        from autossd.peer import load_mamba_ssm   # autossd's import is not mamba_ssm's
        t0 = time.perf_counter()
        fn = load_mamba_ssm()
        import_s = time.perf_counter() - t0
        if fn is None:
            return {"skipped": "mamba_ssm is not installed"}
    from autossd.testing import make_inputs
    from autossd.tuner.shapes import parse_shape
    prob = parse_shape(shape, dtype, op="ssd_fwd")
    t = make_inputs(prob, "cuda", seed=0)
    torch.cuda.synchronize()

    def call():
        with torch.inference_mode():
            return fn(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"], dt_bias=t["dt_bias"],
                      dt_softplus=True)
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    later_ms = (time.perf_counter() - t0) * 1e3
    return {"import_s": import_s, "first_call_s": first_s, "later_call_ms": later_ms,
            "autossd_file": autossd.__file__}   # which tree this process ran


def run_child(impl: str, shape: str, dtype: str, caches: Path, tree: Path = ROOT) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"), AUTOSSD_CACHE_DIR=str(caches / "autossd"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    env.pop("AUTOSSD_DB", None)     # the shipped database only
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, __file__, "--child", impl, "--shape", shape, "--dtype", dtype],
                             env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "no result within 900 s", "process_s": 900.0}
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"error": out.stderr[-2000:], "process_s": wall}
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = wall
    if impl == "autossd" and not res.get("autossd_file", "").startswith(str(tree)):
        res = {"error": f"imported {res.get('autossd_file')}, not the tree {tree}", "process_s": wall}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--shape", default="mamba2-2.7b:b=1,l=2048")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--trees", default=str(ROOT), help="comma-separated autossd checkouts")
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.shape, a.dtype)))
        return 0

    from autossd.bench import floor_ms, measure_ceilings, run_meta
    from autossd.tuner.shapes import parse_shape
    prob = parse_shape(a.shape, a.dtype, op="ssd_fwd")
    ceilings = measure_ceilings()
    floor = floor_ms(prob, ceilings)
    trees = [Path(p).resolve() for p in a.trees.split(",")]
    runs = [(f"autossd{'' if len(trees) == 1 else ' (' + t.name + ')'}", "autossd", t) for t in trees]
    if not a.no_peer:
        runs.append(("mamba_ssm", "mamba_ssm", ROOT))
    rows: dict[str, list[dict]] = {f"{name} {m}": [] for name, _, _ in runs for m in ("cold", "warm")}
    for r in range(a.rounds):
        for name, impl, tree in runs:
            with tempfile.TemporaryDirectory(prefix="cold-") as d:
                for mode in ("cold", "warm"):   # warm reuses what cold left in d
                    res = run_child(impl, a.shape, a.dtype, Path(d), tree)
                    rows[f"{name} {mode}"].append(res)
                    shown = {k: round(v, 3) for k, v in res.items() if isinstance(v, float)}
                    print(f"round {r} {name:9s} {mode}: {shown}{'  ' + res['error'][-300:] if 'error' in res else ''}",
                          flush=True)
    print(f"\n{a.shape} {a.dtype}: floor {floor * 1e3:.1f} us per call "
          f"({ceilings['copy_GBps']:.0f} GB/s copy)")
    print(f"{'':30s} {'import s':>9s} {'first call s':>13s} {'import+first s':>15s} {'later call ms':>14s}")
    summary = {}
    for name, rs in rows.items():
        ok = [x for x in rs if "first_call_s" in x]
        if not ok:
            print(f"{name:30s} {'(no result: ' + (rs[0].get('skipped') or 'error') + ')' if rs else ''}")
            continue
        med = {k: statistics.median(x[k] for x in ok) for k in ("import_s", "first_call_s", "later_call_ms")}
        med["import_plus_first_s"] = statistics.median(x["import_s"] + x["first_call_s"] for x in ok)
        summary[name] = med
        print(f"{name:30s} {med['import_s']:9.2f} {med['first_call_s']:13.2f} "
              f"{med['import_plus_first_s']:15.2f} {med['later_call_ms']:14.3f}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_cold_start.json").write_text(json.dumps(
        {"meta": run_meta(shape=a.shape, dtype=a.dtype, trees=[str(t) for t in trees]), "ceilings": ceilings, "floor_ms": floor,
         "rounds": rows, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
