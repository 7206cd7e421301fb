#!/usr/bin/env python
"""Build the shipped per-arch tuning database tuning_db/<arch>.sqlite.

It holds the records of the databases given with --merge (measured records from the GPU), by the
merge rule of autossd.db.exchange (fresh > stale, measured > static > default, then the best time).
--defaults adds "default"-provenance records for the benchmark's model shapes; off by default,
since the code's default_config is the fallback anyway and shipped copies of it go stale.

    python scripts/build_shipped_db.py                       # tuning_db/sm90.sqlite
    python scripts/build_shipped_db.py --merge h100.sqlite   # add measured records
    python scripts/build_shipped_db.py --merge tuning_db/sm90.sqlite --rehash-from REV

--decode-sweep FILE: each (state dtype, batch)'s fastest config of a scripts/sweep_decode.py
JSON becomes a measured ssd_decode record (launch mode graph: the sweep times CUDA-graph replays),
with the device the file names, for the call the file names (its "call": mamba2-2.7b dimensions, bf16
inputs, z given, D, dt_bias, softplus). The file's triton version, date and per-config kernel
hashes are kept, so a record turns stale when the decode kernels change. A file from before the
sweep wrote those is refused unless --assume-current-code stamps them as made by the code now
running: check first that the decode kernels are unchanged since the sweep (git log -- templates/
ssd_decode autossd/ops/ssd/decode*.py; or compare render.kernel_hash of its configs at the sweep's
revision and now). The sweep's --arch must be the arch of the device in the file (H100/H200: sm90).

    python scripts/build_shipped_db.py --merge tuning_db/sm90.sqlite --decode-sweep sweep_decode.json

--rehash-from REV: a record made by the code at git revision REV (it stores REV's hash of every
template, or REV's kernel hash of its config) gets the current kernel hash, but only when each
kernel its config launches is the same code in both versions, as REV's own code renders it: the
source of the kernel and of everything it calls (triton's cache key, line numbers aside), every
global value they read, their jit options, and the launch options of its stages must match. Any
other record is kept as it was (stale if it was). Sources are only read (an older schema is
migrated in a temporary copy).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autossd.db import add_records, make_record, merge_dbs, read_records  # noqa: E402
from autossd.db.exchange import _read  # noqa: E402  (reads a source, migrating an older schema)
from autossd.problem import Problem  # noqa: E402
from autossd.ops.ssd.fwd_knobs import default_config  # noqa: E402

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


# The call scripts/sweep_decode.py timed before it wrote it in its JSON (scripts/bench_decode.py's
# make(): mamba2-2.7b dimensions, bf16 x, z, B and C; D, dt_bias and softplus; one token per row)
SWEEP_CALL = dict(nheads=80, headdim=64, dstate=128, ngroups=1, dtype="bf16", has_D=True, has_z=True,
                  has_dt_bias=True, dt_softplus=True, tokens=1)


def decode_sweep_records(path: str | Path, arch: str, assume_current: bool = False) -> list:
    """The measured ssd_decode records of a sweep file: per (state dtype, batch), its fastest row."""
    from autossd.ops.registry import get_op
    from autossd.ops.ssd.decode_knobs import DecodeProblem
    from autossd.tuner.sinks import _UNSAFE
    data = json.loads(Path(path).read_text())
    rows = data.get("rows") or []
    if not rows:
        raise SystemExit(f"--decode-sweep {path}: no rows")
    dated = "triton" in data and "date" in data and all("kernel_hash" in r for r in rows)
    if not dated and not assume_current:
        raise SystemExit(f"--decode-sweep {path}: the file names no triton version, date or kernel hashes "
                         "(a sweep from before it wrote them); re-run scripts/sweep_decode.py, or pass "
                         "--assume-current-code once the decode kernels are known unchanged since the sweep")
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        k = (r["state"], r["batch"])
        if k not in best or r["graph_us"] < best[k]["graph_us"]:
            best[k] = r
    op = get_op("ssd_decode")
    call = data.get("call", SWEEP_CALL)
    device = _UNSAFE.sub("-", data.get("device", ""))[:128]
    out = []
    for (state, batch), r in sorted(best.items()):
        made = {"triton_version": str(data["triton"]), "template_hash": r["kernel_hash"],
                "created_at": str(data["date"])} if dated else None
        out.append(make_record(DecodeProblem(batch=batch, state_dtype=state, **call), op.config(r["config"]), arch,
                               op=op.name, provenance="measured", time_ms=r["graph_us"] * 1e-3, device=device,
                               launch_mode="graph", made=made,
                               notes=f"fastest of {sum(1 for x in rows if (x['state'], x['batch']) == (state, batch))} "
                                     f"configs in {_UNSAFE.sub('-', Path(path).name)}"))
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
    try:
        for k in kernels:
            fn = getattr(mod, k)
            key = fn.cache_key   # also fills used_global_vals
            glob = sorted((name, repr(val)) for (name, _), (val, _) in fn.used_global_vals.items())
            opts = tuple(repr(getattr(fn, a, None)) for a in
                         ("do_not_specialize", "do_not_specialize_on_alignment", "noinline", "debug"))
            out[k] = (type(fn).__qualname__, key, tuple(glob), opts)
    finally:
        sys.modules.pop(path.stem, None)
    return out


# Run by the revision's own code (git archive REV autossd templates): its rendering, launch
# options and stamps for each (config JSON, backend), so a change in the Python that renders or
# launches (render.py, space.py) counts as well as one in the templates.
_AT_REV = r"""
import json, sys
from autossd import render
from autossd.ops.ssd.fwd_knobs import KNOB_BY_NAME, Config
todo, defaults = json.loads(sys.stdin.read())
out = []
for cfg_json, backend in todo:
    try:
        cfg = json.loads(cfg_json)
        new = [k for k, v in cfg.items() if k not in KNOB_BY_NAME and v != defaults[k]]
        if new:
            raise ValueError(f"knobs {new} did not exist at this revision")
        c = Config({k: v for k, v in cfg.items() if k in KNOB_BY_NAME})
        out.append({"source": render.render(c, backend), "launch": render.launch_options(c, backend),
                    "template_hash": render.template_hash(),
                    "kernel_hash": render.kernel_hash(c, backend) if hasattr(render, "kernel_hash") else None})
    except Exception as e:
        out.append({"error": f"{type(e).__name__}: {e}"})
