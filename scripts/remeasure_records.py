"""Re-measure a record store's configs on the local GPU, each exactly as stored (every knob pinned,
one trial: the float64 gate, then eager and graph times), into a new database. For shipped records
that a template change made stale: the configs stay, their times and hashes become this code's.

    python scripts/remeasure_records.py --db tuning_db/sm90.sqlite --out new.sqlite [--op OP]
        [--only large|small] [--dtype fp16|bf16] [--where FIELD=VALUE]... [--device NAME]
        [--also KNOB=VALUE ...] [--alt KNOB=VALUE,...]... [--dry-run]

--variants-only: measure only the configs --also / --alt make (the stored ones keep their times),
when device time is short.
--op: the op whose records are re-measured (ssd_fwd, the default, or any op whose problems
`autossd tune --shapes` states: ssd_bwd, ssd_decode, ssd_varlen, sscan_fwd, sscan_bwd). --device
NAME: only records measured on that GPU (e.g. "NVIDIA H200"), the card this run stands for.

The configs are measured one `autossd tune` process per (dtype, state dtype, config), with every
shape that config is re-measured at in it: a process's start (importing torch, triton's caches)
takes seconds of device time, which one per shape multiplied.

--also KNOB=VALUE: measure each config a second time with these knobs changed (where that config
is feasible for its problem), e.g. `--also scan_gluon=1` when a new knob's value is to compete
with the stored configs; the merge keeps whichever is faster per launch mode. --alt
KNOB=VALUE,KNOB=VALUE (repeatable) adds further sets, each measured as its own variant, e.g.
`--also state_walk=1 --alt state_walk=1,fold_prep=2`. --where FIELD=VALUE (repeatable) keeps the
records whose problem has that field value, e.g. `--where nheads=80 --where batch=1` for one
shape's records when device time is short.

--restate FIELD=VALUE (repeatable): measure each selected record's config at its problem with
this field changed, making records of their own, e.g. `--op ssd_bwd --restate has_z=false` for the
backward's training shapes without z (the Mamba2 module's own call).

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
from typing import NamedTuple  # noqa: E402

from autossd.ops.registry import get_op  # noqa: E402
from autossd.tuner.shapes import form_of, parse_shape  # noqa: E402

# the CLI from this tree (a device checkout has no `autossd` entry point installed)
AUTOSSD = [sys.executable, "-m", "autossd.cli"]


class Job(NamedTuple):
    shape: str                # --shapes text
    dtype: str
    fix: str                  # every knob pinned, KNOB=VALUE,...
    state_dtype: str | None   # --state-dtype, for the ops whose problems name one


def shape_of(p: dict, op: str = "ssd_fwd") -> str:
    """The --shapes text of a stored problem of `op`; ValueError where that text would state
    another problem (a field --shapes cannot state, e.g. the forward's seq_idx)."""
    form = form_of(op)
    text = ",".join([f"{k}={p[f]}" for k, f in form.keys.items() if p.get(f) is not None]
                    + [f"{k}={int(bool(p.get(f)))}" for k, f in form.flags.items()])
    back = parse_shape(text, p["dtype"], op=op, state_dtype=p.get("state_dtype") if form.states else None)
    if back != get_op(op).problem_type(**p):
        raise ValueError(f"no --shapes form for the problem {p} (read back as {back})")
    return text


def jobs(records: list[dict], only: str | None, also: dict | list[dict] | None = None,
         arch: str = "sm90", dtype: str | None = None, where: dict | None = None, op: str = "ssd_fwd",
         device: str | None = None, variants_only: bool = False, restate: dict | None = None) -> list[Job]:
    """A Job per config to measure: each of `op`'s records' config as stored, then with each set
    of knob changes in `also` where that is feasible for its problem. `where`: only records whose
    problem has these field values (e.g. nheads=80); `device`: only records measured on that GPU;
    `variants_only`: only the changed configs; `restate`: these problem fields changed before
    measuring (e.g. has_z=false: the configs measured at the same shapes without z, which makes
    records of their own)."""
    Config, violations, Problem = get_op(op).config_type, get_op(op).fn("violations"), get_op(op).problem_type
    stated = form_of(op).states
    alts = [also] if isinstance(also, dict) else list(also or [])
    seen, out = set(), []
    for r in records:
        if r.get("op", "ssd_fwd") != op or (device and r.get("device") != device):
            continue
        p = r["problem"]
        prob = Problem(**p)
        # the tokens of a call: batch x seqlen (a decode step's batch x its tokens per row)
        tokens = prob.batch * getattr(prob, "seqlen", getattr(prob, "tokens", 1))
        if only == "large" and tokens <= 2048 or only == "small" and tokens > 2048:
            continue
        if dtype and p["dtype"] != dtype:
            continue
        if any(p.get(k) != v for k, v in (where or {}).items()):
            continue
        if restate:
            p = {**p, **restate}
            prob = Problem(**p)
        configs = [r["config"]]
        for alt in alts:
            if not alt:
                continue
            changed = Config({**r["config"], **alt})
            if not violations(changed, arch, prob):
                configs.append(changed.as_dict())
        for cfg in configs[1:] if variants_only else configs:
            fix = ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))
            key = Job(shape_of(p, op), p["dtype"], fix, p.get("state_dtype") if stated else None)
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out


