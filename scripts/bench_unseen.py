"""Every shape fast: on shapes no database was tuned at, the forward the lookup picks against the
arch default and against a 30-trial measured tune at that very shape, in one run on the local GPU.

    python scripts/bench_unseen.py --out FILE.json [--count 12] [--seed 0] [--trials 30] [--only 0,1,2]
    python scripts/bench_unseen.py --list            # the drawn shapes only (no GPU needed)

Shapes are drawn at random (seeded) from the space of real models' SSD layers (tuner/shapes.py
MODELS) x batch 1-64 x length 512-131072 (both log-uniform; lengths a multiple of 64), Mamba-2's
call (D, dt_bias, softplus; fp16 unless --dtype), keeping the grid's token cap and leaving out
every grid point (tuner/shapes.py grid_sizes): what a new user's call looks like. Per shape:
  lookup   the config autossd.get_kernel picks from the shipped and user databases (exact,
           nearest, transfer or default tier: the JSON says which and why);
  default  the arch default;
  tuned    the best of `autossd tune --trials N --mode measured` at that shape, into a scratch
           database of this run (--scratch-db) that the lookup above does not see. A tune
           starts from the default and from the lookup's pick (both enqueued before its
           sampler draws), so `tuned` is what a user's tune at that shape finds beyond the
           pick (the figures of 2026-11-26 in BENCHMARKS predate that seeding: their tunes
           started from the default and the op's own seeds).
Each is timed by triton's do_bench on the same inputs, eager calls of ssd_forward with the
config given. --only picks shapes by index, so a long run can be split over several calls
(rows already in --out are kept); the target is lookup within 15% of tuned at every shape.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.problem import Problem  # noqa: E402
from autossd.tuner.shapes import GRID_MAX_TOKENS, MODEL_FLAGS, MODELS, grid_sizes  # noqa: E402


def draw(count: int, seed: int, dtype: str) -> list[tuple[str, Problem]]:
    """`count` distinct (model, problem) pairs off the grid, reproducible from `seed`."""
    rng = random.Random(seed)
    on_grid = set(grid_sizes())
    models = sorted(MODELS)
    out, seen = [], set()
    while len(out) < count:
        model = rng.choice(models)
        b = round(2 ** rng.uniform(0, 6))
        l = 64 * max(8, round(2 ** rng.uniform(math.log2(512), math.log2(131072)) / 64))
        if b * l > GRID_MAX_TOKENS or (b, l) in on_grid or (model, b, l) in seen:
            continue
        seen.add((model, b, l))
        h, p, n, g = MODELS[model]
        out.append((model, Problem(b, l, h, p, n, g, dtype, chunk_size=256, **MODEL_FLAGS)))
    return out


def _spec(p: Problem) -> str:
    return f"b={p.batch},l={p.seqlen},h={p.nheads},p={p.headdim},n={p.dstate},g={p.ngroups}"


def _time(prob: Problem, config) -> float:
    import torch
    from triton.testing import do_bench

    from autossd.ops.ssd import chunk
    from autossd.testing import make_inputs
    t = make_inputs(prob, "cuda", seed=0)
    ms = do_bench(lambda: chunk.ssd_forward(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"],
                                            dt_bias=t["dt_bias"], dt_softplus=True, config=config),
                  warmup=25, rep=100, return_mode="median")
    t = None   # its tensors freed before empty_cache (the lambda above still names t)
    torch.cuda.empty_cache()
    return ms


def measure(model: str, prob: Problem, trials: int, scratch: str, tune_only: bool = False) -> dict:
    import autossd
    from autossd.db.lookup import clear_cache, load_records, pick
    from autossd.ops.ssd.fwd_knobs import default_config
    from autossd.runtime import arch_of_device
    arch = arch_of_device()
    kern = autossd.get_kernel(prob, arch)
    row = {"model": model, "shape": _spec(prob), "dtype": prob.dtype, "arch": arch,
           "lookup_source": kern.source, "lookup_reason": kern.reason,
           "lookup_config": kern.config.as_dict()}
    tuned = pick(prob, load_records(arch, "ssd_fwd", scratch), arch, max_distance=0.0) \
        if os.path.exists(scratch) else None
    if tuned is None or tuned.kind != "exact":   # a tune of an earlier call is kept and reused
        subprocess.run([sys.executable, "-m", "autossd.cli", "tune", "--shapes", _spec(prob), "--dtype",
                        prob.dtype, "--trials", str(trials), "--mode", "measured", "--db", scratch,
                        "--compile-workers", str(min(16, os.cpu_count() or 2))], check=True)
        clear_cache()   # the tune wrote from another process: the records read above are stale
        tuned = pick(prob, load_records(arch, "ssd_fwd", scratch), arch, max_distance=0.0)
    if tune_only:
        return row
    if tuned.kind != "exact":
        raise RuntimeError(f"{_spec(prob)}: the tune stored no record ({tuned.reason})")
    row["tuned_config"] = tuned.config.as_dict()
    row["lookup_ms"] = _time(prob, kern.config)
    row["default_ms"] = _time(prob, default_config(arch, prob))
    row["tuned_ms"] = _time(prob, tuned.config)
    row["lookup_over_tuned"] = row["lookup_ms"] / row["tuned_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated indices of the drawn shapes to run")
    ap.add_argument("--out", default=None, help="JSON file; rows already in it are kept")
    ap.add_argument("--scratch-db", default="scratch/bench_unseen.sqlite",
                    help="where the tunes store their records (not the lookup's database)")
    ap.add_argument("--list", action="store_true", help="print the drawn shapes and exit")
    ap.add_argument("--tune-only", action="store_true",
                    help="only tune into --scratch-db (a later call times lookup, default and tuned)")
    a = ap.parse_args(argv)
    shapes = draw(a.count, a.seed, a.dtype)
    if a.list:
        for i, (model, p) in enumerate(shapes):
            print(f"{i:2d} {model:20s} {_spec(p)} {p.dtype}")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("no GPU: this script measures on a GPU (--list draws the shapes without one)")
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(a.scratch_db)), exist_ok=True)
    rows = {}
    if a.out and os.path.exists(a.out):
        with open(a.out) as f:
            rows = {r["index"]: r for r in json.load(f)["rows"]}
    pick_ = [int(i) for i in a.only.split(",")] if a.only else range(len(shapes))
    for i in pick_:
        model, prob = shapes[i]
        row = measure(model, prob, a.trials, a.scratch_db, a.tune_only)
        if a.tune_only:
            continue
        row["index"] = i
        rows[i] = row
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                          if not k.endswith("_config")}), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "seed": a.seed, "trials": a.trials,
                           "rows": [rows[k] for k in sorted(rows)]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
