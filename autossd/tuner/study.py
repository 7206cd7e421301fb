"""One Optuna study per (arch, op, problem, mode, pinned knobs): the tuning loop.

The loop asks the sampler for a batch of candidates, prunes the infeasible ones before any
compile (the op's `violations` -> TrialState.PRUNED), lets the runner prepare the batch in
parallel (compiles), then evaluates them one at a time and tells Optuna each result as soon as
it is known. A failed candidate (compile rejection, wrong answer, fault, hang) is TrialState.FAIL
with the reason in the trial's user attrs, so it can never be the study's best.

`trials` is the number of evaluated candidates the *study* should reach, so a resumed or a
multi-worker run shares one budget. Trials left RUNNING by a killed process of this host are
failed and their params re-enqueued on resume: a kill loses only the work in flight.

Several workers (`--workers`, or `autossd tune` started on several hosts against one PostgreSQL
storage) share a study: each claims its next batch under the study's lock (`storage.study_lock`),
counting the trials evaluated and those other workers are evaluating, so together they evaluate
exactly `trials` candidates, none twice. A worker whose share is done waits for the others'
trials in flight before it stores the best (`wait_for_others`), so every worker of a fleet
stores the same, final best: one record per problem (in measured mode, each worker's own
re-timing of the finalists, `confirm`, may still pick another).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import statistics
import socket
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

import optuna
from optuna.trial import TrialState

from ..arch import get_arch
from ..problem import Problem
from ..render import template_hash
from ..knobs import BaseConfig as Config
from ..ops.registry import LEGACY_OP, get_op, op_of
from .model import floor_ms
from .sinks import _UNSAFE, DbSink, Sink, make_result, mode_of
from .search_space import SearchSpace, build_space, seed_configs, space_default
from . import failures
from .storage import open_storage, study_lock
from .strategies import make_sampler

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass
class Settings:
    trials: int = 20                 # evaluated candidates the study should reach
    timeout_s: float | None = None   # wall-clock limit of this run, per problem
    sampler: str = "tpe"
    seed: int | None = None
    storage: str | None = None
    batch: int = 2                   # candidates prepared (compiled) together
    fixed: dict = field(default_factory=dict)            # knob -> pinned value
    extra_seeds: list[dict] = field(default_factory=list)  # configs enqueued besides the defaults
    progress: bool = True
    worker: int = 0                  # progress-bar row when several workers share a study
    workers: int = 1                 # the workers sharing each study (worker i finishes problem j when j % workers == i)
    confirm: int = 3                 # measured: each mode's N fastest re-timed before storing (0: off)
    op: str | None = None            # the op tuned (autossd.ops.registry; default: the problem type's)
    # offer configs whose correctness was never shown on this arch's hardware (Op.unvalidated)
    allow_unvalidated: bool = False


@dataclass
class TuneResult:
    study_name: str
    arch: str
    problem: Problem
    mode: str
    device: str
    best_config: Config | None
    best_ms: float | None
    default_ms: float | None
    floor_ms: float
    complete: int
    failed: int
    pruned: int
    failures: list[tuple[dict, str]]
    failure_causes: list[str] = field(default_factory=list)   # failures.classify of each failure
    failure_reasons: list[str] = field(default_factory=list)  # failures.reason_line of each
    failure_log: str | None = None    # the failures' full texts (failures.append)
    record: dict | None = None        # the saved record of the study's objective
    # launch mode -> (best config, its ms) when the runner timed both modes; {} for static
    best_by_mode: dict = field(default_factory=dict)
    default_by_mode: dict = field(default_factory=dict)   # launch mode -> the default's ms
    objective: str | None = None      # the launch mode the study minimized (None: no mode)

    @property
    def pct_floor(self) -> float | None:
        return 100.0 * self.floor_ms / self.best_ms if self.best_ms else None


def _config(op: str, values) -> Config:
    """A config of `op`'s space (validated)."""
    return get_op(op).config(values)


