#!/usr/bin/env python
"""Cost of choosing a kernel at run time, on the host (no GPU needed: no kernel runs). Run it after
changing the lookup, the record store or get_kernel's cache: a warm call must stay a dict lookup.

    cold   first get_kernel of a process for an arch: load + validate the user and shipped
           databases, pick, build the Kernel
    miss   get_kernel for a new problem once the records are loaded (pick only)
    warm   get_kernel for a problem seen before: the per-process dict cache (target <= 5 us)

    python scripts/bench_lookup.py [--arch sm90] [--n 200000] [--json out.json]

Reads the shipped database of --arch and an empty user database (a temporary file, unless
AUTOSSD_DB is set). Exit status 1 when a warm call takes more than 5 us.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm90", help="the arch whose records are looked up")
    ap.add_argument("--n", type=int, default=200_000, help="warm calls per repeat (5 repeats)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)

    import os
    os.environ.setdefault("AUTOSSD_DB", str(Path(tempfile.mkdtemp()) / "user.sqlite"))  # empty user DB
    t0 = time.perf_counter()
    import autossd
    from autossd import runtime
    from autossd.db import load_records
    import_s = time.perf_counter() - t0

    p = autossd.Problem(1, 2048, 80, 64, 128, 1, "bf16", 256, has_D=True, has_dt_bias=True, dt_softplus=True)
    t0 = time.perf_counter()
    k = autossd.get_kernel(p, args.arch)
    cold = time.perf_counter() - t0
    nrec = len(load_records(args.arch, "ssd_fwd"))
    misses = [p.replace(seqlen=s) for s in (1024, 3000, 4096, 5000, 8192, 12000)]
    t0 = time.perf_counter()
    for q in misses:
        autossd.get_kernel(q, args.arch)
    miss = (time.perf_counter() - t0) / len(misses)
    reps = timeit.repeat(lambda: autossd.get_kernel(p, args.arch), number=args.n, repeat=5)
    warm = min(reps) / args.n
    reps_default = timeit.repeat(lambda: runtime.get_kernel(p), number=args.n, repeat=5)  # arch=None
    warm_default = min(reps_default) / args.n

    res = {"import_autossd_s": import_s, "cold_ms": cold * 1e3, "records": nrec, "miss_us": miss * 1e6,
           "warm_us": warm * 1e6, "warm_us_arch_none": warm_default * 1e6, "kernel": repr(k),
           "source": k.source, "reason": k.reason, "python": sys.version.split()[0]}
    print(f"import autossd        {import_s:8.3f} s")
    print(f"cold get_kernel       {cold * 1e3:8.2f} ms   ({nrec} records for {args.arch})")
    print(f"miss (pick only)      {miss * 1e6:8.1f} us")
    print(f"warm get_kernel       {warm * 1e6:8.3f} us   (target <= 5 us)")
    print(f"warm, arch=None       {warm_default * 1e6:8.3f} us")
    print(f"chose: {k.source} ({k.reason})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0 if warm <= 5e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
