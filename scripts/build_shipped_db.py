#!/usr/bin/env python
"""Build the shipped per-arch tuning database tuning_db/<arch>.sqlite.

It holds the records of the databases given with --merge (measured records from the GPU), by the
merge rule of autossd.db.exchange (fresh > stale, measured > static > default, then the best time).
--defaults adds "default"-provenance records for the model shapes in DESIGN.md; off by default,
since the code's default_config is the fallback anyway and shipped copies of it go stale.

    python scripts/build_shipped_db.py                       # tuning_db/sm90.sqlite
    python scripts/build_shipped_db.py --merge h100.sqlite   # add measured records
    python scripts/build_shipped_db.py --merge tuning_db/sm90.sqlite --rehash-from REV

--rehash-from REV: a record made from the templates at git revision REV (it stores REV's hash of
every template, or REV's kernel hash of its config) gets the current kernel hash, but only when
each kernel its config launches is the same code in both versions: the source of the kernel and
of everything it calls (triton's cache key, line numbers aside), every global value they read,
and their jit options must match. Any other record is kept as it was (stale if it was).
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
from autossd.db.exchange import _read  # noqa: E402  (reads a source, migrating an older schema)
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


def _kernel_ids(source: str, kernels: list[str], where: Path) -> dict[str, tuple]:
    """What each named kernel of a rendered module compiles from (imported, not compiled):
    triton's cache key (its source and the sources of what it calls) with every function's line
    number set to 0 (the key hashes where a function starts, for line info, and moving code
    between template files moves functions without changing them); the value of every global it
    or a callee reads (the key covers only tl.constexpr ones, not e.g. STATE_DTYPE); and its
    jit options."""
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
    out = {}
    for k in kernels:
        fn = getattr(mod, k)
        key = fn.cache_key   # also fills used_global_vals
        glob = sorted((name, repr(val)) for (name, _), (val, _) in fn.used_global_vals.items())
        opts = (tuple(getattr(fn, "do_not_specialize", ()) or ()), bool(getattr(fn, "noinline", False)))
        out[k] = (key, tuple(glob), opts)
    return out


def _templates_at(rev: str, dest: Path) -> Path:
    dest.mkdir()
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:templates/ssd_fwd"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        (dest / name).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:templates/ssd_fwd/{name}"],
                                                 check=True, capture_output=True).stdout)
    return dest


def rehash(records: list, rev: str) -> tuple[list, int]:
    """The records, those made from the templates at `rev` (they store rev's all-templates hash
    or rev's kernel hash of their config) whose launched kernels are the same code now re-stamped
    with the current kernel hash (see the module docstring); the rest as they were. A record
    whose config cannot be rendered or imported at `rev` stays as it was."""
    from autossd.arch import get_arch
    from autossd.compile import meta_inputs
    from autossd.db.records import current_kernel_hash
    from autossd.ops.ssd.chunk import allocate, plan
    from autossd.render import kernel_hash, render, template_hash

    out, n = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        old = _templates_at(rev, Path(tmp) / "templates")
        for r in records:
            backend = get_arch(r.arch).backend
            now = current_kernel_hash(r.config, r.arch)
            try:
                from_rev = r.template_hash in (template_hash(old), kernel_hash(r.config, backend, old))
                if r.template_hash == now or not from_rev:
                    out.append(r)
                    continue
                kernels = [ln.kernel for ln in plan(r.problem, r.config, meta_inputs(r.problem),
                                                    allocate(r.problem, r.config, "meta"), backend)]
                same = (_kernel_ids(render(r.config, backend), kernels, Path(tmp))
                        == _kernel_ids(render(r.config, backend, old), kernels, Path(tmp)))
            except Exception as e:  # rev's templates cannot render or import this config
                print(f"  kept as it was ({type(e).__name__}: {e}): {r.problem.key()}", file=sys.stderr)
                same = False
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
        if args.rehash_from:   # each source on its own, so the merge keeps its source order
            for i, src in enumerate(args.merge):
                recs_in = _read(src, None, None, strict=True)
                rehashed, n = rehash(recs_in, args.rehash_from)
                print(f"{src}: re-stamped {n} of {len(recs_in)} records (kernels unchanged since {args.rehash_from})")
                merge[i] = str(Path(tmp) / f"rehashed{i}.sqlite")
                add_records(merge[i], rehashed)
        result = merge_dbs([str(base), *merge], out, arch=args.arch, overwrite=True)
    kinds: dict[str, int] = {}
    for r in read_records(str(out), readonly=True):
        kinds[r.provenance] = kinds.get(r.provenance, 0) + 1
    print(f"{out}: {result.kept} records ({kinds}); {result.dropped} dropped in {result.conflicts} conflicts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
