"""Autograd around the forward kernels.

autossd has forward kernels only. An eager call skips torch's dispatcher, so without this its
outputs would carry no grad_fn: a training step would run and silently drop every gradient
through the SSD. Where grad mode is on and an input requires grad, the outputs come from an
autograd node whose backward refuses, naming those inputs; inference that leaves grad mode on (an
eval loop without no_grad) still runs. torch.compile traces the registered custom op instead
(runtime.ssd_fwd), whose registered backward refuses the same way when it runs.
"""
from __future__ import annotations

import torch

DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
NO_BACKWARD = ("autossd: no backward through the SSD forward: autossd has forward kernels only, "
               "and {names} require grad. Train with mamba_ssm's mamba_chunk_scan_combined; run "
               "autossd for inference (under torch.no_grad() or torch.inference_mode() nothing is "
               "recorded).")


def any_requires_grad(*tensors) -> bool:
    """Whether any argument is a tensor that requires grad (cheap: the drop-in asks per call)."""
    for v in tensors:
        if v is not None and getattr(v, "requires_grad", False):
            return True
    return False


def requiring_grad(tensors: dict) -> tuple[str, ...]:
    """Names of the differentiable inputs that require grad, when grad mode is on."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(k for k in DIFFERENTIABLE
                 if isinstance(v := tensors.get(k), torch.Tensor) and v.requires_grad)


class _ForwardOnly(torch.autograd.Function):
    """Runs `run()` (the kernels) and ties its outputs to `inputs`; backward raises."""

    @staticmethod
    def forward(ctx, run, names, *inputs):
        ctx.names = names
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NO_BACKWARD.format(names=", ".join(ctx.names)))


def forward_only(run, tensors: dict):
    """run() as it is, or inside _ForwardOnly, tied to the inputs that require grad."""
    names = requiring_grad(tensors)   # () at once where grad mode is off
    if not names:
        return run()
    return _ForwardOnly.apply(run, names, *(tensors[k] for k in names))