print(json.dumps(out))
"""


def _at_rev(rev: str, todo: list[tuple[str, str]], tmp: Path) -> list[dict]:
    """What the code at git revision `rev` renders for each (config JSON, backend)."""
    from autossd.ops.ssd.fwd_knobs import KNOBS

    code = tmp / "rev"
    code.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "autossd", "templates"],
                             capture_output=True)
    if archive.returncode:
        raise SystemExit(f"--rehash-from {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive.stdout, check=True)
    env = {**os.environ, "PYTHONPATH": str(code), "AUTOSSD_CACHE_DIR": str(tmp / "cache")}
    run = subprocess.run([sys.executable, "-c", _AT_REV], input=json.dumps([todo, {k.name: k.default for k in KNOBS}]),
                         capture_output=True, text=True, cwd=tmp, env=env)
    if run.returncode:
        raise SystemExit(f"--rehash-from {rev}: its code failed: {run.stderr.strip()[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def rehash(records: list, rev: str) -> tuple[list, int]:
    """The records, those made by the code at `rev` (they store rev's all-templates hash or rev's
    kernel hash of their config) whose launched kernels are the same code and launch with the same
    options now re-stamped with the current kernel hash (see the module docstring); the rest as
    they were, stale or not. A record whose config rev's code cannot render stays as it was."""
    from autossd.arch import get_arch
    from autossd.compile import meta_inputs
    from autossd.db.records import current_kernel_hash
    from autossd.ops.ssd.chunk import allocate, plan
    from autossd.render import launch_options, render
    from autossd.ops.ssd.fwd import SEQUENCES as STAGES_BY_DEPTH

    out, n = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        backends = [get_arch(r.arch).backend for r in records]
        then = _at_rev(rev, [(r.config.key(), be) for r, be in zip(records, backends)], tmp) if records else []
        for r, backend, old in zip(records, backends, then):
            same = False
            try:
                now = current_kernel_hash(r.config, r.arch)
                if r.template_hash == now or "error" in old or \
                        r.template_hash not in (old["template_hash"], old["kernel_hash"]):
                    if "error" in old:
                        print(f"  kept as it was ({old['error']}): {r.problem.key()}", file=sys.stderr)
                    out.append(r)
                    continue
                stages = STAGES_BY_DEPTH[r.config.launches]
                opts = launch_options(r.config, backend)
                kernels = [ln.kernel for ln in plan(r.problem, r.config, meta_inputs(r.problem),
                                                    allocate(r.problem, r.config, "meta"), backend)]
                same = (all(old["launch"].get(st) == opts[st] for st in stages)
                        and _kernel_ids(render(r.config, backend), kernels, tmp)
                        == _kernel_ids(old["source"], kernels, tmp))
            except Exception as e:  # this record's kernels cannot be compared: it stays as it was
                print(f"  kept as it was ({type(e).__name__}: {e}): {r.problem.key()}", file=sys.stderr)
            out.append(dataclasses.replace(r, template_hash=now) if same else r)
            n += same
    return out, n


