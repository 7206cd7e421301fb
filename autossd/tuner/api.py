"""Entry points: pick the mode for an arch, build the runner, and tune a list of problems with
one or several workers sharing each study."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import time
from typing import Any

from ..arch import get_arch, local_arch
from ..ops.registry import get_op, op_of
from ..problem import Problem
from .sinks import Sink
from .storage import kept_journals
from .study import (FLEET_WAIT_S, Settings, TuneResult, finish, open_and_seed, open_study, run_trials,
                    save_best, tune_problem)

_log = logging.getLogger("autossd")

MODES = ("auto", "measured", "static")


def choose_mode(arch: str, mode: str = "auto", local: str | None = "detect") -> str:
    """measured when `arch` is the local GPU's, static otherwise (or as asked)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    local = local_arch() if local == "detect" else local
    if mode == "auto":
        return "measured" if local == arch else "static"
    if mode == "measured" and local != arch:
        raise ValueError(f"mode: measured tuning of {arch} needs a local {arch} GPU; "
                         f"this machine has {local or 'no GPU'} (use static mode)")
    return mode


def make_runner(mode: str, arch: str, problem: Problem, compile_workers: int = 2,
                timeout: float = 60.0, op: str | None = None, **kw: Any):
    """The runner of a tune: cross-compiled and model-ranked (static), or measured on the local
    GPU against the op's float64 reference (measured)."""
    if mode == "static":
        from .runners.static import StaticRunner
        return StaticRunner(arch, problem, compile_workers)
    if mode == "measured":
        from .runners.measured import MeasuredRunner
        return MeasuredRunner(arch, problem, compile_workers=compile_workers, timeout=timeout, op=op, **kw)
    raise ValueError(f"mode: no runner for {mode!r}")


def _worker(index: int, gpu: str | None, arch: str, problems: list[dict], mode: str, settings: dict,
            runner_kw: dict, done=None, passed=None) -> None:
    """One worker process for every problem of a tune, in order: its own GPU, each shared study,
    each study's shared budget. It lives across the problems, so its start (torch, CUDA and
    Triton imports, the GPU context) is paid once, not once a shape. Each problem is finished
    (summarized, its finalists re-timed) by one worker, problem i by worker i mod workers, with
    the runner it tuned with, and the result goes to `done` for the parent to store: done in
    the parent after the workers, the re-timing was serial work on a runner started cold (2 H100s,
    4 shapes: more than 80 s after the last trial). `passed[w]`: how many problems worker w has
    ended its trials of; the owner of problem i finishes it once every worker is past it (each
    worker's --timeout runs from its own start of a problem, so another may still be asking)."""
    from ..lifeline import die_with_parent
    die_with_parent()   # a killed tuner takes this worker (and so its compile workers) with it
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu   # before anything touches CUDA in this process
    from .runners.base import close_pools
    from .runners.measured import close_eval_workers
    st = Settings(**{**settings, "worker": index})
    kind = get_op(st.op).problem_type   # the problem type of the op tuned
    try:
        with kept_journals():
            for i, problem in enumerate(problems):
                prob = kind(**problem)
                runner = make_runner(mode, arch, prob, op=st.op, **runner_kw)
                try:
                    study, space = open_study(arch, prob, mode, runner.device, st, None,
                                              getattr(runner, "objective", None))
                    run_trials(study, space, arch, prob, runner, st)
                    if passed is not None:
                        passed[index] = i + 1
                    if done is not None and i % st.workers == index:
                        _wait_for_workers(passed, i + 1)
                        done.put((i, finish(study, arch, prob, runner, st, space)))
                finally:
                    runner.close()
    finally:
        if passed is not None:   # ended (or failed): no owner waits for this worker's trials
            passed[index] = len(problems)
        # this process ends by joining its live children: the shared compile pool's workers
        # (never shut down by atexit in a multiprocessing child) would keep it, and so the
        # tune, waiting forever (2 GPUs, measured: hung after the last trial)
        close_eval_workers()
        close_pools()


def _wait_for_workers(passed, n: int, poll_s: float = 0.5) -> None:
    """Until every worker has ended its trials of the first n problems (at most FLEET_WAIT_S:
    a worker that died never gets there; the study then holds what the others made)."""
    if passed is None:
        return
    end = time.monotonic() + FLEET_WAIT_S
    while min(passed[:]) < n and time.monotonic() < end:
        time.sleep(poll_s)


def _collect(done, procs: list, n: int, on_result=None) -> dict:
    """The finished results the workers send, {problem index: TuneResult}, read while they run (a
    worker blocks on a full pipe until the parent reads, so reading only after join could hang)
    until all n are in or every worker has exited. on_result(i, result) is called on each as it
    arrives (the caller stores it then: a tune cut short keeps every shape it finished)."""
    finished = {}
    while len(finished) < n:
        alive = any(p.is_alive() for p in procs)   # before the read: what a gone worker sent is in the pipe
        try:
            i, result = done.get(timeout=0.5)
        except queue.Empty:
            if not alive:
                break
            continue
        finished[i] = result
        if on_result is not None:
            on_result(i, result)
    return finished


