#!/usr/bin/env python
"""Build the shipped per-arch tuning database tuning_db/<arch>.sqlite.

It holds the records of the databases given with --merge (measured records from the GPU), by the
merge rule of autossd.db.exchange (fresh > stale, measured > static > default, then the best time).
--defaults adds "default"-provenance records for the model shapes in DESIGN.md; off by default,
since the code's default_config is the fallback anyway and shipped copies of it go stale.

    python scripts/build_shipped_db.py                       # tuning_db/sm90.sqlite
    python scripts/build_shipped_db.py --merge h100.sqlite   # add measured records
    python scripts/build_shipped_db.py --merge tuning_db/sm90.sqlite --rehash-from REV

--rehash-from REV: a record whose stored hash is not its config's current kernel hash, because
it was made from the templates at git revision REV (the hash of every template then, or the
kernel hash then), gets the current kernel hash, but only when each kernel its config launches
is the same code in both versions: triton's cache key of every launched kernel (its source, the
sources of what it calls, and the global values it reads) must match. Otherwise it stays stale.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import subprocess
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


def _kernel_keys(source: str, kernels: list[str], where: Path) -> dict[str, str]:
    """Triton's cache key of each named kernel of a rendered module (imported, not compiled),
    with every function's line number set to 0: the key hashes where a function starts (for its
    line info), and moving code between template files moves functions without changing them."""
    from triton.runtime.jit import JITFunction

    from autossd.render import _interpret

    path = where / f"m{abs(hash(source))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    with _interpret(False):   # JITFunctions (the interpreter's stand-ins have no cache key)
        spec.loader.exec_module(mod)
    for v in vars(mod).values():
        if isinstance(v, JITFunction):
            v.starting_line_number, v.hash = 0, None
    return {k: getattr(mod, k).cache_key for k in kernels}


def rehash(records: list, rev: str) -> tuple[list, int]:
    """Records made from the templates at `rev` whose launched kernels are unchanged since, with
    the current kernel hash (see the module docstring); the rest as they were."""
    from autossd.arch import get_arch
    from autossd.ops.ssd.chunk import allocate, plan
    from autossd.compile import meta_inputs
    from autossd.db.records import current_kernel_hash
    from autossd.render import render, template_hash

    out, n = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "templates"
        old.mkdir()
        names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:templates/ssd_fwd"],
                               check=True, capture_output=True, text=True).stdout.split()
        for name in names:
            (old / name).write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:templates/ssd_fwd/{name}"],
                                                   check=True, capture_output=True, text=True).stdout)
        for r in records:
            now = current_kernel_hash(r.config, r.arch)
            if r.template_hash in (now, template_hash()):
                out.append(r)
                continue
            backend = get_arch(r.arch).backend
            kernels = [ln.kernel for ln in plan(r.problem, r.config, meta_inputs(r.problem),
                                                allocate(r.problem, r.config, "meta"), backend)]
            same = (_kernel_keys(render(r.config, backend), kernels, Path(tmp))
                    == _kernel_keys(render(r.config, backend, old), kernels, Path(tmp)))
            out.append(dataclasses.replace(r, template_hash=now) if same else r)
            n += same
    return out, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--out", type=Path, default=None, help="default: tuning_db/<arch>.sqlite")
    ap.add_argument("--merge", nargs="*", default=[], help="databases (paths or URLs) to merge in")
    ap.add_argument("--defaults", action="store_true", help="also ship default-provenance records")
    ap.add_argument("--rehash-from", default=None, metavar="REV",
                    help="re-hash records made from the templates at git REV whose kernels are unchanged")
    args = ap.parse_args(argv)
    out = args.out or ROOT / "tuning_db" / f"{args.arch}.sqlite"
    recs = [make_record(p, default_config(args.arch, p), args.arch, provenance="default",
                        notes="shipped default") for p in shipped_problems()] if args.defaults else []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "defaults.sqlite"
        add_records(str(base), recs)
        merge = list(args.merge)
        if args.rehash_from:
            recs_in = [r for m in merge for r in read_records(m, readonly=True)]
            rehashed, n = rehash(recs_in, args.rehash_from)
            print(f"rehashed {n} of {len(recs_in)} records (kernels unchanged since {args.rehash_from})")
            merge = [str(Path(tmp) / "rehashed.sqlite")]
            add_records(merge[0], rehashed)
        result = merge_dbs([str(base), *merge], out, arch=args.arch, overwrite=True)
    kinds: dict[str, int] = {}
    for r in read_records(str(out), readonly=True):
        kinds[r.provenance] = kinds.get(r.provenance, 0) + 1
    print(f"{out}: {result.kept} records ({kinds}); {result.dropped} dropped in {result.conflicts} conflicts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