def _op_of(study: optuna.Study) -> str:
    """The op a study tunes (a study from before ops were named tuned the forward)."""
    return getattr(study, "user_attrs", {}).get("op", LEGACY_OP)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket(problem) -> str:
    """The problem part of a study's name: dims, dtype, flags, batch and seqlen, exactly. Every
    time a study holds was measured (or predicted) on this problem, so its best can be stored as
    this problem's record. (Batch and seqlen were once rounded up to powers of two, and a study
    resumed for another shape of the bucket stored the first shape's times as its own.)
    A problem of another type (the decode step's, packed prefill's) is named by every field of
    its key(), in the type's field order: `_key_bucket`."""
    if not isinstance(problem, Problem):
        return _key_bucket(problem.key())
    codes = {"has_D": "D", "D_has_hdim": "P", "has_z": "z", "has_dt_bias": "b", "dt_softplus": "s",
             "has_dt_limit": "l", "has_initial_states": "i", "has_seq_idx": "q",
             "return_final_states": "f", "return_varlen_states": "v"}
    flags = "".join(c for k, c in codes.items() if getattr(problem, k))
    return (f"h{problem.nheads}p{problem.headdim}n{problem.dstate}g{problem.ngroups}-{problem.dtype}"
            f"-b{problem.batch}-l{problem.seqlen}-q{problem.chunk_size or 'any'}"
            f"-f{flags or '0'}")


def _size(problem) -> str:
    """A problem's size for the progress bar: batch x seqlen, or its shape as --shapes writes it."""
    if isinstance(problem, Problem):
        return f"{problem.batch}x{problem.seqlen}"
    from .shapes import describe
    return describe(problem).split(" ")[0]


def _key_bucket(key: Mapping[str, Any]) -> str:
    """A problem key as a name: each field that is no flag as its name and value, then the flags
    that are set, by name. Two problems of one type differ in some field, so in the name; the
    characters stay within what a file name and the journal take (the failure log is named
    after the study)."""
    sizes, flags = [], []
    for k, v in key.items():
        if isinstance(v, bool):
            if v:
                flags.append(k)
        else:
            sizes.append(f"{k}{v}")
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "-".join(sizes) + "-f" + ("+".join(flags) or "0"))


def study_name(arch: str, problem: Problem, mode: str, device: str, objective: str | None = None,
               pinned: Mapping[str, Any] | None = None, op: str | None = None) -> str:
    """pinned: the knobs the user fixed (--fix). A study searches one space, so other pins make
    another study: a resumed study never stores a best that breaks the pins asked for now."""
    where = mode if mode == "static" else f"{mode}@{device.replace(' ', '_')}"
    if objective:   # a study's values are the times of one launch mode
        where += f"-{objective}"
    if pinned:
        where += "-x" + hashlib.sha256(json.dumps(sorted(pinned.items()), default=str).encode()).hexdigest()[:8]
    return f"{op_of(problem, op)}:{arch}:{bucket(problem)}:{where}:t{template_hash()[:8]}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# `storage` of a function that takes the study's lock when given one: the caller holds it already
# (or shares the study with no one)
_NO_LOCK = object()


def _locked(storage, name: str):
    return contextlib.nullcontext(False) if storage is _NO_LOCK else study_lock(storage, name)


def reap_stale(study: optuna.Study, grace_s: float = 120.0, storage=_NO_LOCK) -> int:
    """Fail the RUNNING trials whose process (on this host) is gone, and enqueue their params
    again once, so that a killed run loses no candidate. A trial killed between its creation
    and its first attribute write names no process: it is reaped at once when the study's lock
    is held (every worker asks for a trial and names it inside that lock, so an unnamed one seen
    from inside belongs to a process that died in between), else once older than `grace_s`.
    `storage`: take the study's lock there (workers of one host may reap at the same moment)."""
    with _locked(storage, study.study_name) as held:
        return _reap(study, grace_s, held)


def _reap(study: optuna.Study, grace_s: float, held: bool) -> int:
    """reap_stale's work, inside the lock when `held` (then an unnamed trial waits no grace)."""
    if held:
        grace_s = 0.0
    import datetime as _dt
    host = socket.gethostname()
    now = _dt.datetime.now()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if "host" in t.user_attrs and "pid" in t.user_attrs:
            if t.user_attrs["host"] != host or _pid_alive(int(t.user_attrs["pid"])):
                continue
        elif t.datetime_start is None or (now - t.datetime_start).total_seconds() < grace_s:
            continue   # not named in full yet: its process may be between its ask and its naming
        try:
            study.tell(t.number, state=TrialState.FAIL)
        except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
            continue   # finished meanwhile by a caller that did not take the lock
        study.set_user_attr(f"reaped_{t.number}", "process gone (killed?)")
        if t.params and "retry_of" not in t.user_attrs:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        n += 1
    return n


