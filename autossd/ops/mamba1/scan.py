"""`selective_scan_fn`: a drop-in for mamba_ssm's selective_scan_fn (Mamba-1's selective scan),
forward and backward, eagerly and under torch.compile(fullgraph=True).

Under torch.compile the call goes through two registered custom ops, "autossd::sscan_fwd" and
"autossd::sscan_bwd", each with a fake kernel, so they trace as opaque nodes (no graph break); the
forward op's autograd calls the backward op. An eager call runs the same two bodies through a
plain autograd.Function instead (torch's custom-op dispatch costs more host time than the kernels
of a short sequence). Both pick their config through the one selector (`core.select`: exact,
nearest, transfer records, else the arch default).

Where gradients are wanted the forward also stores each chunk's entering state (checkpoints, at
the backward config's chunk and in its checkpoint type), so the backward recomputes a chunk's
states from its checkpoint instead of scanning the sequence again. Gradients are bitwise
reproducible: every sum over channels, batch rows or time that crosses programs is a buffer of
per-program partials summed by torch in a fixed order (no atomics).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...arch import get_arch
from ...core import select as _select
from ...core.autograd import any_requires_grad
from ...core.device import arch_of_device
from ...db import lookup as _lookup
from ...problem import as_flag
from ...render import interpreting
from . import bwd as _bwd
from . import fwd as _fwd
from .problem import ScanProblem, from_args

_Tensor = torch.Tensor
# the inputs selective_scan_fn differentiates, in its argument order
DIFFERENTIABLE = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def _device_check(u) -> None:
    if u.device.type == "cpu" and not interpreting():
        raise RuntimeError("autossd: the inputs are on the CPU, but the selective scan needs a CUDA or ROCm GPU. "
                           "Move the tensors to the GPU, or set TRITON_INTERPRET=1 before importing triton to "
                           "run Triton's (slow) CPU interpreter.")


# (problem, device, training) -> configs(): the selector's answer without its key-building cost
# (tens of microseconds a call); cleared with the selector's caches
_configs: dict = {}
_select.on_clear(_configs.clear)
CONFIGS_MAX = 1024


def configs(problem: ScanProblem, device: torch.device, training: bool = False):
    """(forward config, backward config or None, backend) a call on `device` runs: the selector's
    picks; a training forward takes the backward's chunk (its checkpoints' spacing)."""
    key = (problem, device, training)
    hit = _configs.get(key)
    if hit is None:
        hit = _pick(problem, device, training)
        if len(_configs) >= CONFIGS_MAX:
            _configs.clear()
        _configs[key] = hit
    return hit


def _pick(problem: ScanProblem, device: torch.device, training: bool):
    arch = arch_of_device(device)
    name = _lookup.device_name(device)
    fcfg = _select.select("sscan_fwd", problem, arch, device=name, safe=True).config
    bcfg = None
    if training:
        bcfg = _select.select("sscan_bwd", problem, arch, device=name, safe=True).config
        if fcfg.chunk != bcfg.chunk or bcfg.get("window", 0) == 2:
            fcfg = _bwd.forward_config(problem, bcfg, fcfg, arch)
    return fcfg, bcfg, get_arch(arch).backend


def _tensors(u, delta, A, B, C, D, z, delta_bias) -> dict:
    return dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)


# --- the forward op ---------------------------------------------------------------------------
@torch.library.custom_op("autossd::sscan_fwd", mutates_args=())
def sscan_fwd_op(u: _Tensor, delta: _Tensor, A: _Tensor, B: _Tensor, C: _Tensor, D: Optional[_Tensor],
                 z: Optional[_Tensor], delta_bias: Optional[_Tensor], delta_softplus: bool,
                 return_last_state: bool, save: bool) -> tuple[_Tensor, _Tensor, _Tensor]:
    """(out, last state or an empty tensor, checkpoints or an empty tensor): an op's schema has a
    fixed number of outputs. save: store the checkpoints the backward reads."""
    prob = from_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    return _forward(prob, _tensors(u, delta, A, B, C, D, z, delta_bias), save)


def _forward(prob: ScanProblem, t: dict, save: bool) -> tuple[_Tensor, _Tensor, _Tensor]:
    """The forward op's body on validated inputs (the op's and the eager path's)."""
    u = t["u"]
    _device_check(u)
    fcfg, bcfg, backend = configs(prob, u.device, training=save)
    buf = _fwd.forward(prob, fcfg, t, backend, last=prob.return_last_state,
                       ckpt_dtype=bcfg.ckpt_dtype if save else None,
                       ckpt_every=_bwd.ckpt_every(prob, bcfg) if save else 1)
    def empty():   # one tensor each: a custom op's outputs may not alias one another
        return u.new_empty(0, dtype=torch.float32)
    return buf["out"], (buf["last"] if prob.return_last_state else empty()), (buf["ckpt"] if save else empty())


@sscan_fwd_op.register_fake
def _sscan_fwd_fake(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state, save):
    prob = from_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    b, d, n, l = prob.batch, prob.dim, prob.dstate, prob.seqlen
    out = u.new_empty((b, d, l))
    last = u.new_empty((b, d, n) if return_last_state else (0,), dtype=torch.float32)
    if save:
        _, bcfg, _ = configs(prob, u.device, training=True)
        shape, dtype = _bwd.ckpt_shape(prob, bcfg)
        ck = u.new_empty(shape, dtype=dtype)
    else:
        ck = u.new_empty((0,), dtype=torch.float32)
    return out, last, ck


