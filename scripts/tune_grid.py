#!/usr/bin/env python
"""Measure the model grid on every GPU of one host: the grid shapes of the given ops that the
shipped database (and any --have file) holds no record of for this GPU, dealt round-robin over the
GPUs, smallest first within each op, one tune process per GPU, each storing its records as each
shape finishes into OUT/gpuN.sqlite. This is how the shipped sm90 file's grid records were made;
`scripts/build_shipped_db.py --merge` folds the results in.

    python scripts/tune_grid.py --ops ssd_decode,ssd_varlen --deadline 480 --out runs/a
    python scripts/tune_grid.py --ops ssd_bwd --have runs/a/gpu*.sqlite --out runs/b   # a's records count as done
    python scripts/tune_grid.py --ops ssd_fwd --list          # what is left, no GPU needed
    python scripts/tune_grid.py --ops sscan_fwd,sscan_bwd --match d=5120 --out runs/c   # one width first

Why not `autossd tune --preset grid --workers N`: its workers share each shape's study, which
suits long tunes of few shapes; a grid of hundreds of shapes at a few candidates each is faster
dealt whole shapes to GPUs (no study locks, one compile of each candidate per shape). A worker
stops taking shapes past --deadline seconds, so a run inside a time-limited job ends with what it
finished stored. Each worker keeps one evaluation process and one journal across its shapes, and
tunes with confirm 0 (no re-timing of the finalists).
The list of shapes is computed once, by the parent, so workers writing records cannot change it."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# candidates per shape, the default included (the seeds come first: the default, then the stored
# records' pick for this shape, then the op's own seed families; see autossd.tuner.study.seed).
# Measured on 4 H200s (2026-11-27): the decode step ~11 s a shape at 8, packed prefill ~13 s
# at 4, the forward 25-115 s at 3.
# The selective scan (H200, 2026-11-28, its serial layout, the seeds first): 8 candidates a shape
# found forward picks 1.2-1.35x faster than the default, 7 found backward picks 1.4-1.6x.
TRIALS = {"ssd_fwd": 3, "ssd_decode": 8, "ssd_varlen": 4, "ssd_bwd": 2, "sscan_fwd": 12, "sscan_bwd": 8}


def _size(p) -> int:
    width = getattr(p, "nheads", getattr(p, "dim", 1))   # the scan's problems have channels, not heads
    return getattr(p, "batch", 1) * getattr(p, "seqlen", getattr(p, "tokens", 1)) * width


def todo(arch: str, ops: list[str], device: str, have: list[str], match: str | None = None) -> list[tuple[str, object]]:
    """(op, problem) of the grid with no record measured on `device` in both launch modes, in the
    shipped file of `arch` or the `have` files, smallest first within each op; with `match`, only
    the shapes whose description (`autossd.tuner.shapes.describe`) contains it."""
    from autossd.db import lookup, read_records
    from autossd.tuner.shapes import describe, grid
    shipped = lookup.shipped_db_path(arch)
    now = lookup._freshness()
    left = []
    for op in ops:
        recs = read_records(str(shipped), arch, op, immutable=True) if shipped else []
        for f in have:
            recs += read_records(f, arch, op)
        # a stale record (made by other kernels or another Triton) counts as not done
        done = {(r.problem, r.launch_mode) for r in recs
                if r.device == device and r.provenance == "measured" and not r.stale_reasons(*now)}
        miss = [p for p in grid(op=op) if not ((p, "graph") in done and (p, "eager") in done)
                and (match is None or match in describe(p))]
        left += [(op, p) for p in sorted(miss, key=_size)]
    return left


def worker(args) -> int:
    """One GPU's share: every n-th shape of the list the parent wrote (computed once, before any
    worker writes a record), until the deadline. 1 when a shape failed."""
    from autossd.tuner import Settings, kept_eval_workers, open_sink, tune
    from autossd.tuner.shapes import describe
    from autossd.tuner.storage import kept_journals
    t0 = time.monotonic()
    with open(Path(args.out) / "todo.pkl", "rb") as f:   # written by this script's parent process
        mine = pickle.load(f)[args.gpu::args.gpus]
    out = Path(args.out)
    print(f"gpu {args.gpu}: {len(mine)} shapes", flush=True)
    sink = open_sink(str(out / f"gpu{args.gpu}.sqlite"))
    log = []
    with kept_journals(), kept_eval_workers():
        for i, (op, p) in enumerate(mine):
            if time.monotonic() - t0 > args.deadline:
                print(f"gpu {args.gpu}: deadline at {i}/{len(mine)}", flush=True)
                break
            n = TRIALS[op] if args.trials is None else args.trials
            st = Settings(trials=n, sampler="tpe", seed=0, storage=str(out / f"journal{args.gpu}.log"),
                          batch=min(n, 4), progress=False, confirm=0, op=op)
            s = time.monotonic()
            try:
                r = tune(args.arch, [p], "measured", st, sink,
                         runner_kw={"compile_workers": 3, "timeout": 60.0, "objective": "graph"})[0]
                row = {"op": op, "shape": describe(p), "tune_s": round(time.monotonic() - s, 1),
                       "candidates": r.complete, "failed": r.failed,
                       "best_ms": {m: ms for m, (c, ms) in r.best_by_mode.items()}, "default_ms": r.default_by_mode}
            except Exception as e:  # noqa: BLE001 - one shape's failure must not end the GPU's share
                row = {"op": op, "shape": describe(p), "tune_s": round(time.monotonic() - s, 1),
                       "error": f"{type(e).__name__}: {e}"}
            log.append(row)
            print(f"gpu {args.gpu} [{i + 1}/{len(mine)}]", json.dumps(row), flush=True)
            (out / f"log{args.gpu}.json").write_text(json.dumps(log))
    failed = sum("error" in row for row in log)
    print(f"gpu {args.gpu}: {len(log)} shapes in {time.monotonic() - t0:.0f} s, {failed} failed", flush=True)
    return 1 if failed else 0


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (a worker sees one of them)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    import torch
    return [str(i) for i in range(torch.cuda.device_count())]


def worker_command(args, g: int) -> list[str]:
    """The command line of GPU g's worker: this script, its parent's settings, --gpu g."""
    return [sys.executable, __file__, "--arch", args.arch, "--ops", ",".join(args.ops), "--device", args.device,
            "--gpus", str(args.gpus), "--deadline", str(args.deadline), "--out", args.out, "--gpu", str(g),
            *(["--trials", str(args.trials)] if args.trials is not None else [])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--ops", default="ssd_fwd,ssd_decode,ssd_varlen,ssd_bwd",
                    help="comma-separated, tuned in this order")
    ap.add_argument("--have", nargs="*", default=[], help="record files whose shapes count as done")
    ap.add_argument("--device", default=None,
                    help="the GPU's name as torch gives it (default: GPU 0's); only its records count as done")
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds after which a worker takes no new shape")
    ap.add_argument("--trials", type=int, default=None, help=f"candidates per shape (default per op: {TRIALS})")
    ap.add_argument("--out", default="tune_grid_out")
    ap.add_argument("--match", default=None,
                    help="only the shapes whose description contains this (e.g. d=5120: Mamba 2.8b's layer)")
    ap.add_argument("--list", action="store_true", help="print the shapes left (needs --device without a GPU)")
    ap.add_argument("--gpu", type=int, default=None, help=argparse.SUPPRESS)   # a worker's index
    args = ap.parse_args(argv)
    args.ops = args.ops.split(",")
    for op in args.ops:
        if op not in TRIALS:
            ap.error(f"--ops: unknown op {op!r}; expected some of {sorted(TRIALS)}")
    for f in args.have:
        if not os.path.isfile(f):
            ap.error(f"--have: no such file: {f}")
    if args.trials is not None and args.trials < 1:
        ap.error(f"--trials: expected at least 1, got {args.trials}")
    if args.device is None:
        import torch
        if not torch.cuda.is_available():
            ap.error("--device: no GPU here to name; give the GPU's name (e.g. 'NVIDIA H200')")
        args.device = torch.cuda.get_device_name(0)
    if args.list:
        from autossd.tuner.shapes import describe
        left = todo(args.arch, args.ops, args.device, args.have, args.match)
        for op, p in left:
            print(op, describe(p))
        print(f"{len(left)} shapes left on {args.device}", file=sys.stderr)
        return 0
    if args.gpu is not None:
        return worker(args)
    visible = visible_gpus()
    if args.gpus is None:
        args.gpus = len(visible)
    if not 1 <= args.gpus <= len(visible):
        ap.error(f"--gpus: expected 1 to the {len(visible)} visible GPUs, got {args.gpus}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "todo.pkl", "wb") as f:
        pickle.dump(todo(args.arch, args.ops, args.device, args.have, args.match), f)
    procs = []
    with contextlib.ExitStack() as logs:
        for g in range(args.gpus):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible[g])
            log = logs.enter_context(open(Path(args.out) / f"out{g}.txt", "w"))
            procs.append(subprocess.Popen(worker_command(args, g), env=env, stdout=log, stderr=subprocess.STDOUT))
        rcs = [p.wait() for p in procs]
    for g in range(args.gpus):
        lines = (Path(args.out) / f"out{g}.txt").read_text().strip().splitlines()
        print(lines[-1] if lines else f"gpu {g}: no output (exit {rcs[g]})")
    print(f"merge: python scripts/build_shipped_db.py --arch {args.arch} --merge tuning_db/{args.arch}.sqlite "
          f"{args.out}/gpu*.sqlite --out NEW.sqlite")
    return max(rcs)


if __name__ == "__main__":
    sys.exit(main())
