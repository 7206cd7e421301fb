#!/usr/bin/env python
"""Build the shipped per-arch tuning database tuning_db/<arch>.sqlite.

It holds the records of the databases given with --merge (measured records from the GPU), by the
merge rule of autossd.db.exchange (fresh > stale, measured > static > default, then the best time).
--defaults adds "default"-provenance records for the model shapes in DESIGN.md; off by default,
since the code's default_config is the fallback anyway and shipped copies of it go stale.

    python scripts/build_shipped_db.py                       # tuning_db/sm90.sqlite
    python scripts/build_shipped_db.py --merge h100.sqlite   # add measured records
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autossd.db import add_records, make_record, merge_dbs, read_records  # noqa: E402
from autossd.problem import Problem  # noqa: E402
from autossd.space import default_config  # noqa: E402

MODELS = {  # name: (nheads, headdim, dstate, ngroups)
    "mamba2-130m": (24, 64, 128, 1),
    "mamba2-2.7b": (80, 64, 128, 1),
    "codestral-7b": (128, 64, 128, 8),
}
SIZES = ((1, 2048), (8, 2048), (4, 16384), (1, 131072))  # (batch, seqlen)


def shipped_problems() -> list[Problem]:
    out = []
    for h, p, n, g in MODELS.values():
        for b, l in SIZES:
            for dtype in ("bf16", "fp16"):
                for final in (False, True):
                    out.append(Problem(b, l, h, p, n, g, dtype, 256, has_D=True, has_dt_bias=True,
                                       dt_softplus=True, return_final_states=final))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--out", type=Path, default=None, help="default: tuning_db/<arch>.sqlite")
    ap.add_argument("--merge", nargs="*", default=[], help="databases (paths or URLs) to merge in")
    ap.add_argument("--defaults", action="store_true", help="also ship default-provenance records")
    args = ap.parse_args(argv)
    out = args.out or ROOT / "tuning_db" / f"{args.arch}.sqlite"
    recs = [make_record(p, default_config(args.arch, p), args.arch, provenance="default",
                        notes="shipped default") for p in shipped_problems()] if args.defaults else []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "defaults.sqlite"
        add_records(str(base), recs)
        result = merge_dbs([str(base), *args.merge], out, arch=args.arch, overwrite=True)
    kinds: dict[str, int] = {}
    for r in read_records(str(out), readonly=True):
        kinds[r.provenance] = kinds.get(r.provenance, 0) + 1
    print(f"{out}: {result.kept} records ({kinds}); {result.dropped} dropped in {result.conflicts} conflicts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