def _say(msg: str) -> None:
    """A line for the person running the tune (stderr: stdout carries the results)."""
    print(f"autossd: {msg}", file=sys.stderr, flush=True)


def say_resumed(study: optuna.Study) -> None:
    """Say that a study picks up where an earlier run left it, and how far that run got."""
    done = _evaluated(study)
    if done:
        _say(f"resuming study {study.study_name}: {done} trials done")


def _record_identity(rec: dict) -> str:
    device = _UNSAFE.sub("-", rec.get("device") or "")[:128]   # as DbSink stores it
    return json.dumps([rec["op"], rec["arch"], device, rec["problem"], mode_of(rec), rec["provenance"],
                       _config(rec.get("op", LEGACY_OP), rec["config"]).key()], sort_keys=True, default=str)


def _already_stored(sink: Sink, rec: dict) -> bool:
    """Whether `sink` holds a record identical to `rec` in what it answers (op, arch, device,
    problem, launch mode, provenance) and in its config. A store that cannot be read back says
    no (the save then reports whatever is wrong with it). Two tunes saving at the same instant
    can still both store theirs."""
    load = getattr(sink, "load", None)
    if load is None:
        return False
    try:
        held = load(rec["arch"]) if isinstance(sink, DbSink) else load()
    except Exception:  # noqa: BLE001 - the save itself reports an unusable store
        return False
    me = _record_identity(rec)
    return any(_record_identity(r) == me for r in held)


def open_study(arch: str, problem: Problem, mode: str, device: str, settings: Settings,
               space: SearchSpace | None = None, objective: str | None = None
               ) -> tuple[optuna.Study, SearchSpace]:
    op = op_of(problem, settings.op)
    space = space or build_space(arch, problem, settings.fixed, static=mode == "static", op=op,
                                 allow_unvalidated=settings.allow_unvalidated or mode == "measured")
    sampler = make_sampler(settings.sampler, space, settings.seed)
    name = study_name(arch, problem, mode, device, objective, settings.fixed, op)
    # under the lock: workers starting together would otherwise write the attributes at once
    with study_lock(settings.storage, name):
        study = optuna.create_study(study_name=name, storage=open_storage(settings.storage), sampler=sampler,
                                    direction="minimize", load_if_exists=True)
        if "problem" not in study.user_attrs:
            for k, v in {"arch": arch, "op": op, "problem": problem.key(), "mode": mode,
                         "device": device, "space": {d.name: list(d.values) for d in space.dims},
                         "pinned": dict(space.pinned)}.items():
                study.set_user_attr(k, v)
    return study, space


def _evaluated(study: optuna.Study) -> int:
    return sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
               if t.user_attrs.get("evaluated"))


def _known(study: optuna.Study, trials: list | None = None, seen: set[int] | None = None
           ) -> dict[str, float | None]:
    """Config key -> time (None: failed) of the study's evaluated trials. `trials`: the study's
    trials as just read; `seen`: numbers of trials already taken (skipped, and added to)."""
    out: dict[str, float | None] = {}
    if trials is None:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL))
    for t in trials:
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL) or (seen is not None and t.number in seen):
            continue
        cfg = t.user_attrs.get("config")
        if cfg and t.user_attrs.get("evaluated"):
            out[_config(_op_of(study), cfg).key()] = t.value if t.state == TrialState.COMPLETE else None
            if seen is not None:
                seen.add(t.number)
    return out


def stored_picks(arch: str, problem: Problem, op: str, device: str | None = None) -> list[Config]:
    """The configs the runtime's lookup gives this problem today from the stored records (the
    user database's and the shipped one's; its exact, nearest or transfer tier, for an eager and
    a graph-captured caller), so that a tune starts from them and its best is never slower than
    what callers already run (the tuned H100 family carried to an H200, say). Empty where only
    the default applies or no store can be read."""
    from ..db.lookup import load_records, pick
    try:
        records = load_records(arch, op)
        matches = [pick(problem, records, arch, launch_mode=m, op=op, device=device) for m in ("graph", "eager")]
    except Exception as e:   # noqa: BLE001 - a tune does not need the stores: say so, go on
        _say(f"the stored records could not seed {op} at {problem}: {type(e).__name__}: {e}")
        return []
    out = []
    for m in matches:
        if m.kind != "default" and m.config not in out:
            out.append(m.config)
    return out


