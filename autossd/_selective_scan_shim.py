"""A stand-in for autossd.selective_scan_fn (the Mamba-1 selective scan), in plain torch, so the
code that calls it can be written and tested before the real op lands; it is replaced by the
real op when branches merge. Signature and semantics are mamba_ssm's:

    u, delta, z (batch, dim, seqlen); A (dim, dstate); B, C (batch, dstate, seqlen) or
    (batch, ngroups, dstate, seqlen) (channel d reads group d // (dim // ngroups));
    D (dim,); delta_bias (dim,).
    delta' = softplus?(delta + delta_bias); state = exp(delta' A) state + delta' u B;
    out = state . C + D u, times silu(z). Returns out in u's dtype, or (out, last_state) with
    last_state (batch, dim, dstate) fp32.

Computed token by token in fp32 (float64 for float64 inputs), differentiable by autograd in every
input."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False):
    acc = torch.promote_types(u.dtype, torch.float32)
    bsz, dim, seqlen = u.shape
    uf, df, Af = u.to(acc), delta.to(acc), A.to(acc)
    if delta_bias is not None:
        df = df + delta_bias.to(acc)[:, None]
    if delta_softplus:
        df = F.softplus(df)

    def per_channel(M):   # (batch, dim, dstate, seqlen)
        M = M.to(acc)
        if M.dim() == 3:
            return M[:, None]
        return M.repeat_interleave(dim // M.shape[1], dim=1)
    Bf, Cf = per_channel(B), per_channel(C)
    state = u.new_zeros(bsz, dim, A.shape[-1], dtype=acc)
    ys = []
    for t in range(seqlen):
        dt = df[:, :, t, None]
        state = torch.exp(dt * Af) * state + dt * uf[:, :, t, None] * Bf[..., t]
        ys.append((state * Cf[..., t]).sum(-1))
    out = torch.stack(ys, dim=-1)
    if D is not None:
        out = out + uf * D.to(acc)[:, None]
    if z is not None:
        out = out * F.silu(z.to(acc))
    out = out.to(u.dtype)
    return (out, state.to(torch.promote_types(acc, torch.float32))) if return_last_state else out
