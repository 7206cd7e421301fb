"""How well the static performance model (autossd/tuner/model.py `predict`) ranks forward configs
on sm90: random configs of the static sm90 space, each predicted from its compile report and
measured on the local H100/H200, per shape.

    python scripts/model_quality.py --out FILE.json --shapes "mamba2-2.7b:b=4,l=16384;b=2,l=6000,h=64,p=64,n=128,g=1"
        [--configs 200] [--seed 0] [--dtype fp16] [--only 0,2] [--compile-workers 16] [--warmup-ms 10 --rep-ms 40]
    python scripts/model_quality.py --report FILE.json [--json]      # no GPU needed

Measure: per shape (tuner/shapes.py syntax, Mamba-2's flags, chunk_size 256 unless q= says
otherwise), --configs distinct configs drawn uniformly from `build_space("sm90", prob,
static=True)` as SearchSpace.suggest draws (the fusion depth first, then the knobs that depth
uses; random.Random(seed + shape index); the op's violations redraw), plus the arch default
fitted into the space's pins. All are cross-compiled (CompilePool), predicted from their reports,
and the ones that compile timed by the MeasuredRunner (gate, then graph and eager medians).
Rows are written after each shape; rows of --out at other shape indices are kept, so a run can be
split over calls with --only.

Report: per shape, the Spearman rank correlation of predicted vs graph ms over the configs both
predicted and measured, the measured time of the lowest predicted config over the best measured
one (top-1 ratio), and whether the default beat that pick; then the mean over shapes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
ARCH = "sm90"


def _ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rho (Pearson correlation of average ranks); None under 2 pairs or a constant side."""
    if len(a) != len(b):
        raise ValueError("spearman: sequences of different lengths")
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else None


def quality(rows: list[dict], measured: str = "graph_ms") -> dict:
    """One shape's rows -> n (configs measured ok), rho, top1_ratio (measured ms of the lowest
    predicted over the best measured, among configs with both), default_ratio and default_better
    (the default's measured ms against the top-1's)."""
    pairs = [r for r in rows if r.get("ok") and r.get("predicted_ms") is not None and r.get(measured) is not None]
    out = {"n": len(pairs), "rows": len(rows), "rho": None, "top1_ratio": None, "default_ratio": None,
           "default_better": None}
    if not pairs:
        return out
    out["rho"] = spearman([r["predicted_ms"] for r in pairs], [r[measured] for r in pairs])
    best = min(r[measured] for r in pairs)
    top1 = min(pairs, key=lambda r: r["predicted_ms"])
    out["top1_ratio"] = top1[measured] / best
    default = next((r for r in pairs if r.get("is_default")), None)
    if default is not None:
        out["default_ratio"] = default[measured] / best
        out["default_better"] = default[measured] < top1[measured]
    return out


def report(path: str, as_json: bool = False) -> int:
    with open(path) as f:
        data = json.load(f)
    by_shape: dict[int, list[dict]] = {}
    for r in data["rows"]:
        by_shape.setdefault(r["shape_index"], []).append(r)
    res = {i: {"shape": rows[0]["shape"], **quality(rows)} for i, rows in sorted(by_shape.items())}
    rhos = [q["rho"] for q in res.values() if q["rho"] is not None]
    tops = [q["top1_ratio"] for q in res.values() if q["top1_ratio"] is not None]
    overall = {"shapes": len(res), "mean_rho": sum(rhos) / len(rhos) if rhos else None,
               "geomean_top1_ratio": math.exp(sum(map(math.log, tops)) / len(tops)) if tops else None,
               "worst_top1_ratio": max(tops, default=None),
               "default_better": sum(bool(q["default_better"]) for q in res.values())}
    if as_json:
        print(json.dumps({"device": data.get("device"), "shapes": res, "overall": overall}, indent=1))
        return 0
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"
    print(f"{data.get('device')}  arch {data.get('arch')}  seed {data.get('seed')}")
    print(f"{'idx':>3} {'shape':42s} {'n':>9} {'rho':>6} {'top1':>6} {'dflt':>6} dflt<top1")
    for i, q in res.items():
        print(f"{i:3d} {q['shape'][:42]:42s} {q['n']:4d}/{q['rows']:<4d} {f(q['rho']):>6} "
              f"{f(q['top1_ratio']):>6} {f(q['default_ratio']):>6} {q['default_better']}")
    print(f"overall: {overall['shapes']} shapes, mean rho {f(overall['mean_rho'])}, top-1 ratio geomean "
          f"{f(overall['geomean_top1_ratio'])} worst {f(overall['worst_top1_ratio'])}, "
          f"default better at {overall['default_better']}")
    return 0


def draw_configs(space, prob, count: int, rng: random.Random, exclude=()) -> list:
    """`count` distinct feasible configs drawn as SearchSpace.suggest does (depth first, then the
    knobs that depth uses), uniformly per knob; at most 50 x count draws."""
    from autossd.ops.registry import get_op
    op = get_op(space.op)
    violations = op.fn("violations")
    default_mode = op.space.by_name[space.mode].default
    out, seen = [], set(exclude)
    for _ in range(50 * count):
        if len(out) >= count:
            break
        values = dict(space.pinned)
        for d in space.dims:
            if d.name == space.mode:
                values[d.name] = rng.choice(d.values)
        mode = values.get(space.mode, default_mode)
        values.update(space.pinned_at.get(mode, {}))
        for d in space._dims_at(mode):
            values[d.name] = rng.choice(d.values)
        cfg = op.config_type(values)
        if cfg not in seen and not violations(cfg, space.arch, prob):
            out.append(cfg)
        seen.add(cfg)
    return out