def compact(path: Path) -> None:
    """Rewrite the file with 8 KiB pages. A record's unique-index key (its problem and config
    JSON, about 1 KB) is over what a 4 KiB page keeps in an index cell, so each record cost an
    overflow page: 476 records took 2.9 MB, 1.3 MB with 8 KiB pages. The journal mode stays
    as merge left it (no write-ahead log: the file is read from read-only places)."""
    import sqlite3
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA page_size = 8192")
        conn.execute("VACUUM")
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--out", type=Path, default=None, help="default: tuning_db/<arch>.sqlite")
    ap.add_argument("--merge", nargs="*", default=[], help="databases (paths or URLs) to merge in")
    ap.add_argument("--defaults", action="store_true", help="also ship default-provenance records")
    ap.add_argument("--rehash-from", default=None, metavar="REV",
                    help="re-hash records made from the templates at git REV whose kernels are unchanged")
    ap.add_argument("--decode-sweep", nargs="*", default=[], metavar="JSON",
                    help="scripts/sweep_decode.py output: each shape's fastest config as a measured record")
    ap.add_argument("--assume-current-code", action="store_true",
                    help="--decode-sweep files without kernel hashes: stamp them with the current code's")
    args = ap.parse_args(argv)
    if args.rehash_from and not args.merge:
        ap.error("--rehash-from re-stamps the records of the --merge sources: give at least one")
    out = args.out or ROOT / "tuning_db" / f"{args.arch}.sqlite"
    recs = [make_record(p, default_config(args.arch, p), args.arch, provenance="default",
                        notes="shipped default") for p in shipped_problems()] if args.defaults else []
    for src in args.decode_sweep:
        swept = decode_sweep_records(src, args.arch, args.assume_current_code)
        print(f"{src}: {len(swept)} measured ssd_decode records")
        recs += swept
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "defaults.sqlite"
        add_records(str(base), recs)
        merge = list(args.merge)
        if args.rehash_from:   # each source on its own, so the merge keeps its source order
            for i, src in enumerate(args.merge):
                recs_in = _read(src, args.arch, None, strict=True)
                rehashed, n = rehash(recs_in, args.rehash_from)
                print(f"{src}: re-stamped {n} of {len(recs_in)} records (kernels unchanged since {args.rehash_from})")
                merge[i] = str(Path(tmp) / f"rehashed{i}.sqlite")
                add_records(merge[i], rehashed)
        result = merge_dbs([str(base), *merge], out, arch=args.arch, overwrite=True)
    compact(out)
    kinds: dict[str, int] = {}
    for r in read_records(str(out), readonly=True):
        kinds[r.provenance] = kinds.get(r.provenance, 0) + 1
    print(f"{out}: {result.kept} records ({kinds}); {result.dropped} dropped in {result.conflicts} conflicts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
