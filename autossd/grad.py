"""Autograd around the SSD kernels: the layer above both the forward (autossd/runtime.py,
ops/ssd/chunk.py) and the backward (ops/ssd/backward.py); neither imports it.

An eager call skips torch's dispatcher, so its outputs get their grad_fn here: where grad mode is
on and an input requires grad, the forward runs inside `_SSDFunction`, whose backward runs the
generated backward. This module registers `_SSDFunction` as the forward's differentiable runner
(`core.autograd.register`), which the forward's entry points reach through
`core.autograd.forward_only`. torch.compile traces the registered custom op instead
(runtime.ssd_fwd), whose autograd, registered here, calls the `autossd::ssd_bwd` custom op
defined here, the same backward behind a fake kernel, so forward and backward trace with no
graph break.

Gradients flow from y and from final_states. varlen_states are returned without gradient (as
mamba_ssm, whose backward takes none through them): they are marked non-differentiable.
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from . import problem as _problem
from .arch import get_arch
from . import runtime
from .core import autograd as _autograd
from .core.autograd import NO_BACKWARD, any_requires_grad  # noqa: F401 (the names this module always offered)
from .core.device import arch_of_device
from .db import lookup as _lookup
from .ops.ssd import backward as _bw
from .ops.ssd.backward import Saved
from .ops.ssd.chunk import DIFFERENTIABLE, _execute
from .ops.ssd.gate import silu_gate
from .ops.ssd.workspace import allocate as fwd_allocate
from .render import load

OP = "ssd_fwd"


def requiring_grad(tensors: dict) -> tuple[str, ...]:
    """Names of the differentiable inputs that require grad, when grad mode is on."""
    return _autograd.requiring_grad(tensors, DIFFERENTIABLE)


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
        t = dict(zip(DIFFERENTIABLE + ("seq_idx",), inputs))
        # the problem, validated once per step: the backward takes it from here
        ctx.problem = _problem_of(t, call, bool(call.get("return_final_states")))
        kept = forward_saving(t, call, ctx.problem)
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
        g = ssd_backward(t, dout, dfinal, call, need, saved, ctx.problem) if need else {}
        return (None, None, *(g.get(k) for k in DIFFERENTIABLE), None)


def _forward_keeping_ungated(t: dict, call: dict):
    """(the drop-in's outputs, y'): the forward without its gate, then the gate as a kernel of
    its own (ops/ssd/gate.py)."""
    out = forward_ungated(t, call, outputs=True)
    y_pre = out[0] if isinstance(out, tuple) else out
    y = silu_gate(y_pre, t["z"])
    return ((y, *out[1:]) if isinstance(out, tuple) else y), y_pre


def forward_only(run, tensors: dict, call: dict | None = None):
    """run() as it is where nothing requires grad; else inside `_SSDFunction` (differentiable)
    when `call` describes the call (chunk_size, dt_softplus, dt_limit as floats,
    return_final_states, return_varlen_states, state_dtype, cu_seqlens), or `_ForwardOnly`
    (refusing a backward) when it does not."""
    return _autograd.forward_only(run, tensors, DIFFERENTIABLE, call, OP)


def _differentiable(run, call: dict, tensors: dict):
    return _SSDFunction.apply(run, call, *(tensors.get(k) for k in DIFFERENTIABLE), tensors.get("seq_idx"))


_autograd.register(OP, _differentiable)


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


# --- the drop-in's custom op (runtime.ssd_fwd): its autograd -----------------------------------
_OP_ARGS = list(inspect.signature(runtime._ssd_fwd_eager).parameters)
_OP_GRAD_ARGS = [_OP_ARGS.index(k) for k in DIFFERENTIABLE]   # ssd_fwd argument positions, grad.py's order
_OP_SAVED = DIFFERENTIABLE + ("seq_idx",)


def _ssd_fwd_setup(ctx, inputs, output):
    a = dict(zip(_OP_ARGS, inputs))
    ctx.save_for_backward(*(a[k] for k in _OP_SAVED))
    ctx.scalars = (a["chunk_size"], a["dt_softplus"], a["dt_lo"], a["dt_hi"], a["state_dtype"],
                   a["return_final_states"])
    ctx.n_args = len(inputs)


def _ssd_fwd_backward(ctx, dy, dfinal, dvarlen):
    # the generated backward as its own custom op (grad.ssd_bwd): torch.compile traces it with a
    # fake kernel, so forward and backward compile with no graph break. varlen_states carry no
    # gradient (as mamba_ssm).
    need = [ctx.needs_input_grad[i] for i in _OP_GRAD_ARGS]
    out = [None] * ctx.n_args
    if not any(need):
        return tuple(out)
    t = dict(zip(_OP_SAVED, ctx.saved_tensors))
    chunk, softplus, lo, hi, state_dtype, final = ctx.scalars
    if dy is None:
        dy = torch.zeros_like(t["x"])
    grads = torch.ops.autossd.ssd_bwd(dy, dfinal if final else None, *(t[k] for k in _OP_SAVED), chunk, softplus,
                                      lo, hi, state_dtype, need)
    for i, w, g in zip(_OP_GRAD_ARGS, need, grads):
        if w:
            out[i] = g
    return tuple(out)


runtime.ssd_fwd.register_autograd(_ssd_fwd_backward, setup_context=_ssd_fwd_setup)


# --- the forward that keeps what the backward reads, and the backward's entry --------------------
def _problem_of(t: dict, call: dict, final: bool):
    return _problem.from_args(t["x"], t["dt"], t["A"], t["B"], t["C"], call["chunk_size"], t.get("D"), t.get("z"),
                              t.get("dt_bias"), t.get("initial_states"), t.get("seq_idx"), None,
                              call["dt_softplus"], call["dt_limit"], final, False, call.get("state_dtype"))


def forward_saving(t: dict, call: dict, prob=None):
    """The forward run with buffers of its own, kept for the backward (save_states = 1): returns
    (the forward's outputs as the drop-in returns them, Saved), or None where the backward's
    config recomputes, or the forward's config does not leave every chunk's entering state in
    its buffer (the fused depths and the Gluon walk keep them elsewhere): the caller then runs the
    forward as usual and the backward recomputes."""
    if call.get("cu_seqlens") is not None or call.get("return_varlen_states"):
        return None
    x = t["x"]
    if prob is None:
        prob = _problem_of(t, call, bool(call.get("return_final_states")))
    arch = arch_of_device(x.device)
    cfg = _bw.config_for(prob, arch, _lookup.device_name(x.device))
    if not cfg.save_states:
        return None
    kern = runtime.get_kernel(prob, arch, device=x.device.index)
    fcfg = kern.config
    if fcfg.launches != 5 or fcfg.state_walk or fcfg.chunk_size != cfg.chunk_size:
        return None
    fcfg = fcfg.replace(state_dtype=cfg.state_dtype)
    buf = fwd_allocate(prob, fcfg, x.device)
    module = load(fcfg, kern.backend)
    ft = {k: t.get(k) for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")}
    for k in ("x", "z", "B", "C"):   # as the drop-in: a strided last dimension is copied
        ft[k] = runtime._unit_stride(ft[k])
    out = _execute(prob, fcfg, ft,
                   buf, None, call["dt_limit"], None, kern.backend, module, None)
    return out, Saved(states=buf.states, dt=buf.dt, dA=buf.dA)


def forward_ungated(t: dict, call: dict, outputs: bool = False):
    """The forward of a call without its gate (z's gradient needs its output y'): y', or with
    `outputs` everything the call asked for (y' first), from the drop-in's workspace."""
    return runtime._forward(t["x"], t["dt"], t["A"], t["B"], t["C"], call["chunk_size"], t.get("D"), None, t.get("dt_bias"),
                    t.get("initial_states"), t.get("seq_idx"), call.get("cu_seqlens") if outputs else None,
                    call["dt_softplus"], call["dt_limit"], outputs and call["return_final_states"],
                    outputs and call["return_varlen_states"], call.get("state_dtype"), keep=outputs)


def ssd_backward(t: dict, dout, dfinal, call: dict, need, saved: Saved | None = None, prob=None) -> dict:
    """Gradients (name -> tensor) of the inputs named in `need`, from the gradient wrt y and wrt
    the final states (None where not returned). t: the forward's inputs by name; call: its
    chunk_size, dt_softplus, dt_limit (a pair of floats) and state_dtype. t["y_pre"], where
    given, is the ungated output the forward kept; it is taken out of `t` (the backward frees it
    once read), and computed again where z's gradient is needed and it is not given. prob: the
    call's Problem as the forward validated it, where the caller kept it."""
    x = t["x"]
    if prob is None or prob.return_final_states != (dfinal is not None):
        prob = _problem_of(t, call, dfinal is not None)
    arch = arch_of_device(x.device)
    config = _bw.config_for(prob, arch, _lookup.device_name(x.device))
    backend = get_arch(arch).backend
    kept = t.pop("y_pre", None)
    t = dict(t)
    if kept is not None and "z" in need:
        t["y_pre"] = kept
    del kept
    if t.get("z") is not None and "z" in need and "y_pre" not in t:
        # z's gradient needs the ungated output: the forward again, without the gate
        with torch.no_grad():
            t["y_pre"] = forward_ungated(t, call)
    if dfinal is not None:
        dfinal = dfinal.float()
    if x.device.type == "cuda" and x.device.index not in (None, torch.cuda.current_device()):
        with torch.cuda.device(x.device):
            return _bw.execute(prob, config, t, dout, dfinal, need, call["dt_limit"], saved, backend,
                           drop_y_pre=True)
    return _bw.execute(prob, config, t, dout, dfinal, need, call["dt_limit"], saved, backend, drop_y_pre=True)