def starts(arch: str, problem: Problem, space: SearchSpace, extra: list[dict]) -> list[Config]:
    """The caller's starting points (knob values set on the op's default in this space), each
    one the space can run; one that it cannot, or that the config rules change, is said and
    left out rather than silently replaced (a knob the start's mode does not use, a value the
    space leaves out or --fix pins otherwise, an infeasible tile)."""
    if not extra:
        return []
    base = space_default(arch, problem, space)
    violations = get_op(space.op).fn("violations")
    out = []
    for c in extra:
        cfg = base.replace(**c)
        unused = sorted(k for k, v in c.items() if cfg[k] != v)
        why = (f"{', '.join(unused)} unused at {space.mode}={cfg[space.mode]}" if unused
               else "outside the search space (a value it leaves out, or pinned otherwise)"
               if space.params(cfg) is None else "; ".join(violations(cfg, arch, problem)))
        if why:
            _say(f"--start {','.join(f'{k}={v}' for k, v in c.items())} left out at {problem}: {why}")
        else:
            out.append(cfg)
    return out


def seed(study: optuna.Study, arch: str, problem: Problem, space: SearchSpace,
         extra: list[dict], storage=_NO_LOCK, device: str | None = None) -> None:
    """Enqueue the known-good configs (once per study: skip_if_exists, under the study's lock
    in `storage`, so that workers seeding the study at once enqueue each config once): the op's
    default, then what the stored records give this problem (`stored_picks`), then `extra` (the
    caller's starting points: knob values set on the default), then the op's other seeds."""
    if isinstance(study.sampler, optuna.samplers.GridSampler):
        return  # brute force visits every point anyway
    known = seed_configs(arch, problem, space)
    configs = known[:1] + stored_picks(arch, problem, space.op, device) + \
        starts(arch, problem, space, extra) + known[1:]
    with _locked(storage, study.study_name):
        for i, cfg in enumerate(configs):
            params = space.params(cfg)
            if params is not None:
                study.enqueue_trial(params, user_attrs={"seed": "default" if i == 0 else "known"},
                                    skip_if_exists=True)


def run_trials(study: optuna.Study, space: SearchSpace, arch: str, problem: Problem, runner,
               settings: Settings) -> int:
    """The loop. Returns the number of candidates this call evaluated."""
    from tqdm.auto import tqdm

    deadline = time.monotonic() + settings.timeout_s if settings.timeout_s else math.inf
    host, pid = socket.gethostname(), os.getpid()
    seen: set[int] = set()
    known = _known(study, seen=seen)
    done = _evaluated(study)
    asks, max_asks = 0, 50 * settings.trials + 100   # bounds the loop when most points are pruned
    grid = study.sampler if isinstance(study.sampler, optuna.samplers.GridSampler) else None
    bar = tqdm(total=settings.trials, initial=min(done, settings.trials), disable=not settings.progress,
               desc=f"{arch} {_size(problem)}", unit="cand", position=settings.worker,
               leave=True, dynamic_ncols=True)
    evaluated = 0
    try:
        while done < settings.trials and time.monotonic() < deadline and asks < max_asks:
            if grid is not None and grid.is_exhausted(study):
                break
            batch: list[tuple[optuna.Trial, Config]] = []
            # The claim: what the study holds now (every worker's trials) sets how many
            # candidates this worker may still take. Trials are asked for, checked and, when
            # pruned or duplicates, told inside the lock, so outside it every RUNNING trial is
            # one that some worker is evaluating.
            with study_lock(settings.storage, study.study_name) as held:
                _reap(study, 120.0, held)   # a worker of this host killed since: its trials go back
                trials = study.get_trials(deepcopy=False)
                known.update(_known(study, trials, seen))
                done = sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                           and t.user_attrs.get("evaluated"))
                busy = _in_flight(trials, space)
                room = settings.trials - done - len(busy)
                bar.n = min(done, settings.trials)
                bar.refresh()
                if room <= 0:
                    break   # the rest of the budget is being evaluated by other workers
                want = min(settings.batch, room)
                while len(batch) < want and asks < max_asks:
                    if grid is not None and grid.is_exhausted(study):
                        break
                    trial = study.ask()
                    asks += 1
                    trial.set_user_attr("host", host)
                    trial.set_user_attr("pid", pid)
                    cfg = space.suggest(trial)
                    why = get_op(space.op).fn("violations")(cfg, arch, problem)
                    if why:   # infeasible: pruned before it costs a compile
                        trial.set_user_attr("pruned", why[:3])
                        study.tell(trial, state=TrialState.PRUNED)
                        continue
                    key = cfg.key()
                    if key in busy:
                        # another worker is evaluating it: its time is not known yet, and a
                        # second evaluation would spend the budget on nothing new
                        trial.set_user_attr("duplicate", True)
                        trial.set_user_attr("pruned", [f"being evaluated in trial {busy[key]}"])
                        study.tell(trial, state=TrialState.PRUNED)
                        continue
                    if key in known or any(c.key() == key for _, c in batch):
                        value = known.get(key)
                        trial.set_user_attr("duplicate", True)
                        if value is None:
                            study.tell(trial, state=TrialState.FAIL)
                        else:
                            study.tell(trial, value)
                        continue
                    batch.append((trial, cfg))
            if not batch:
                continue
            prepared = runner.prepare([c for _, c in batch])
            for (trial, cfg), prep in zip(batch, prepared):
                if time.monotonic() >= deadline:
                    trial.set_user_attr("why", "skipped: timeout")
                    study.tell(trial, state=TrialState.FAIL)
                    continue
                out = runner.evaluate(cfg, prep)
                trial.set_user_attr("config", cfg.as_dict())
                trial.set_user_attr("evaluated", True)
                if out.info:
                    trial.set_user_attr("info", _jsonable(out.info))
                if out.times:
                    trial.set_user_attr("times", _jsonable(out.times))
                if out.ok:
                    study.tell(trial, out.time_ms)
                else:
                    trial.set_user_attr("why", out.why[:500])
                    # classified on the whole text (a dump's verdict may come after 500
                    # characters of IR), which goes to the study's failure log
                    cause = failures.classify(out.why)
                    trial.set_user_attr("cause", cause)
                    trial.set_user_attr("reason", failures.reason_line(out.why, cause))
                    failures.append(study.study_name, cfg.as_dict(), out.why)
                    study.tell(trial, state=TrialState.FAIL)
                known[cfg.key()] = out.time_ms if out.ok else None
                done += 1
                evaluated += 1
                bar.update(1)
                best = [v for v in known.values() if v is not None]
                if best:
                    bar.set_postfix_str(f"best {min(best):.4g} ms")
    finally:
        bar.close()
    return evaluated