def _provenance(mode: str) -> str:
    """What the records of a tune in `mode` say of themselves (its runner's provenance)."""
    if mode == "static":
        from .runners.static import StaticRunner
        return StaticRunner.provenance
    from .runners.measured import MeasuredRunner
    return MeasuredRunner.provenance


def _gpu_ids(n: int) -> list[str | None]:
    """The GPU each of n workers gets: the visible ones in turn (more workers than GPUs share
    them; a worker never gets an index the machine lacks)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        ids = [s.strip() for s in vis.split(",")]
    else:
        import torch
        ids = [str(i) for i in range(max(1, torch.cuda.device_count()))]
    return [ids[i % len(ids)] for i in range(n)]


def _tune(arch: str, problems: list[Problem], mode: str, settings: Settings, sink: Sink | None,
          workers: int = 1, runner_kw: dict | None = None) -> list[TuneResult]:
    """`tune`'s work, without its cleanup."""
    arch = get_arch(arch).name
    runner_kw = dict(runner_kw or {})
    if settings.op is None and problems:   # the workers build problems from their keys: name the type's op
        settings = dataclasses.replace(settings, op=op_of(problems[0]))
    results = []
    with kept_journals():   # each shape's study opens the journal: replayed once, not per shape
        if workers > 1:
            # every study opened and seeded first, then one set of workers for all of them:
            # workers started per shape spent ~25 s each starting (2 H100s, 4 shapes x 16
            # trials: 219 s against 156 with one worker)
            for prob in problems:
                runner = make_runner(mode, arch, prob, op=settings.op, **runner_kw)
                try:
                    open_and_seed(arch, prob, runner, settings)
                finally:
                    runner.close()
            ctx = mp.get_context("spawn")
            gpus = _gpu_ids(workers) if mode == "measured" else [None] * workers
            keys = [prob.key() for prob in problems]
            wsettings = {**dataclasses.asdict(settings), "workers": workers}
            done = ctx.Queue()
            passed = ctx.Array("i", [0] * workers, lock=False)   # each entry written by one worker
            procs = [ctx.Process(target=_worker,
                                 args=(i, gpus[i], arch, keys, mode, wsettings, runner_kw, done, passed))
                     for i in range(workers)]
            for p in procs:
                p.start()
            # each shape's record stored as its result arrives, not after the last shape: a
            # grid tune stopped at a time limit (4 H200s, 233 shapes: ~100 finished in 555 s)
            # used to store nothing
            unsaved = []

            def store(i, r):   # a store that fails here is tried again once the workers have ended
                try:
                    save_best(r, _provenance(mode), sink, settings.sampler)
                except Exception as e:  # noqa: BLE001 - the workers must still be joined
                    _log.warning("autossd tune: storing shape %d failed (%s: %s); tried again at the end",
                                 i, type(e).__name__, e)
                    unsaved.append(r)
            try:
                finished = _collect(done, procs, len(problems), store)
            finally:
                for p in procs:
                    p.join()
            for r in unsaved:
                save_best(r, _provenance(mode), sink, settings.sampler)
        for i, prob in enumerate(problems):
            if workers > 1 and i in finished:   # finished by the worker that owned it, and stored
                results.append(finished[i])
                continue
            # one worker, or a problem whose finishing worker died: finished here
            runner = make_runner(mode, arch, prob, op=settings.op, **runner_kw)
            try:
                if workers > 1:
                    study, space = open_study(arch, prob, mode, runner.device, settings, None,
                                              getattr(runner, "objective", None))
                    result = finish(study, arch, prob, runner, settings, space)
                    save_best(result, runner.provenance, sink, settings.sampler)
                else:
                    result = tune_problem(arch, prob, runner, settings, sink)
                results.append(result)
            finally:
                runner.close()
    return results


def tune(arch: str, problems: list[Problem], mode: str, settings: Settings, sink: Sink | None,
         workers: int = 1, runner_kw: dict | None = None) -> list[TuneResult]:
    """Tune each problem in turn; with workers > 1, that many processes (one per GPU in measured
    mode) share each study through its storage. The evaluation process kept across the shapes
    (its inputs and reference hold GPU memory) ends with the tune, however it ends, unless the
    call is inside `kept_eval_workers()` (then it serves the next tune's shapes too)."""
    from .runners.measured import close_eval_workers
    try:
        return _tune(arch, problems, mode, settings, sink, workers, runner_kw)
    finally:
        close_eval_workers(force=False)
