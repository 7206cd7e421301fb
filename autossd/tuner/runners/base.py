"""What every runner shares: the outcome of one candidate, the runner interface, and the
compile pool (a process pool, so a compiler crash or hang costs one candidate, not the run)."""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing as mp
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...compile import CompileReport, StageReport
from ...lifeline import die_with_parent, initargs
from ...problem import Problem
from ...knobs import BaseConfig as Config


@dataclass
class Outcome:
    ok: bool
    time_ms: float | None = None    # what the study minimizes (the runner's objective)
    why: str = ""
    info: dict = field(default_factory=dict)
    # launch mode -> ms, when the runner measured them ("eager", "graph"); a record is saved for
    # each mode's best. Empty: time_ms stands for every mode (a static prediction of GPU time).
    times: dict = field(default_factory=dict)


class Runner(Protocol):
    mode: str          # "measured" | "static" | "simulated"
    provenance: str    # what a record from it says
    device: str        # device name (static: the arch's reference part)

    def prepare(self, configs: list[Config]) -> list[Any]:
        """Work that may run in parallel (compiles); one item per config, in order."""

    def evaluate(self, config: Config, prepared: Any) -> Outcome:
        """One candidate, one at a time (timing needs the device to itself)."""

    def close(self) -> None: ...


def compile_job(config: dict, arch: str, problem: dict, op: str) -> dict:
    """Runs in a pool process: cross-compile one config and return its report as plain data
    (Config objects do not pickle; dicts do)."""
    from dataclasses import asdict

    from ...compile import compile_config
    from ...ops.registry import get_op
    o = get_op(op)
    rep = compile_config(o.config(config), arch, o.problem_type(**problem))
    return {"reasons": rep.reasons, "stages": [asdict(s) for s in rep.stages]}


def report_from(job: dict, arch: str, config: Config) -> CompileReport:
    return CompileReport(arch, config, [StageReport(**s) for s in job["stages"]], list(job["reasons"]))


def _init_worker(parent: int, death_signal: bool, log: str) -> None:
    die_with_parent(parent, death_signal)
    try:   # fd 2 itself: the compiler's C++ code writes there, past Python's sys.stderr
        os.makedirs(os.path.dirname(log), exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError:
        return   # no log directory: the output stays on the console
    os.dup2(fd, 2)
    os.close(fd)


class CompilePool:
    """`compile_job` over a spawn-context process pool (workers=0: in this process). A compile
    that crashes the pool or exceeds `timeout` fails that config; the pool is rebuilt."""

    def __init__(self, workers: int, timeout: float = 300.0) -> None:
        self.workers = workers
        self.timeout = timeout
        self._pool: cf.ProcessPoolExecutor | None = None

    def _executor(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            # a killed tuner must not leave its compile workers behind (lifeline.py), and what
            # the compiler prints (MLIR dumps of a failing pass) goes to a log, not the console
            from ..failures import compiler_log
            self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                                initializer=_init_worker,
                                                initargs=(*initargs(), str(compiler_log())))
        return self._pool

    def _reset(self) -> None:
        if self._pool is not None:
            for p in list(getattr(self._pool, "_processes", {}).values()):
                p.kill()  # a hung compile cannot be cancelled any other way
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def map(self, configs: list[Config], arch: str, problem: Problem) -> list[dict | str]:
        """Report dicts, or a failure string per config."""
        if self.workers <= 0:
            out: list[dict | str] = []
            for c in configs:
                try:
                    out.append(compile_job(c.as_dict(), arch, problem.key(), c.op))
                except Exception as e:  # noqa: BLE001 - a crash is a verdict on the config
                    out.append(f"compile crashed: {type(e).__name__}: {e}")
            return out
        futs = [self._executor().submit(compile_job, c.as_dict(), arch, problem.key(), c.op) for c in configs]
        out = []
        broken = False
        for f in futs:
            try:
                out.append(f.result(timeout=self.timeout))
            except cf.TimeoutError:
                out.append(f"compile timed out after {self.timeout:.0f}s")
                broken = True
            except Exception as e:  # noqa: BLE001 - BrokenProcessPool, compiler crash
                out.append(f"compile crashed: {type(e).__name__}: {e}")
                broken = broken or isinstance(e, cf.process.BrokenProcessPool)
        if broken:
            self._reset()
        return out

    def pids(self) -> list[int]:
        """The worker processes' ids (none before the first compile, or with workers=0)."""
        return sorted(getattr(self._pool, "_processes", None) or {})

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# One compile pool per process and worker count, shared by the runners: `tune` makes a runner per
# shape, and a pool of its own would start its workers afresh for every shape, each importing
# torch and triton again (seconds on a small machine: more than the cache hits a shape of an
# already compiled grid costs). The workers die with this process (lifeline.py) and are shut
# down at exit, or by close_pools: a multiprocessing child runs no atexit handlers, and on its
# way out it joins its live children, the pool's workers, which wait for work forever.
_POOLS: dict[int, CompilePool] = {}


def close_pools() -> None:
    """Shut the shared compile pools down (a worker process's last step)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def shared_pool(workers: int) -> CompilePool:
    pool = _POOLS.get(workers)
    if pool is None:
        pool = _POOLS[workers] = CompilePool(workers)
        atexit.register(pool.close)
    return pool
