"""Reference causal depthwise conv1d in plain torch (differentiable by autograd; exact in float64).

out[b, t, c] = act(bias[c] + sum_j weight[c, j] * x[b, t - (width - 1) + j, c]), where a term
counts only if its token exists (t - (width - 1) + j >= 0) and, with seq_idx, belongs to the same
sequence as token t (seq_idx equal): packed sequences do not see each other's tokens.
x is (batch, seqlen, channels), weight (channels, width), bias (channels,) or None.
"""
from __future__ import annotations

import torch.nn.functional as F


def causal_conv1d_ref(x, weight, bias=None, seq_idx=None, activation=None):
    """Computes in the inputs' dtype (pass float64 tensors for a float64 reference)."""
    b, l, c = x.shape
    width = weight.shape[1]
    out = x.new_zeros(b, l, c) if bias is None else bias.expand(b, l, c)
    for j in range(width):
        shift = width - 1 - j
        xs = F.pad(x, (0, 0, shift, 0))[:, :l]          # xs[:, t] = x[:, t - shift], 0 before the start
        if seq_idx is not None and shift:
            same = F.pad(seq_idx, (shift, 0))[:, :l] == seq_idx   # padded rows multiply zeros anyway
            xs = xs * same[..., None].to(xs.dtype)
        out = out + xs * weight[:, j]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out
