"""Helper processes (compile pools, evaluation workers, tuning workers) die with the process that
started them.

A SIGKILLed or SIGTERMed `autossd tune` runs no cleanup, and its spawned workers, blocked on a
pipe read from a parent that is gone, would stay alive forever (each holds a few hundred MB of
torch and Triton) along with the multiprocessing resource tracker that waits for them. Each
worker therefore calls `die_with_parent` first: on Linux the kernel kills it when its parent
dies (prctl PR_SET_PDEATHSIG), and on every platform a watchdog thread exits it once its parent
process id changes (the orphan is re-parented), within about a second.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 0.5


def _parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):   # no libc by that name, no prctl: the watchdog still runs
        pass


def _watch(parent: int) -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        if os.getppid() != parent:
            os._exit(1)   # no cleanup to run: the parent that wanted the results is gone


def die_with_parent(parent: int | None = None, death_signal: bool = True) -> None:
    """Make this process exit when `parent` (the process that started it; default: the current
    parent) exits. For a pool's `initializer` (with `initargs()`), or the first line of a
    Process target. death_signal: arm the kernel's parent-death signal too; it fires when the
    *thread* that started this process ends, so it is armed only for workers started from the
    main thread (`initargs` says which); the watchdog alone serves the others."""
    parent = os.getppid() if parent is None else parent
    if death_signal:
        _parent_death_signal()
    if os.getppid() != parent:   # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="autossd-lifeline", daemon=True).start()


def initargs() -> tuple[int, bool]:
    """`die_with_parent`'s arguments for workers this thread is about to start."""
    return os.getpid(), threading.current_thread() is threading.main_thread()
