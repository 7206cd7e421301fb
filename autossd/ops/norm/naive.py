"""Reference gated RMSNorm in plain torch (differentiable by autograd; exact in float64).

Over the last dimension N, in groups of group_size consecutive columns (None: one group):
  norm_before_gate=True:  y = rmsnorm(x) * weight * silu(z)
  norm_before_gate=False: y = rmsnorm(x * silu(z)) * weight
rmsnorm(u) = u / sqrt(mean over the group of u^2 + eps). Without z there is no gate. The output
has x's dtype; the arithmetic runs in the dtype of x, z and weight promoted together.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rmsnorm_ref(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if z is not None:
        dtype = torch.promote_types(dtype, z.dtype)
    u = x.to(dtype)
    gate = F.silu(z.to(dtype)) if z is not None else None
    if gate is not None and not norm_before_gate:
        u = u * gate
    n = u.shape[-1]
    g = n if group_size is None else group_size
    ug = u.unflatten(-1, (n // g, g))
    y = (ug * torch.rsqrt(ug.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight.to(dtype)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)