def _in_flight(trials: list, space: SearchSpace) -> dict[str, int]:
    """Config key -> trial number of the RUNNING trials (being evaluated by some worker)."""
    out: dict[str, int] = {}
    for t in trials:
        if t.state == TrialState.RUNNING:
            try:
                out[space.config_from_params(t.params).key()] = t.number
            except (KeyError, ValueError, TypeError):   # a trial killed before its params: no config
                out[f"trial {t.number}"] = t.number
    return out


# How long a worker whose share of a study is done waits for other workers' trials before it
# stores the best anyway, and the age past which a RUNNING trial of another host is taken for
# one whose process is gone (this host's are checked by pid).
FLEET_WAIT_S = 900.0


def wait_for_others(study: optuna.Study, storage=_NO_LOCK, poll_s: float = 0.5) -> int:
    """Wait until no other worker is evaluating a trial of the study (at most FLEET_WAIT_S), so
    that the best this worker stores is the study's final one. Returns the trials waited for."""
    import datetime as _dt
    end = time.monotonic() + FLEET_WAIT_S
    first = None
    while True:
        reap_stale(study, storage=storage)   # this host's: by pid; the live ones stay RUNNING
        now = _dt.datetime.now()
        live = [t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.datetime_start is not None and (now - t.datetime_start).total_seconds() < FLEET_WAIT_S]
        if first is None:
            first = len(live)
            if live:
                _say(f"{study.study_name}: waiting for {len(live)} trial(s) that other workers are "
                     "evaluating, to store the study's final best")
        if not live or time.monotonic() >= end:
            return first
        time.sleep(poll_s)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


# A static pick replaces the arch default only when the model predicts it at least this much
# faster. Below that the model's differences are its own noise: against the H200's decode sweeps,
# configs it predicted within 0.5% of each other ran measurably apart, and at batch 1 every
# config's prediction is the launch cost give or take a fraction of a percent; the default is
# the one config with measurements behind it (on sm90, for the arches nobody ran).
STATIC_MIN_GAIN = 0.02


def static_keeps_default(best_ms: float, default_ms: float) -> bool:
    """Whether a static tune stores the default over a pick predicted to take best_ms."""
    return best_ms * (1 + STATIC_MIN_GAIN) > default_ms


