"""Autograd around the SSD kernels.

An eager call skips torch's dispatcher, so its outputs get their grad_fn here: where grad mode is
on and an input requires grad, the forward runs inside `_SSDFunction`, whose backward runs the
generated backward (ops/ssd/backward.py). torch.compile traces the registered custom op instead
(runtime.ssd_fwd), whose registered backward calls the `autossd::ssd_bwd` custom op defined here,
the same backward behind a fake kernel, so forward and backward trace with no graph break.

Gradients flow from y and from final_states. varlen_states are returned without gradient (as
mamba_ssm, whose backward takes none through them): they are marked non-differentiable.
"""
from __future__ import annotations

from typing import Optional

import torch

DIFFERENTIABLE = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
# raised by an entry point that gives no call description (`forward_only` without `call`)
NO_BACKWARD = ("autossd: no backward through this entry point, and {names} require grad: call "
               "autossd.mamba_chunk_scan_combined (differentiable in every input), or run this one "
               "under torch.no_grad().")


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
    """Runs `run()` (the kernels) and ties its outputs to `inputs`; backward raises (entry points
    that do not describe their call)."""

    @staticmethod
    def forward(ctx, run, names, *inputs):
        ctx.names = names
        return run()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NO_BACKWARD.format(names=", ".join(ctx.names)))


_SAVED_FIELDS = ("states", "dt", "dA")
_Z_ARG = 2 + DIFFERENTIABLE.index("z")   # z's position in _SSDFunction.forward's arguments

# With z requiring grad, the eager forward keeps the ungated output y' for the backward (dz needs
# it; b x l x h x p elements in x's dtype, held from forward to backward per call, as mamba_ssm
# holds it). False: the backward runs the forward again for it instead, holding nothing more
# (on the H100 the step with the recompute took 7-8% longer at the large training shapes).
# torch.compile's traced path and a Kernel's own call (autossd.get_kernel(...)(...), which runs its
# config) always recompute.
KEEP_UNGATED_OUTPUT = True


class _SSDFunction(torch.autograd.Function):
    """The forward (`run()`, or one that keeps its chunk states where the backward's config says
    save_states) and its generated backward. inputs: the DIFFERENTIABLE tensors, then seq_idx."""

    @staticmethod
    def forward(ctx, run, call, *inputs):
        from .ops.ssd.backward import forward_saving
        t = dict(zip(DIFFERENTIABLE + ("seq_idx",), inputs))
        kept = forward_saving(t, call)
        ctx.y_pre = None
        if kept is not None:
            out, saved = kept
        elif KEEP_UNGATED_OUTPUT and call.get("drop_in") and t["z"] is not None and ctx.needs_input_grad[_Z_ARG]:
            (out, ctx.y_pre), saved = _forward_keeping_ungated(t, call), None
        else:
            out, saved = run(), None
        outs = out if isinstance(out, tuple) else (out,)
        ctx.call = call
        ctx.has_saved = saved is not None
        extra = [getattr(saved, f) for f in _SAVED_FIELDS] if saved is not None else []
        ctx.save_for_backward(*inputs, *extra)
        if call["return_varlen_states"]:
            ctx.mark_non_differentiable(outs[-1])
        return out

    @staticmethod
    def backward(ctx, *grads):
        from .ops.ssd.backward import Saved, ssd_backward
        n = len(DIFFERENTIABLE) + 1
        tensors = ctx.saved_tensors
        t = dict(zip(DIFFERENTIABLE + ("seq_idx",), tensors[:n]))
        saved = Saved(*tensors[n:]) if ctx.has_saved else None
        need = {k for k, i in zip(DIFFERENTIABLE, range(2, 2 + len(DIFFERENTIABLE))) if ctx.needs_input_grad[i]}
        call = ctx.call
        dout = grads[0]
        dfinal = grads[1] if call["return_final_states"] else None
        if ctx.y_pre is not None:
            # handed over, not shared: the backward frees it once the gate has read it
            t["y_pre"], ctx.y_pre = ctx.y_pre, None
        g = ssd_backward(t, dout, dfinal, call, need, saved) if need else {}
        return (None, None, *(g.get(k) for k in DIFFERENTIABLE), None)


def _forward_keeping_ungated(t: dict, call: dict):
    """(the drop-in's outputs, y'): the forward without its gate, then the gate as a kernel of
    its own (ops/ssd/gate.py)."""
    from .ops.ssd.backward import forward_ungated
    from .ops.ssd.gate import silu_gate
    out = forward_ungated(t, call, outputs=True)
    y_pre = out[0] if isinstance(out, tuple) else out
    y = silu_gate(y_pre, t["z"])
    return ((y, *out[1:]) if isinstance(out, tuple) else y), y_pre


def forward_only(run, tensors: dict, call: dict | None = None):
    """run() as it is where nothing requires grad; else inside `_SSDFunction` (differentiable)
    when `call` describes the call (chunk_size, dt_softplus, dt_limit as floats,
    return_final_states, return_varlen_states, state_dtype, cu_seqlens), or `_ForwardOnly`
    (refusing a backward) when it does not."""
    names = requiring_grad(tensors)   # () at once where grad mode is off
    if not names:
        return run()
    if call is None:
        return _ForwardOnly.apply(run, names, *(tensors[k] for k in names))
    return _SSDFunction.apply(run, call, *(tensors.get(k) for k in DIFFERENTIABLE), tensors.get("seq_idx"))


# --- the backward as a custom op, for torch.compile ---------------------------------------------
_Tensor = torch.Tensor


@torch.library.custom_op("autossd::ssd_bwd", mutates_args=())
def ssd_bwd(dout: _Tensor, dfinal: Optional[_Tensor], x: _Tensor, dt: _Tensor, A: _Tensor, B: _Tensor,
            C: _Tensor, D: Optional[_Tensor], z: Optional[_Tensor], dt_bias: Optional[_Tensor],
            initial_states: Optional[_Tensor], seq_idx: Optional[_Tensor], chunk_size: int,
            dt_softplus: bool, dt_lo: float, dt_hi: float, state_dtype: Optional[torch.dtype],
            need: list[bool]) -> list[_Tensor]:
    """Gradients of (x, dt, A, B, C, D, z, dt_bias, initial_states) where `need` says (an empty
    tensor elsewhere: an op's schema has a fixed number of outputs)."""
    from .ops.ssd.backward import ssd_backward
    t = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx)
    names = {k for k, w in zip(DIFFERENTIABLE, need) if w and t[k] is not None}
    call = dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=(dt_lo, dt_hi), state_dtype=state_dtype)
    g = ssd_backward(t, dout, dfinal, call, names) if names else {}
    return [g[k].contiguous() if k in g else x.new_empty(0) for k in DIFFERENTIABLE]


@ssd_bwd.register_fake
def _ssd_bwd_fake(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, chunk_size,
                  dt_softplus, dt_lo, dt_hi, state_dtype, need):
    t = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)
    return [torch.empty(t[k].shape, dtype=t[k].dtype, device=t[k].device) if w and t[k] is not None
            else x.new_empty(0) for k, w in zip(DIFFERENTIABLE, need)]
