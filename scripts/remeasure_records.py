"""Re-measure a record store's configs on the local GPU, each exactly as stored (every knob pinned,
one trial: the float64 gate, then eager and graph times), into a new database. For shipped records
that a template change made stale: the configs stay, their times and hashes become this code's.

    python scripts/remeasure_records.py --db tuning_db/sm90.sqlite --out new.sqlite [--op ssd_fwd|ssd_bwd]
        [--only large|small] [--dtype fp16|bf16] [--where FIELD=VALUE]... [--device NAME]
        [--also KNOB=VALUE ...] [--alt KNOB=VALUE,...]... [--dry-run]

--variants-only: measure only the configs --also / --alt make (the stored ones keep their times),
when device time is short.
--op: the op whose records are re-measured (an SSD op whose shapes `autossd tune --shapes` states
in b l h p n g form: ssd_fwd, the default, or ssd_bwd). --device NAME: only records measured on
that GPU (e.g. "NVIDIA H200"), the card this run stands for.

--also KNOB=VALUE: measure each config a second time with these knobs changed (where that config
is feasible for its problem), e.g. `--also scan_gluon=1` when a new knob's value is to compete
with the stored configs; the merge keeps whichever is faster per launch mode. --alt
KNOB=VALUE,KNOB=VALUE (repeatable) adds further sets, each measured as its own variant, e.g.
`--also state_walk=1 --alt state_walk=1,fold_prep=2`. --where FIELD=VALUE (repeatable) keeps the
records whose problem has that field value, e.g. `--where nheads=80 --where batch=1` for one
shape's records when device time is short.

A problem whose eager and graph records hold different configs gets both measured; merging the new
database (scripts/build_shipped_db.py) then keeps each launch mode's faster one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autossd.problem import Problem  # noqa: E402
from autossd.tuner.shapes import FLAGS, KEYS  # noqa: E402

# the CLI from this tree (a device checkout has no `autossd` entry point installed)
AUTOSSD = [sys.executable, "-m", "autossd.cli"]
# Problem fields that `--shapes` cannot state: they must be off
UNSHAPED = set(Problem.field_names()) - set(KEYS.values()) - set(FLAGS.values()) - {"dtype"}


def shape_of(p: dict) -> str:
    bad = sorted(k for k in UNSHAPED if p.get(k))
    if bad:
        raise ValueError(f"no --shapes form for a problem with {bad}")
    return ",".join([f"{k}={p[f]}" for k, f in KEYS.items() if p.get(f) is not None]
                    + [f"{k}={int(bool(p[f]))}" for k, f in FLAGS.items()])


def jobs(records: list[dict], only: str | None, also: dict | list[dict] | None = None,
         arch: str = "sm90", dtype: str | None = None, where: dict | None = None, op: str = "ssd_fwd",
         device: str | None = None, variants_only: bool = False) -> list[tuple[str, str, str]]:
    """(shape, dtype, pinned knobs) per config to measure: each of `op`'s records' config as
    stored, then with each set of knob changes in `also` where that is feasible for its problem.
    `where`: only records whose problem has these field values (e.g. nheads=80); `device`: only
    records measured on that GPU; `variants_only`: only the changed configs."""
    from autossd.ops.registry import get_op
    Config, violations = get_op(op).config_type, get_op(op).fn("violations")
    alts = [also] if isinstance(also, dict) else list(also or [])
    seen, out = set(), []
    for r in records:
        if r.get("op", "ssd_fwd") != op or (device and r.get("device") != device):
            continue
        p = r["problem"]
        if only == "large" and p["seqlen"] * p["batch"] <= 2048 or only == "small" and p["seqlen"] * p["batch"] > 2048:
            continue
        if dtype and p["dtype"] != dtype:
            continue
        if any(p.get(k) != v for k, v in (where or {}).items()):
            continue
        configs = [r["config"]]
        for alt in alts:
            if not alt:
                continue
            changed = Config({**r["config"], **alt})
            if not violations(changed, arch, Problem(**p)):
                configs.append(changed.as_dict())
        for cfg in configs[1:] if variants_only else configs:
            fix = ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))
            key = (shape_of(p), p["dtype"], fix)
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


def _override(text: str) -> tuple[str, object]:
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value   # a string knob value (state_dtype=bf16)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True, help="the store whose configs are re-measured")
    ap.add_argument("--out", required=True, help="database the new records go to")
    ap.add_argument("--arch", default="sm90")
    ap.add_argument("--op", default="ssd_fwd", choices=("ssd_fwd", "ssd_bwd"), help="the op whose records are re-measured")
    ap.add_argument("--device", default=None, help="only records measured on this GPU, e.g. 'NVIDIA H200'")
    ap.add_argument("--only", choices=("large", "small"), help="shapes above / up to 2048 tokens")
    ap.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), help="only this input dtype's records")
    ap.add_argument("--storage-dir", default=None, help="Optuna journals (default: beside --out)")
    ap.add_argument("--also", nargs="*", default=[], metavar="KNOB=VALUE",
                    help="also measure each config with these knobs changed")
    ap.add_argument("--alt", action="append", default=[], metavar="KNOB=VALUE[,KNOB=VALUE...]",
                    help="another set of knob changes to measure each config with (repeatable; "
                         "beside --also's set)")
    ap.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                    help="only records whose problem has this field value, e.g. nheads=80 (repeatable)")
    ap.add_argument("--variants-only", action="store_true", help="measure only the configs --also / --alt make")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    where = dict(_override(t) for t in a.where)
    unknown = sorted(set(where) - set(Problem.field_names()))
    if unknown:
        ap.error(f"--where: unknown problem field(s) {unknown}; known: {Problem.field_names()}")
    shown = subprocess.run([*AUTOSSD, "show", "--db", a.db, "--arch", a.arch, "--all", "--json"],
                           check=True, capture_output=True, text=True).stdout
    alts = [dict(_override(t) for t in a.also)] + [dict(_override(t) for t in g.split(",")) for g in a.alt]
    todo = jobs(json.loads(shown), a.only, alts, a.arch, a.dtype, where, a.op, a.device, a.variants_only)
    store = a.storage_dir or os.path.dirname(os.path.abspath(a.out))
    failed = 0
    for i, (shape, dtype, fix) in enumerate(todo):
        cmd = [*AUTOSSD, "tune", "--op", a.op, "--arch", a.arch, "--mode", "measured", "--shapes", shape,
               "--dtype", dtype, "--trials", "1", "--fix", fix, "--seed", "1", "--no-progress",
               "--db", a.out, "--storage", os.path.join(store, f"remeasure_{i}.journal")]
        print(f"[{i + 1}/{len(todo)}] {shape} {dtype}", flush=True)
        if a.dry_run:
            print("  " + " ".join(cmd))
            continue
        failed += subprocess.run(cmd).returncode != 0
    print(f"{len(todo)} configs, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
