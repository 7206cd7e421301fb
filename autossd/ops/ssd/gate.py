"""The output gate y = y' · z · sigmoid(z) as a kernel of its own.

The differentiable forward with z runs the SSD without its gate and gates here, so that it can
keep the ungated output y' for the backward (z's gradient needs it) instead of the backward
running the whole forward again (mamba_ssm keeps it too). y' is rounded to its dtype before the
gate, so these outputs may differ from the fused gate's by a rounding of the output dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.direct import ready

ROWS = 32


@triton.jit
def _silu_gate(y_ptr, z_ptr, o_ptr, L, P,
               s_y_b, s_y_l, s_y_h, s_y_p,
               s_z_b, s_z_l, s_z_h, s_z_p,
               s_o_b, s_o_l, s_o_h, s_o_p,
               ROWS: tl.constexpr, P2: tl.constexpr):
    pid_l = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_l = pid_l * ROWS + tl.arange(0, ROWS)
    offs_p = tl.arange(0, P2)
    mask = (offs_l < L)[:, None] & (offs_p < P)[None, :]
    rows = offs_l.to(tl.int64)[:, None]
    yp = tl.load(y_ptr + b * s_y_b + rows * s_y_l + h * s_y_h + offs_p[None, :] * s_y_p,
                 mask=mask, other=0.0).to(tl.float32)
    zz = tl.load(z_ptr + b * s_z_b + rows * s_z_l + h * s_z_h + offs_p[None, :] * s_z_p,
                 mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + b * s_o_b + rows * s_o_l + h * s_o_h + offs_p[None, :] * s_o_p,
             (yp * zz * tl.sigmoid(zz)).to(o_ptr.dtype.element_ty), mask=mask)


def silu_gate(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """y · z · sigmoid(z) for y and z of one shape (batch, seqlen, nheads, headdim), computed in
    fp32, returned as a new contiguous tensor in y's dtype."""
    if y.shape != z.shape or y.dim() != 4:
        raise ValueError(f"z: expected the shape of y {tuple(y.shape)}, got {tuple(z.shape)}")
    ready(y, "y")
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    b, l, h, p = y.shape
    if out.numel():
        _silu_gate[(triton.cdiv(l, ROWS), h, b)](y, z, out, l, p, *y.stride(), *z.stride(), *out.stride(),
                                                  ROWS=ROWS, P2=max(16, triton.next_power_of_2(p)),
                                                  num_warps=4)
    return out
