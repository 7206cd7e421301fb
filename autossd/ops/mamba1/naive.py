"""Float64 reference of Mamba-1's selective scan (the contract of mamba_ssm's selective_scan_fn),
in plain differentiable torch ops, so autograd through it gives the reference gradients too. For
the tests and the tuner's gate.

The recurrence h_t = a_t h_{t-1} + b_t is composed by doubling (after step k every t holds the map
from h_{t-2^k} to h_t), a run of steps at a time, the state carried from run to run. Python steps
log2(steps) times a run, not once a time step: stepped one time step at a time, the gradients took
312 s on a CPU at 64 channels x 4096 steps (2.5 s this way), and a measured tune of the backward at
1 x 65536 did not get past its reference in 150 s on an H200.
Memory stays bounded at any length: a run's (batch, dim, dstate, steps) tensors hold at most
RUN_ELEMENTS elements, and with gradients each run is checkpointed (its graph rebuilt in the
backward).

Per (batch b, channel d, state n), with delta' = softplus?(delta + delta_bias):
    h_t = exp(delta'_t A[d, n]) h_{t-1} + delta'_t B[n, t] u_t
    y_t = sum_n C[n, t] h_t + D[d] u_t,      out = y silu(z) where z is given.
B and C are (batch, dstate, seqlen), (batch, ngroups, dstate, seqlen) (group g serves the
dim/ngroups consecutive channels g*dim/ngroups...), or time-invariant (dim, dstate).
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint
import torch.nn.functional as F

f64 = torch.float64


def _per_channel(M, batch: int, dim: int, seqlen: int):
    """B or C as (batch, dim, dstate, seqlen) float64 (a view where it can be)."""
    M = M.to(f64)
    if M.dim() == 2:   # time-invariant (dim, dstate)
        return M[None, :, :, None].expand(batch, dim, M.shape[1], seqlen)
    if M.dim() == 3:   # (batch, dstate, seqlen): one group
        return M[:, None].expand(batch, dim, M.shape[1], seqlen)
    g = M.shape[1]
    return M.repeat_interleave(dim // g, dim=1)


# float64 elements of one (batch, dim, dstate, steps) tensor a run of steps may hold (256 MB)
RUN_ELEMENTS = 1 << 25


def _shift(t, k: int, fill: float):
    """t moved k steps later along the last dim, the first k steps `fill`."""
    return F.pad(t[..., :-k], (k, 0), value=fill)


def _run(h, dt, uu, A, B, C, batch: int, dim: int):
    """The recurrence over one run of steps from the state h: (y of the run, the state after it)."""
    steps = dt.shape[-1]
    a = torch.exp(dt[:, :, None, :] * A[None, :, :, None])   # (b, d, n, steps)
    b = (dt * uu)[:, :, None, :] * _per_channel(B, batch, dim, steps)
    k = 1
    while k < steps:   # (a, b)_t composed with (a, b)_{t-k}: the map from h_{t-2k} to h_t
        b = b + a * _shift(b, k, 0.0)
        a = a * _shift(a, k, 1.0)
        k *= 2
    hs = a * h[..., None] + b
    return (hs * _per_channel(C, batch, dim, steps)).sum(2), hs[..., -1]


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False, run: int | None = None):
    """float64 out (batch, dim, seqlen), and the last state (batch, dim, dstate) where asked:
    (out, last_state). Differentiable in every tensor input. `run`: steps made at once (default:
    as many as RUN_ELEMENTS allow); with gradients wanted and several runs, each is checkpointed."""
    if torch.is_complex(A):
        raise TypeError("A: complex A is not supported (real A only)")
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    dt = delta.to(f64)
    if delta_bias is not None:
        dt = dt + delta_bias.to(f64)[None, :, None]
    if delta_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    uu = u.to(f64)
    A64 = A.to(f64)
    run = run or max(1, min(seqlen, RUN_ELEMENTS // (batch * dim * dstate)))
    h = uu.new_zeros(batch, dim, dstate)
    checkpointed = torch.is_grad_enabled() and run < seqlen
    ys = []
    for lo in range(0, seqlen, run):
        sl = slice(lo, min(seqlen, lo + run))
        Bs = B if B.dim() == 2 else B[..., sl]
        Cs = C if C.dim() == 2 else C[..., sl]
        if checkpointed:
            y, h = torch.utils.checkpoint.checkpoint(_run, h, dt[..., sl], uu[..., sl], A64, Bs, Cs, batch, dim,
                                                     use_reentrant=False)
        else:
            y, h = _run(h, dt[..., sl], uu[..., sl], A64, Bs, Cs, batch, dim)
        ys.append(y)
    y = torch.cat(ys, dim=-1)
    if D is not None:
        y = y + uu * D.to(f64)[None, :, None]
    if z is not None:
        zz = z.to(f64)
        y = y * zz * torch.sigmoid(zz)
    return (y, h) if return_last_state else y
