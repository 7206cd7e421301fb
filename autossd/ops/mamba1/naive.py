"""Float64 reference of Mamba-1's selective scan (the contract of mamba_ssm's selective_scan_fn):
the recurrence stepped one time step at a time, in plain differentiable torch ops, so autograd
through it gives the reference gradients too. Slow (a Python loop over the sequence): for the
short sequences of the tests and the tuner's gate.

Per (batch b, channel d, state n), with delta' = softplus?(delta + delta_bias):
    h_t = exp(delta'_t A[d, n]) h_{t-1} + delta'_t B[n, t] u_t
    y_t = sum_n C[n, t] h_t + D[d] u_t,      out = y silu(z) where z is given.
B and C are (batch, dstate, seqlen), (batch, ngroups, dstate, seqlen) (group g serves the
dim/ngroups consecutive channels g*dim/ngroups...), or time-invariant (dim, dstate).
"""
from __future__ import annotations

import torch
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


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       return_last_state=False):
    """float64 out (batch, dim, seqlen), and the last state (batch, dim, dstate) where asked:
    (out, last_state). Differentiable in every tensor input."""
    if torch.is_complex(A):
        raise TypeError("A: complex A is not supported (real A only)")
    batch, dim, seqlen = u.shape
    dt = delta.to(f64)
    if delta_bias is not None:
        dt = dt + delta_bias.to(f64)[None, :, None]
    if delta_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    uu = u.to(f64)
    Bd = _per_channel(B, batch, dim, seqlen)
    Cd = _per_channel(C, batch, dim, seqlen)
    a = torch.exp(dt[:, :, None, :] * A.to(f64)[None, :, :, None])   # (b, d, n, l)
    bu = (dt * uu)[:, :, None, :] * Bd
    h = uu.new_zeros(batch, dim, A.shape[1])
    ys = []
    for t in range(seqlen):
        h = a[..., t] * h + bu[..., t]
        ys.append((h * Cd[..., t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + uu * D.to(f64)[None, :, None]
    if z is not None:
        zz = z.to(f64)
        y = y * zz * torch.sigmoid(zz)
    return (y, h) if return_last_state else y