def in_space(trials: list, space: SearchSpace | None, op: str) -> list:
    """The trials whose config lies in `space` (all of them without one). A study resumed under
    the same name may hold trials from a wider space: one stored before a knob became measured-only
    (a static tune then pins it) or before the op's default moved to another mode."""
    if space is None:
        return list(trials)
    return [t for t in trials if "config" not in t.user_attrs
            or space.params(_config(op, t.user_attrs["config"])) is not None]


def summarize(study: optuna.Study, arch: str, problem: Problem, mode: str, device: str,
              objective: str | None = None, space: SearchSpace | None = None) -> TuneResult:
    """objective: the launch mode the study's values are times of (None: the runner timed no
    mode, e.g. a static prediction). space: only trials inside it count (in_space)."""
    trials = in_space(study.get_trials(deepcopy=False), space, _op_of(study))
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("evaluated")]
    failed = [t for t in trials if t.state == TrialState.FAIL and t.user_attrs.get("evaluated")]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    best = min(complete, key=lambda t: t.value) if complete else None
    op = get_op(_op_of(study))
    dflt = op.fn("default_config")(arch, problem).key()
    default_trial = next((t for t in complete if t.user_attrs.get("seed") == "default"),
                         next((t for t in complete if op.config(t.user_attrs["config"]).key() == dflt), None))
    if (mode == "static" and best is not None and default_trial is not None
            and static_keeps_default(best.value, default_trial.value)):
        best = default_trial
    default_ms = default_trial.value if default_trial is not None else None
    # each mode's best among every candidate timed in it: a candidate whose graph timing failed
    # (and so failed the study) still passed the gate and has its eager time
    by_mode: dict[str, tuple[Config, float]] = {}
    for t in complete + failed:
        for m, ms in (t.user_attrs.get("times") or {}).items():
            if isinstance(ms, float) and (m not in by_mode or ms < by_mode[m][1]):
                by_mode[m] = (op.config(t.user_attrs["config"]), ms)
    default_by_mode = dict((default_trial.user_attrs.get("times") or {}) if default_trial is not None else {})
    return TuneResult(
        best_by_mode=by_mode, default_by_mode=default_by_mode, objective=objective,
        study_name=study.study_name, arch=arch, problem=problem, mode=mode, device=device,
        best_config=op.config(best.user_attrs["config"]) if best else None,
        best_ms=best.value if best else None, default_ms=default_ms,
        floor_ms=floor_ms(arch, problem), complete=len(complete), failed=len(failed),
        pruned=len(pruned),
        failures=[(t.user_attrs.get("config", {}), t.user_attrs.get("why", "")) for t in failed],
        failure_causes=[t.user_attrs.get("cause") or failures.classify(t.user_attrs.get("why", ""))
                        for t in failed],
        failure_reasons=[t.user_attrs.get("reason") or t.user_attrs.get("why", "") for t in failed],
        failure_log=str(failures.log_path(study.study_name)) if failed else None)


CONFIRM_ROUNDS = 2   # re-timings of each finalist, besides its sample from the study