def batches(todo: list[Job]) -> list[tuple[Job, list[str]]]:
    """The jobs as `autossd tune` runs: one per (dtype, state dtype, config), holding each of
    its shapes, in the order the jobs first name them."""
    runs: dict[tuple, list[str]] = {}
    for j in todo:
        runs.setdefault((j.dtype, j.state_dtype, j.fix), []).append(j.shape)
    return [(Job(";".join(shapes), d, fix, sd), shapes) for (d, sd, fix), shapes in runs.items()]


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
    ap.add_argument("--op", default="ssd_fwd", help="the op whose records are re-measured (one whose problems "
                                                    "--shapes states)")
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
    ap.add_argument("--restate", action="append", default=[], metavar="FIELD=VALUE",
                    help="measure at each record's problem with this field changed, e.g. has_z=false (repeatable)")
    ap.add_argument("--variants-only", action="store_true", help="measure only the configs --also / --alt make")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    try:
        form_of(a.op)
    except ValueError as e:
        ap.error(f"--op: {e}")
    fields = get_op(a.op).problem_type.field_names()
    where, restate = dict(_override(t) for t in a.where), dict(_override(t) for t in a.restate)
    for flag, given in (("--where", where), ("--restate", restate)):
        unknown = sorted(set(given) - set(fields))
        if unknown:
            ap.error(f"{flag}: unknown problem field(s) {unknown}; known: {fields}")
    shown = subprocess.run([*AUTOSSD, "show", "--db", a.db, "--arch", a.arch, "--all", "--json"],
                           check=True, capture_output=True, text=True).stdout
    alts = [dict(_override(t) for t in a.also)] + [dict(_override(t) for t in g.split(",")) for g in a.alt]
    todo = jobs(json.loads(shown), a.only, alts, a.arch, a.dtype, where, a.op, a.device, a.variants_only, restate)
    store = a.storage_dir or os.path.dirname(os.path.abspath(a.out))
    failed = 0
    runs = batches(todo)
    for i, (job, shapes) in enumerate(runs):
        cmd = [*AUTOSSD, "tune", "--op", a.op, "--arch", a.arch, "--mode", "measured", "--shapes", job.shape,
               "--dtype", job.dtype, "--trials", "1", "--fix", job.fix, "--seed", "1", "--no-progress",
               "--db", a.out, "--storage", os.path.join(store, f"remeasure_{i}.journal")]
        if job.state_dtype is not None:
            cmd += ["--state-dtype", job.state_dtype]
        print(f"[{i + 1}/{len(runs)}] {len(shapes)} shape(s), {job.dtype}: {shapes[0]}{' ...' if len(shapes) > 1 else ''}",
              flush=True)
        if a.dry_run:
            print("  " + " ".join(cmd))
            continue
        failed += subprocess.run(cmd).returncode != 0
    print(f"{len(todo)} configs at their shapes in {len(runs)} runs, {failed} runs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
