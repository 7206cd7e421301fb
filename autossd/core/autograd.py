"""Outputs of a kernel call tied to autograd, for entry points that skip torch's dispatcher.

An op whose backward exists registers a differentiable runner for its calls (`register`); the
autograd glue of that op (autossd/grad.py for the SSD) does so when imported, which the
package's import does. A call of an op without one runs its kernels and ties the outputs to
its inputs through `_ForwardOnly`, which refuses a backward with a message naming the inputs
that require grad."""
from __future__ import annotations

from collections.abc import Callable

import torch

# raised by an entry point that gives no call description (`forward_only` without `call`)
NO_BACKWARD = ("autossd: no backward through this entry point, and {names} require grad: call "
               "autossd.mamba_chunk_scan_combined (differentiable in every input), or run this one "
               "under torch.no_grad().")

# op -> (run, call, tensors) -> outputs, differentiable (see `register`)
_runners: dict[str, Callable] = {}


def register(op: str, runner: Callable) -> Callable:
    """`runner(run, call, tensors)` runs `run()` (the forward's kernels) so that its outputs
    carry a grad_fn whose backward is the op's."""
    _runners[op] = runner
    return runner


def any_requires_grad(*tensors) -> bool:
    """Whether any argument is a tensor that requires grad (cheap: a drop-in asks per call)."""
    for v in tensors:
        if v is not None and getattr(v, "requires_grad", False):
            return True
    return False


def requiring_grad(tensors: dict, names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of `names` are tensors of `tensors` that require grad, when grad mode is on."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(k for k in names if isinstance(v := tensors.get(k), torch.Tensor) and v.requires_grad)


class _ForwardOnly(torch.autograd.Function):
    """Runs `run()` (the kernels) and ties its outputs to `inputs`; backward raises (entry points
    that do not describe their call)."""

    @staticmethod
    def forward(ctx, run, names, *inputs):
        ctx.names = names
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NO_BACKWARD.format(names=", ".join(ctx.names)))


def forward_only(run, tensors: dict, names: tuple[str, ...], call: dict | None = None, op: str | None = None):
    """run() as it is where none of the differentiable inputs `names` requires grad; else,
    where `call` describes the call and `op` registered a runner, through that runner
    (differentiable); else through `_ForwardOnly` (refusing a backward)."""
    needing = requiring_grad(tensors, names)   # () at once where grad mode is off
    if not needing:
        return run()
    runner = _runners.get(op) if call is not None else None
    if runner is None:
        return _ForwardOnly.apply(run, needing, *(tensors[k] for k in needing))
    return runner(run, call, tensors)