def confirm(result: TuneResult, study: optuna.Study, runner, top: int, space: SearchSpace | None = None) -> dict:
    """Re-time each launch mode's `top` fastest candidates, interleaved, and keep the best median.
    A mode's best over many candidates leans toward a lucky sample: eager times at small shapes
    spread by ±15 µs on a shared host, and a tune stored a 130m bf16 eager pick that took 127 µs in
    the next run, against 89 µs for a candidate it had ranked below (H100). Only
    measuring runners are asked; a finalist that a re-timing does not time in a mode is dropped
    from that mode. Returns each mode's
    samples per finalist (config key -> ms list)."""
    if top < 2 or getattr(runner, "provenance", "") != "measured" or not result.best_by_mode:
        return {}
    trials = [t for t in in_space(study.get_trials(deepcopy=False), space, _op_of(study))
              if t.state in (TrialState.COMPLETE, TrialState.FAIL) and t.user_attrs.get("times")]
    finalists: dict[str, Config] = {}
    samples: dict[str, dict[str, list[float]]] = {}
    for m in result.best_by_mode:
        timed = sorted((t for t in trials if isinstance(t.user_attrs["times"].get(m), float)),
                       key=lambda t: t.user_attrs["times"][m])
        samples[m] = {}
        for t in timed:
            cfg = _config(_op_of(study), t.user_attrs["config"])
            if cfg.key() not in samples[m]:     # a resumed study may hold a config twice
                samples[m][cfg.key()] = [t.user_attrs["times"][m]]
                finalists[cfg.key()] = cfg
            if len(samples[m]) == top:
                break
    if all(len(v) < 2 for v in samples.values()):
        return {}
    failed: set[tuple[str, str]] = set()   # (mode, config key): not timed in that mode once
    for _ in range(CONFIRM_ROUNDS):
        for k, cfg in finalists.items():
            modes = [m for m in samples if k in samples[m] and (m, k) not in failed]
            if not modes:
                continue
            # a candidate whose graph timing failed still has its eager time (Outcome.times)
            times = runner.evaluate(cfg, None).times or {}
            for m in modes:
                if isinstance(times.get(m), float):
                    samples[m][k].append(float(times[m]))
                else:
                    failed.add((m, k))
    for m, per in samples.items():
        ok = {k: v for k, v in per.items() if (m, k) not in failed}
        if ok:
            best = min(ok, key=lambda k: statistics.median(ok[k]))
            result.best_by_mode[m] = (finalists[best], statistics.median(ok[best]))
        else:
            del result.best_by_mode[m]
    if result.objective in result.best_by_mode:
        result.best_config, result.best_ms = result.best_by_mode[result.objective]
    return samples


def save_best(result: TuneResult, provenance: str, sink: Sink | None, sampler: str) -> dict | None:
    """Save the best record of each launch mode the runner timed (one record when it timed none:
    "any" for a static prediction, "eager" for a measurement); returns the record of the study's
    objective."""
    picks = result.best_by_mode or ({None: (result.best_config, result.best_ms)}
                                    if result.best_config is not None else {})
    if not picks or sink is None:
        return None
    for mode, (cfg, ms) in sorted(picks.items(), key=lambda kv: kv[0] or ""):
        rec = make_result(result.arch, result.device, result.problem, cfg, ms, provenance,
                          launch_mode=mode, floor_ms=result.floor_ms,
                          default_ms=result.default_by_mode.get(mode, result.default_ms),
                          study=result.study_name, sampler=sampler,
                          trials=result.complete + result.failed)
        if _already_stored(sink, rec):
            # a re-run of a finished tune, or an identical tune beside it, found this same best
            _say(f"{result.study_name} ({mode or 'any'} time): the same record is already stored in "
                 f"{sink!r}; not stored again")
        else:
            sink.save(rec)
        if mode == result.objective:
            result.record = rec
    return result.record


def open_and_seed(arch: str, problem: Problem, runner, settings: Settings,
                  space: SearchSpace | None = None) -> tuple[optuna.Study, SearchSpace]:
    """Open (or resume) the problem's study for `runner`, give back the trials of workers killed
    since, and enqueue the seeds."""
    study, space = open_study(arch, problem, runner.mode, runner.device, settings, space,
                              getattr(runner, "objective", None))
    reap_stale(study, storage=settings.storage)
    say_resumed(study)
    seed(study, arch, problem, space, settings.extra_seeds, settings.storage, runner.device)
    return study, space


def finish(study: optuna.Study, arch: str, problem: Problem, runner, settings: Settings,
           space: SearchSpace | None = None) -> TuneResult:
    """A problem's result once its trials are in (every worker's sharing the study): summarized,
    its finalists re-timed (`confirm`) by `runner`; with `space`, from its trials only."""
    wait_for_others(study, settings.storage)   # workers of other runs sharing the study
    result = summarize(study, arch, problem, runner.mode, runner.device, getattr(runner, "objective", None), space)
    confirm(result, study, runner, settings.confirm, space)
    return result


def tune_problem(arch: str, problem: Problem, runner, settings: Settings,
                 sink: Sink | None = None, space: SearchSpace | None = None) -> TuneResult:
    """Open (or resume) the study, seed it, run the loop, save the best as a record. `space`
    overrides the knob space (e.g. a reduced grid); by default it is `build_space(...)`."""
    arch = get_arch(arch).name
    study, space = open_and_seed(arch, problem, runner, settings, space)
    run_trials(study, space, arch, problem, runner, settings)
    result = finish(study, arch, problem, runner, settings, space)
    if runner.mode != "simulated":
        save_best(result, runner.provenance, sink, settings.sampler)
    return result