# --- the backward op and the forward's autograd --------------------------------------------------
@torch.library.custom_op("autossd::sscan_bwd", mutates_args=())
def sscan_bwd_op(dout: _Tensor, dlast: Optional[_Tensor], u: _Tensor, delta: _Tensor, A: _Tensor, B: _Tensor,
                 C: _Tensor, D: Optional[_Tensor], z: Optional[_Tensor], delta_bias: Optional[_Tensor],
                 ckpt: Optional[_Tensor], delta_softplus: bool, need: list[bool]) -> list[_Tensor]:
    """Gradients of (u, delta, A, B, C, D, z, delta_bias) where `need` says (an empty tensor
    elsewhere: an op's schema has a fixed number of outputs). ckpt: the forward's checkpoints
    (None or empty: the forward runs again to store them)."""
    prob = from_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, dlast is not None)
    return _backward(prob, dout, dlast, _tensors(u, delta, A, B, C, D, z, delta_bias), ckpt, need)


def _backward(prob: ScanProblem, dout, dlast, t: dict, ckpt, need) -> list[_Tensor]:
    """The backward op's body on validated inputs (the op's and the eager path's)."""
    u = t["u"]
    _device_check(u)
    arch = arch_of_device(u.device)
    fcfg, bcfg, backend = configs(prob, u.device, training=True)
    names = {k for k, w in zip(DIFFERENTIABLE, need) if w and t[k] is not None}
    if ckpt is not None and ckpt.numel() == 0:
        ckpt = None
    g = _bwd.backward(prob, bcfg, t, dout, dlast, ckpt, names, backend, arch, fcfg) if names else {}
    return [g[k] if k in g else u.new_empty(0) for k in DIFFERENTIABLE]


@sscan_bwd_op.register_fake
def _sscan_bwd_fake(dout, dlast, u, delta, A, B, C, D, z, delta_bias, ckpt, delta_softplus, need):
    t = _tensors(u, delta, A, B, C, D, z, delta_bias)
    return [torch.empty(t[k].shape, dtype=t[k].dtype, device=t[k].device) if w and t[k] is not None
            else u.new_empty(0) for k, w in zip(DIFFERENTIABLE, need)]


_N_IN = len(DIFFERENTIABLE)


def _fwd_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:_N_IN], output[2])
    ctx.softplus, ctx.last = inputs[_N_IN], inputs[_N_IN + 1]


def _fwd_backward(ctx, dout, dlast, dckpt):
    need = list(ctx.needs_input_grad[:_N_IN])
    out = [None] * (_N_IN + 3)
    if not any(need):
        return tuple(out)
    *t, ckpt = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(t[0])
    grads = torch.ops.autossd.sscan_bwd(dout, dlast if ctx.last else None, *t, ckpt, ctx.softplus, need)
    for i, (w, g) in enumerate(zip(need, grads)):
        if w:
            out[i] = g
    return tuple(out)


sscan_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    """Drop-in for mamba_ssm's selective_scan_fn: same arguments, same returns.

    u, delta, z: (batch, dim, seqlen); A: (dim, dstate), real (a complex A is refused, naming A);
    B, C: (batch, dstate, seqlen), (batch, ngroups, dstate, seqlen) with dim % ngroups == 0
    (group g serves channels g*dim/ngroups ... (g+1)*dim/ngroups - 1), or time-invariant
    (dim, dstate); D, delta_bias: (dim,). Per (batch, channel d, state n), with
    delta' = softplus?(delta + delta_bias): h_t = exp(delta'_t A[d, n]) h_{t-1} + delta'_t B[n, t] u_t;
    y_t = sum_n C[n, t] h_t + D[d] u_t; out = y silu(z) where z is given. Accumulates in fp32;
    inputs in fp32, fp16 or bf16 (delta, B, C, z may differ from u's dtype). Returns out (u's
    dtype), or (out, last_state (batch, dim, dstate) fp32) with return_last_state.
    Differentiable in every tensor input (and through last_state)."""
    delta_softplus = as_flag("delta_softplus", delta_softplus)
    return_last_state = as_flag("return_last_state", return_last_state)
    save = torch.is_grad_enabled() and any_requires_grad(u, delta, A, B, C, D, z, delta_bias)
    if torch.compiler.is_compiling():   # traced: the registered ops (no graph break)
        out, last, _ = torch.ops.autossd.sscan_fwd(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                   return_last_state, save)
        return (out, last) if return_last_state else out
    # Eager calls skip torch's custom-op dispatcher, as the SSD drop-in does: its per-call checks
    # cost more host time than the kernels at batch 1 and 2048 tokens. Validated once, here,
    # with named errors, before anything runs.
    prob = from_args(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)
    t = _tensors(u, delta, A, B, C, D, z, delta_bias)
    if save:
        out, last = _Scan.apply(prob, *(t[k] for k in DIFFERENTIABLE))
    else:
        out, last, _ = _forward(prob, t, False)
    return (out, last) if return_last_state else out


class _Scan(torch.autograd.Function):
    """The eager path's autograd: the ops' bodies called directly (the same kernels, configs and
    checkpoints as the registered ops' autograd, without their dispatch)."""

    @staticmethod
    def forward(ctx, prob, *tensors):
        out, last, ckpt = _forward(prob, dict(zip(DIFFERENTIABLE, tensors)), True)
        ctx.save_for_backward(*tensors, ckpt)
        ctx.prob = prob
        return out, last

    @staticmethod
    def backward(ctx, dout, dlast):
        need = list(ctx.needs_input_grad[1:])
        if not any(need):
            return (None,) * (_N_IN + 1)
        *t, ckpt = ctx.saved_tensors
        grads = _backward(ctx.prob, dout, dlast if ctx.prob.return_last_state else None,
                          dict(zip(DIFFERENTIABLE, t)), ckpt, need)
        return (None, *(g if w else None for w, g in zip(need, grads)))
