"""Deliberately bad candidates for the isolation drills and tests: a run that hangs, faults the
device, kills its process, returns a wrong answer, or (the forward) launches no kernel, leaving
its outputs as allocated. Only used when a runner is given
`inject={config.key(): kind}`; never in a normal tune."""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import triton
import triton.language as tl

KINDS = ("hang", "fault", "crash", "wrong", "unwritten")


@triton.jit
def spin_kernel(flag_ptr):
    # waits for a flag nobody sets: a real GPU hang
    while tl.load(flag_ptr, volatile=True) == 0:
        pass


@triton.jit
def wild_store_kernel(ptr):
    tl.store(ptr + 0x10000000000, 1.0)   # 4 TiB past the allocation: an illegal address


def hang(device: str) -> None:
    import torch
    if device == "cpu":
        time.sleep(10**6)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    spin_kernel[(1,)](flag)
    torch.cuda.synchronize()


def fault(device: str) -> None:
    import torch
    if device == "cpu":
        os.abort()
    buf = torch.zeros(1, dtype=torch.float32, device=device)
    wild_store_kernel[(1,)](buf)
    torch.cuda.synchronize()


def wrap(run: Callable, kind: str) -> Callable:
    """`run` with the fault `kind` injected."""
    if kind not in KINDS:
        raise ValueError(f"inject: expected one of {KINDS}, got {kind!r}")

    def bad(problem, config, t):
        device = t["x"].device.type
        if kind == "hang":
            hang(device)
        elif kind == "fault":
            fault(device)
        elif kind == "crash":
            os.abort()
        elif kind == "unwritten":   # the forward's kernels not launched: every output element unwritten
            from ...ops.ssd import chunk
            plan, chunk.plan = chunk.plan, lambda *a, **kw: []
            try:
                return run(problem, config, t)
            finally:
                chunk.plan = plan
        out = run(problem, config, t)
        y = out[0] if isinstance(out, tuple) else next(iter(out.values())) if isinstance(out, dict) else out
        y.view(-1)[0] += 10 * float(y.abs().max()) + 1.0   # one element far off
        return out
    return bad