def default_in(space, prob):
    """The arch default at the space's pinned depth, moved into its pins (as seed_configs does)."""
    from autossd.ops.registry import get_op
    mode = space.pinned.get(space.mode)
    base = get_op(space.op).fn("default_config")(ARCH, prob, **({space.mode: mode} if mode is not None else {}))
    return base.replace(**{k: v for k, v in space.pins(base[space.mode]).items() if base[k] != v})


def problem_of(spec: str, dtype: str):
    from autossd.tuner.shapes import parse_shape
    prob = parse_shape(spec, dtype, op="ssd_fwd")
    return prob if prob.chunk_size is not None else dataclasses.replace(prob, chunk_size=256)


def measure_shape(i: int, spec: str, a, pool, t0: float) -> list[dict]:
    from autossd.tuner.model import predict
    from autossd.tuner.runners.base import report_from
    from autossd.tuner.runners.measured import MeasuredRunner
    from autossd.tuner.search_space import build_space
    prob = problem_of(spec, a.dtype)
    space = build_space(ARCH, prob, static=True)
    default = default_in(space, prob)
    configs = [default] + draw_configs(space, prob, a.configs, random.Random(a.seed + i), exclude=[default])
    print(f"[{i}] {spec}: {len(configs)} configs drawn, compiling ({time.time() - t0:.0f}s)", flush=True)
    jobs = pool.map(configs, ARCH, prob)
    rows = []
    for cfg, job in zip(configs, jobs):
        row = {"shape_index": i, "shape": spec, "config": cfg.as_dict(), "is_default": cfg == default,
               "predicted_ms": None, "stages_ms": None, "report": None, "ok": False, "why": "",
               "graph_ms": None, "eager_ms": None}
        if isinstance(job, str):
            row["why"] = job
        else:
            row["report"] = [{k: s[k] for k in ("stage", "num_warps", "registers", "spill_bytes", "shared_bytes",
                                                "occupancy")} for s in job["stages"]]
            rep = report_from(job, ARCH, cfg)
            if rep.ok:
                ms, stages = predict(ARCH, prob, cfg, rep)
                row.update(predicted_ms=ms, stages_ms={s.stage: s.seconds * 1e3 for s in stages}, ok=True)
            else:
                row["why"] = "compile: " + "; ".join(rep.why())
        rows.append(row)
    todo = [(cfg, r) for cfg, r in zip(configs, rows) if r["ok"]]
    print(f"[{i}] {len(todo)}/{len(rows)} compiled ok, measuring ({time.time() - t0:.0f}s)", flush=True)
    runner = MeasuredRunner(ARCH, prob, compile_workers=0, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms,
                            precompile=False)
    try:
        for k, (cfg, row) in enumerate(todo):
            o = runner.evaluate(cfg, None)
            row.update(ok=o.ok, why=o.why, graph_ms=o.times.get("graph"), eager_ms=o.times.get("eager"))
            if (k + 1) % 25 == 0:
                print(f"[{i}]   {k + 1}/{len(todo)} measured ({time.time() - t0:.0f}s)", flush=True)
    finally:
        runner.close()
    q = quality(rows)
    print(f"[{i}] {spec}: {q['n']} measured, rho {q['rho']}, top-1 ratio {q['top1_ratio']}, "
          f"default better {q['default_better']} ({time.time() - t0:.0f}s)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", metavar="FILE", help="summarize a measured FILE.json (no GPU)")
    ap.add_argument("--json", action="store_true", help="--report as JSON")
    ap.add_argument("--out", help="JSON file; rows of shapes not run now are kept")
    ap.add_argument("--shapes", default="", help="';'-separated shapes (tuner/shapes.py syntax)")
    ap.add_argument("--configs", type=int, default=200, help="random configs per shape (plus the default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--only", default="", help="comma-separated shape indices to run")
    ap.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 2))
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=40)
    a = ap.parse_args(argv)
    if a.report:
        return report(a.report, a.json)
    shapes = [s.strip() for s in a.shapes.split(";") if s.strip()]
    if not a.out or not shapes:
        ap.error("measuring needs --out and --shapes (or --report FILE)")
    import torch
    if not torch.cuda.is_available():
        print("no GPU: the measure mode times configs on an sm90 GPU (--report FILE needs none)")
        return 2
    from autossd.runtime import arch_of_device
    if arch_of_device() != ARCH:
        print(f"this GPU is {arch_of_device()}, not {ARCH}: the measurement compares sm90 predictions")
        return 2
    for s in shapes:
        problem_of(s, a.dtype)   # a bad spec fails before any compile
    rows: dict[int, list[dict]] = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            for r in json.load(f)["rows"]:
                if r["shape_index"] >= len(shapes) or shapes[r["shape_index"]] != r["shape"]:
                    print(f"{a.out}: row of shape {r['shape_index']} ({r['shape']}) is not that of --shapes")
                    return 1
                rows.setdefault(r["shape_index"], []).append(r)
    from autossd.tuner.runners.base import CompilePool
    pool = CompilePool(a.compile_workers)
    t0 = time.time()
    try:
        for i in ([int(x) for x in a.only.split(",")] if a.only else range(len(shapes))):
            rows[i] = measure_shape(i, shapes[i], a, pool, t0)
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "arch": ARCH, "seed": a.seed, "dtype": a.dtype,
                           "configs": a.configs, "shapes": shapes, "rows": [r for k in sorted(rows) for r in rows[k]]},
                          f, indent=1)
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
