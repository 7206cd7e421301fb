"""Tuner drills for one local GPU, written to --out DIR as JSON.

    python experiments/gpu_tune_drills.py [--out DIR] [--drills tune,resume,isolation,efficiency]
        [--tune-seconds 180] [--tune-trials 60] [--grid full|small] [--replay-seeds 10]

Drills (about 7-8 minutes in all on one H100 with the defaults):
  tune        a real measured tune of mamba2-2.7b b=1 L=16384 fp16 (bounded by --tune-trials and
              --tune-seconds) into DIR/tuning.sqlite; then autossd.runtime.get_kernel must pick
              the stored measured record for that problem.
  resume      `autossd tune` in a subprocess, SIGKILLed (whole process group) once 3 candidates
              are in the journal; resumed in this process: the finished trials must be intact,
              the ones in flight failed and re-enqueued, the budget reached.
  isolation   a measured tune with injected bad candidates — a GPU hang (spin kernel), an illegal
              address fault, a process abort, a wrong answer — each must be recorded as failed
              with its reason while the run goes on to evaluate good candidates after them.
  efficiency  brute force over a reduced grid of >= 300 configs (chunk-scan tiles, warps, stages;
              the rest at the default), measured through the tuner (parallel compile, gate, do_bench
              median); then TPE and random search are replayed over those measurements (simulation
              runner) for --replay-seeds seeds: evaluations needed to get within 5% of the best.
Each drill writes DIR/<drill>.json; DIR/summary.json collects them and a summary is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TUNE_SHAPE = "mamba2-2.7b:b=1,l=16384"
SMALL_SHAPE = "mamba2-2.7b:b=1,l=2048"
GRIDS = {  # chunk-scan knobs varied around the default; the other knobs stay at the default
    "full": {"scan_block_m": (16, 32, 64, 128), "scan_block_n": (16, 32, 64),
             "scan_block_k": (32, 64, 128), "scan_warps": (2, 4, 8), "scan_stages": (1, 2, 3)},
    "small": {"scan_block_m": (32, 64, 128), "scan_block_n": (32, 64),
              "scan_block_k": (32, 64), "scan_warps": (4, 8), "scan_stages": (1, 2)},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write(out: Path, name: str, data: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True, default=str))


def _sink(out: Path, name: str):
    from autossd.tuner.sinks import JsonlSink, db_layer, open_sink
    if db_layer() is not None:
        return open_sink(str(out / f"{name}.sqlite")), str(out / f"{name}.sqlite")
    return JsonlSink(out / f"{name}.jsonl"), str(out / f"{name}.jsonl")


def _result_dict(r) -> dict:
    return {"study": r.study_name, "device": r.device, "best_ms": r.best_ms, "default_ms": r.default_ms,
            "floor_ms": r.floor_ms, "pct_of_floor": r.pct_floor, "complete": r.complete,
            "failed": r.failed, "pruned": r.pruned,
            "best_config": r.best_config.as_dict() if r.best_config else None,
            "failures": [w for _, w in r.failures][:20]}


# --- drill 1: a real tune -----------------------------------------------------------------------

def drill_tune(out: Path, arch: str, args) -> dict:
    from autossd.tuner import Settings, parse_shape, tune
    prob = parse_shape(TUNE_SHAPE, "fp16")
    sink, db = _sink(out, "tuning")
    st = Settings(trials=args.tune_trials, timeout_s=args.tune_seconds, sampler="tpe", seed=0,
                  storage=str(out / "tune.journal"), batch=args.compile_workers)
    t0 = time.monotonic()
    [res] = tune(arch, [prob], "measured", st, sink,
                 runner_kw={"compile_workers": args.compile_workers, "timeout": 60.0})
    data = {"shape": TUNE_SHAPE, "wall_s": round(time.monotonic() - t0, 1), "db": db, **_result_dict(res)}
    try:
        from autossd.runtime import get_kernel
        k = get_kernel(prob, arch=arch, db=db)
        data["runtime"] = {"provenance": k.provenance, "reason": k.reason,
                           "uses_tuned_config": k.config == res.best_config}
    except ImportError as e:   # no sqlalchemy on this host: the JSON-lines store has no runtime reader
        data["runtime"] = {"skipped": f"runtime lookup needs autossd.db ({e})"}
    data["ok"] = bool(res.best_config) and data["runtime"].get("uses_tuned_config", True)
    return data


# --- drill 2: SIGKILL and resume ----------------------------------------------------------------

def _evaluated(journal: Path) -> tuple[str | None, int]:
    import optuna

    from autossd.tuner.storage import open_storage
    if not journal.exists():
        return None, 0
    storage = open_storage(str(journal))
    names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    if not names:
        return None, 0
    study = optuna.load_study(study_name=names[0], storage=storage)
    return names[0], sum(1 for t in study.get_trials(deepcopy=False) if t.user_attrs.get("evaluated")
                         and t.state.is_finished())


def drill_resume(out: Path, arch: str, args) -> dict:
    import optuna
    from optuna.trial import TrialState

    from autossd.tuner import Settings, parse_shape, tune
    from autossd.tuner.storage import open_storage
    journal = out / "resume.journal"
    cmd = [sys.executable, "-m", "autossd.cli", "tune", "--arch", arch, "--shapes", SMALL_SHAPE,
           "--trials", "30", "--storage", str(journal), "--db", str(out / "resume.jsonl"),
           "--sampler", "random", "--seed", "1", "--compile-workers", "2", "--no-progress"]
    # keep the caller's PYTHONPATH (carried wheels live there on the device)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=open(out / "resume_child.log", "w"), stderr=subprocess.STDOUT)
    name, n = None, 0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(1.0)
        name, n = _evaluated(journal)
        if n >= 3:
            break
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)   # the CLI, its compile pool and its evaluation worker
    else:
        log(f"resume: the child exited by itself (code {proc.returncode}); see resume_child.log")
    proc.wait()
    log(f"resume: killed after {n} evaluated candidates")
    if name is None:
        return {"ok": False, "why": "the child never created its study; see resume_child.log"}
    study = optuna.load_study(study_name=name, storage=open_storage(str(journal)))
    before = {t.number: (t.state.name, t.value) for t in study.trials if t.state.is_finished()}
    in_flight = [t.number for t in study.trials if t.state == TrialState.RUNNING]
    target = n + 3
    st = Settings(trials=target, sampler="random", seed=1, storage=str(journal), batch=2)
    [res] = tune(arch, [parse_shape(SMALL_SHAPE, "fp16")], "measured", st, None,
                 runner_kw={"compile_workers": 2, "timeout": 60.0})
    study = optuna.load_study(study_name=name, storage=open_storage(str(journal)))
    after = {t.number: (t.state.name, t.value) for t in study.trials}
    kept = all(after[k] == v for k, v in before.items())
    reaped = [k for k in in_flight if after[k][0] == "FAIL"]
    retried = sorted(t.user_attrs["retry_of"] for t in study.trials if "retry_of" in t.user_attrs)
    return {"evaluated_before_kill": n, "finished_trials_before": len(before),
            "finished_trials_kept": kept, "in_flight_at_kill": in_flight, "reaped": reaped,
            "retried": retried, "target": target, "evaluated_after": res.complete + res.failed,
            "ok": kept and res.complete + res.failed >= target and set(reaped) == set(in_flight)}


# --- drill 3: crash / hang isolation ------------------------------------------------------------

def drill_isolation(out: Path, arch: str, args) -> dict:
    from autossd.ops.ssd.fwd_knobs import default_config
    from autossd.tuner import Settings, parse_shape
    from autossd.tuner.api import make_runner
    from autossd.tuner.study import tune_problem
    prob = parse_shape(SMALL_SHAPE, "fp16")
    base = default_config(arch, prob)
    bad = {"hang": base.replace(scan_warps=2), "fault": base.replace(scan_warps=8),
           "crash": base.replace(bmm_warps=2), "wrong": base.replace(bmm_warps=8)}
    runner = make_runner("measured", arch, prob, compile_workers=2, timeout=args.hang_timeout,
                         inject={c.key(): kind for kind, c in bad.items()})
    st = Settings(trials=len(bad) + 4, sampler="tpe", seed=2, storage=str(out / "isolation.journal"),
                  fixed={"chunk_size": base.chunk_size}, extra_seeds=[c.as_dict() for c in bad.values()],
                  batch=2)
    t0 = time.monotonic()
    restarts0 = runner.worker.restarts   # the evaluation process is shared: count this drill's only
    try:
        res = tune_problem(arch, prob, runner, st)
    finally:
        runner.close()
    reasons = {kind: next((w for c, w in res.failures if c == cfg.as_dict()), None) for kind, cfg in bad.items()}
    expect = {"hang": "hang", "fault": "gate", "crash": "crash", "wrong": "gate"}
    # a fault surfaces as a CUDA error in the gate (then the worker restarts) or as a dead process
    ok_kinds = {k: bool(reasons[k]) and (reasons[k].startswith(expect[k]) or
                                         (k == "fault" and reasons[k].startswith("crash")))
                for k in bad}
    return {"wall_s": round(time.monotonic() - t0, 1), "reasons": reasons, "recorded_failed": ok_kinds,
            "complete_after": res.complete, "worker_restarts": runner.worker.restarts - restarts0,
            "best_is_bad": res.best_config in bad.values(), **_result_dict(res),
            "ok": all(ok_kinds.values()) and res.complete >= 2 and res.best_config not in bad.values()}


# --- drill 4: tuner efficiency ------------------------------------------------------------------

def _evals_to_within(history: list[float | None], best: float, tol: float = 0.05) -> int | None:
    run = float("inf")
    for i, v in enumerate(history, 1):
        if v is not None:
            run = min(run, v)
        if run <= best * (1 + tol):
            return i
    return None


def _replay(arch, prob, space, table, sampler: str, seed: int, budget: int) -> list[float | None]:
    from optuna.trial import TrialState

    from autossd.tuner import Settings
    from autossd.tuner.runners.simulated import SimulatedRunner
    from autossd.tuner.study import open_study, run_trials, seed as seed_study
    st = Settings(trials=budget, sampler=sampler, seed=seed, storage=":memory:", progress=False)
    runner = SimulatedRunner(table)
    study, space = open_study(arch, prob, "simulated", "replay", st, space)
    seed_study(study, arch, prob, space, [])
    run_trials(study, space, arch, prob, runner, st)
    evald = sorted((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("evaluated")),
                   key=lambda t: t.number)
    return [t.value if t.state == TrialState.COMPLETE else None for t in evald]


def drill_efficiency(out: Path, arch: str, args) -> dict:
    from autossd.ops.ssd.fwd_knobs import default_config
    from autossd.tuner import Settings, build_space, parse_shape
    from autossd.tuner.api import make_runner
    from autossd.tuner.study import tune_problem
    prob = parse_shape(TUNE_SHAPE, "fp16")
    grid = GRIDS[args.grid]
    base = default_config(arch, prob)
    fixed = {k: v for k, v in base.items() if k not in grid}
    space = build_space(arch, prob, fixed)
    # keep only the grid's values for the varied knobs
    from autossd.tuner.search_space import Dim, SearchSpace
    space = SearchSpace(space.arch, tuple(Dim(d.name, tuple(v for v in d.values if v in grid[d.name]))
                                          for d in space.dims), space.pinned)
    n = space.size()
    log(f"efficiency: brute force over {n} configs ({args.grid} grid)")
    # brute force, measured, through the tuner; the grid is recorded in the study
    runner = make_runner("measured", arch, prob, compile_workers=args.compile_workers, timeout=60.0,
                         warmup_ms=5, rep_ms=20)
    st = Settings(trials=n, timeout_s=args.grid_seconds, sampler="brute", storage=str(out / "brute.journal"),
                  fixed=fixed, batch=args.compile_workers)
    t0 = time.monotonic()
    try:
        res = tune_problem(arch, prob, runner, st, space=space)
    finally:
        runner.close()
    brute_s = time.monotonic() - t0
    import optuna
    from optuna.trial import TrialState

    from autossd.ops.ssd.fwd_knobs import Config
    from autossd.tuner.storage import open_storage
    study = optuna.load_study(study_name=res.study_name, storage=open_storage(str(out / "brute.journal")))
    table = {}
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get("evaluated"):
            table[Config(t.user_attrs["config"]).key()] = t.value if t.state == TrialState.COMPLETE else None
    measured = [v for v in table.values() if v is not None]
    data = {"grid": {k: list(v) for k, v in grid.items()}, "grid_points": n, "measured": len(table),
            "passed": len(measured), "brute_force_s": round(brute_s, 1),
            "brute_best_ms": min(measured) if measured else None,
            "default_ms": res.default_ms, "worst_ms": max(measured) if measured else None,
            "eval_s_median": None}
    evs = [t.user_attrs.get("info", {}).get("eval_s") for t in study.get_trials(deepcopy=False)]
    evs = [e for e in evs if e]
    data["eval_s_median"] = statistics.median(evs) if evs else None
    if not measured:
        return {**data, "ok": False, "why": "no candidate measured"}
    best = min(measured)
    within = sum(v <= best * 1.05 for v in measured)
    data["configs_within_5pct"] = within
    # replay: TPE (the default sampler) and random search over the same measurements
    budget = min(len(table), 150)
    replay = {}
    for sampler in ("tpe", "random"):
        counts = []
        for s in range(args.replay_seeds):
            hist = _replay(arch, prob, space, table, sampler, s, budget)
            # a replayed space is the full product; points not measured (time limit) fail
            counts.append(_evals_to_within(hist, best))
        reached = [c for c in counts if c is not None]
        replay[sampler] = {"evaluations_to_5pct": counts, "budget": budget,
                           "median": statistics.median(reached) if reached else None,
                           "reached": f"{len(reached)}/{len(counts)}"}
    data["replay"] = replay
    # random search expectation without replacement: (N+1)/(K+1) draws to hit one of K good points
    data["random_expected"] = round((len(table) + 1) / (within + 1), 1)
    data["ok"] = len(table) >= 300 and replay["tpe"]["median"] is not None
    return data


DRILLS = {"tune": drill_tune, "resume": drill_resume, "isolation": drill_isolation,
          "efficiency": drill_efficiency}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "scratch" / "gpu_tune_drills",
                    help="output folder (default: scratch/gpu_tune_drills, git-ignored)")
    ap.add_argument("--drills", default="tune,resume,isolation,efficiency")
    ap.add_argument("--tune-seconds", type=float, default=180.0)
    ap.add_argument("--tune-trials", type=int, default=60)
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full")
    ap.add_argument("--grid-seconds", type=float, default=240.0, help="time limit of the brute force")
    ap.add_argument("--replay-seeds", type=int, default=10)
    ap.add_argument("--hang-timeout", type=float, default=20.0)
    ap.add_argument("--compile-workers", type=int, default=min(12, os.cpu_count() or 2))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("AUTOSSD_DATA_DIR", str(args.out / "data"))
    from autossd.arch import local_arch
    arch = local_arch()
    if arch is None:
        print("gpu_tune_drills: no supported local GPU", file=sys.stderr)
        return 2
    summary = {"arch": arch}
    t_all = time.monotonic()
    for name in [d.strip() for d in args.drills.split(",") if d.strip()]:
        if name not in DRILLS:
            print(f"unknown drill {name!r}; expected {sorted(DRILLS)}", file=sys.stderr)
            return 2
        log(f"drill {name} ...")
        t0 = time.monotonic()
        try:
            data = DRILLS[name](args.out, arch, args)
        except Exception as e:  # noqa: BLE001 - one broken drill must not hide the others
            import traceback
            data = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        data["drill_s"] = round(time.monotonic() - t0, 1)
        write(args.out, name, data)
        summary[name] = data
        log(f"drill {name}: {'OK' if data.get('ok') else 'FAILED'} in {data['drill_s']} s")
    summary["total_s"] = round(time.monotonic() - t_all, 1)
    write(args.out, "summary", summary)
    print("\n== summary ==")
    for name in DRILLS:
        d = summary.get(name)
        if d is None:
            continue
        if name == "tune":
            line = (f"best {d.get('best_ms')} ms, default {d.get('default_ms')} ms, floor {d.get('floor_ms')} ms, "
                    f"{d.get('complete')} ok / {d.get('failed')} failed; runtime: {d.get('runtime')}")
        elif name == "resume":
            line = (f"killed after {d.get('evaluated_before_kill')}; kept {d.get('finished_trials_kept')}; "
                    f"in flight {d.get('in_flight_at_kill')} reaped {d.get('reaped')} retried {d.get('retried')}")
        elif name == "isolation":
            line = f"recorded failed: {d.get('recorded_failed')}; ok after: {d.get('complete_after')}"
        else:
            line = (f"{d.get('measured')} configs measured, best {d.get('brute_best_ms')} ms; evaluations to "
                    f"within 5%: TPE {d.get('replay', {}).get('tpe', {}).get('median')}, random "
                    f"{d.get('replay', {}).get('random', {}).get('median')} (expected {d.get('random_expected')})")
        print(f"{name:11s} {'OK ' if d.get('ok') else 'FAIL'} {line}  [{d.get('drill_s')} s]"
              + (f"  error: {d['error']}" if "error" in d else ""))
    return 0 if all(summary[n].get("ok") for n in summary if n in DRILLS) else 1


if __name__ == "__main__":
    sys.exit(main())
