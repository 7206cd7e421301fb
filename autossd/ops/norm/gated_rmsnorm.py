"""Gated RMSNorm (Mamba-2's norm between the SSD and the output projection): Triton forward and
backward.

Over the last dimension, in groups of group_size consecutive columns:
  norm_before_gate=True:  y = rmsnorm(x) * weight * silu(z)
  norm_before_gate=False: y = rmsnorm(x * silu(z)) * weight
with rmsnorm(u) = u / sqrt(mean(u^2 over the group) + eps); no gate without z. `naive` holds
the contract (`gated_rmsnorm_ref`).

One program normalizes BLOCK_M rows of one group, sweeping the group's columns twice, BLOCK_N at
a time (the sums of squares, then the output; the second sweep reads from cache), and keeps each
row's 1/rms for the backward. Mamba-2's groups are often thousands of columns wide (2.7b: 5120 in
one group); swept in chunks they never spill registers. The backward walks a contiguous range of
rows per program and accumulates its own partial dweight row; the partials are added in torch in
a fixed order: no atomics, so the gradients are bitwise reproducible.

Backward, per row and group, with u the normalized input (x, or x * silu(z) gated first),
û = u * rstd and dû the gradient reaching û:  du = rstd * (dû - û * mean(dû * û)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...knobs import pow2_at_least
from ..common.direct import acc_dtype, check_device, check_float, ready


@dataclass(frozen=True)
class Blocks:
    """The kernels' tile sizes. A tile is block_m rows by the group's padded width or block_n
    columns, whichever is less; a wider group is swept block_n columns at a time. Rows are cut so
    that a tile holds at most tile_elems elements (one row at least): the registers a tile takes
    stay bounded whatever the width, with no spills."""
    block_m: int = 16          # rows per tile, at most
    block_n: int = 1024        # columns per tile, at most
    tile_elems: int = 2048     # rows x columns per tile, at most
    bwd_programs: int = 256    # backward programs per group, at most: the dweight partials to add
    num_warps: int = 0         # 0: by tile size, one warp per 256 elements, 1 to 8

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "tile_elems"):
            v = getattr(self, name)
            if type(v) is not int or v < 1 or v & (v - 1):
                raise ValueError(f"Blocks.{name}: expected a power of two, got {v!r}")
        if type(self.bwd_programs) is not int or self.bwd_programs < 1:
            raise ValueError(f"Blocks.bwd_programs: expected a positive int, got {self.bwd_programs!r}")
        if type(self.num_warps) is not int or self.num_warps < 0 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"Blocks.num_warps: expected 0 or a power of two, got {self.num_warps!r}")


DEFAULT = Blocks()


@triton.jit
def _gated(X, Z, rows, col, mask, sxm, sxn, szm, szn, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
           ACC: tl.constexpr):
    """(x, z, silu(z), u): u is what the norm normalizes (x, or x * silu(z) where the gate comes
    first); z and silu(z) are x where there is no gate (never used then)."""
    x = tl.load(X + rows[:, None] * sxm + col[None, :] * sxn, mask=mask, other=0.0).to(ACC)
    z = x
    gate = x
    u = x
    if HAS_Z:
        z = tl.load(Z + rows[:, None] * szm + col[None, :] * szn, mask=mask, other=0.0).to(ACC)
        gate = z / (1.0 + tl.exp(-z))
        if not NORM_BEFORE_GATE:
            u = x * gate
    return x, z, gate, u


@triton.jit
def _norm_fwd(X, Z, W, Y, Rstd, M, N, G, sxm, sxn, szm, szn, sym, syn, eps,
              HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows pid*BLOCK_M.. of group g: the sum of squares over the group's columns, BLOCK_N at a
    time, then the output from a second sweep (re-read from cache)."""
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    cols = tl.arange(0, BLOCK_N)
    ssq = tl.zeros((BLOCK_M,), dtype=ACC)
    for n0 in range(0, N, BLOCK_N):
        cm = n0 + cols < N
        _, _, _, u = _gated(X, Z, rows, g * N + n0 + cols, rm[:, None] & cm[None, :], sxm, sxn, szm, szn,
                            HAS_Z, NORM_BEFORE_GATE, ACC)
        ssq += tl.sum(u * u, axis=1)
    rstd = 1.0 / tl.sqrt(ssq / N + eps)
    tl.store(Rstd + rows * G + g, rstd, mask=rm)
    for n0 in range(0, N, BLOCK_N):
        cm = n0 + cols < N
        col = g * N + n0 + cols
        mask = rm[:, None] & cm[None, :]
        _, _, gate, u = _gated(X, Z, rows, col, mask, sxm, sxn, szm, szn, HAS_Z, NORM_BEFORE_GATE, ACC)
        y = u * rstd[:, None] * tl.load(W + col, mask=cm, other=0.0).to(ACC)[None, :]
        if HAS_Z:
            if NORM_BEFORE_GATE:
                y = y * gate
        tl.store(Y + rows[:, None] * sym + col[None, :] * syn, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, Z, W, Rstd, DY, DX, DZ, DWp, M, N, G, rows_per_prog,
              sxm, sxn, szm, szn, sym, syn, sdxm, sdxn, sdzm, sdzn,
              HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """Rows [pid * rows_per_prog, ...) of group g, BLOCK_M at a time: a first sweep over the
    group's columns for mean(dû * û) per row, a second for dx, dz and the dweight sums. The
    program's dweight partial row is its own: kept in registers where the group is one column
    chunk (ONE_CHUNK), else added to in memory chunk by chunk, a barrier between row tiles
    ordering one tile's store before the next tile's load."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, M)
    DWrow = DWp + pid.to(tl.int64) * G * N + g * N
    dw_reg = tl.zeros((BLOCK_N,), dtype=ACC)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        rm = rows < end
        rstd1 = tl.load(Rstd + rows * G + g, mask=rm, other=0.0)
        rstd = rstd1[:, None]
        dot = tl.zeros((BLOCK_M,), dtype=ACC)
        for n0 in range(0, N, BLOCK_N):
            cm = n0 + cols < N
            col = g * N + n0 + cols
            mask = rm[:, None] & cm[None, :]
            x, z, gate, u = _gated(X, Z, rows, col, mask, sxm, sxn, szm, szn, HAS_Z, NORM_BEFORE_GATE, ACC)
            dy = tl.load(DY + rows[:, None] * sym + col[None, :] * syn, mask=mask, other=0.0).to(ACC)
            duhat = dy * tl.load(W + col, mask=cm, other=0.0).to(ACC)[None, :]
            if HAS_Z:
                if NORM_BEFORE_GATE:
                    duhat = duhat * gate
            dot += tl.sum(duhat * u, axis=1)
        dot = (dot * rstd1 / N)[:, None]   # mean(dû * û) with û = u * rstd
        if not ONE_CHUNK:
            tl.debug_barrier()
        for n0 in range(0, N, BLOCK_N):
            cm = n0 + cols < N
            col = g * N + n0 + cols
            mask = rm[:, None] & cm[None, :]
            x, z, gate, u = _gated(X, Z, rows, col, mask, sxm, sxn, szm, szn, HAS_Z, NORM_BEFORE_GATE, ACC)
            dy = tl.load(DY + rows[:, None] * sym + col[None, :] * syn, mask=mask, other=0.0).to(ACC)
            uhat = u * rstd
            duhat = dy * tl.load(W + col, mask=cm, other=0.0).to(ACC)[None, :]
            yw = dy * uhat   # the output's derivative wrt weight, before the gate
            if HAS_Z:
                sg = 1.0 / (1.0 + tl.exp(-z))
                dgate = sg * (1.0 + z * (1.0 - sg))
                if NORM_BEFORE_GATE:
                    dz = duhat * uhat * dgate
                    duhat = duhat * gate
                    yw = yw * gate
                du = (duhat - uhat * dot) * rstd
                if NORM_BEFORE_GATE:
                    dx = du
                else:
                    dx = du * gate
                    dz = du * x * dgate
                tl.store(DZ + rows[:, None] * sdzm + col[None, :] * sdzn, dz.to(DZ.dtype.element_ty), mask=mask)
            else:
                dx = (duhat - uhat * dot) * rstd
            tl.store(DX + rows[:, None] * sdxm + col[None, :] * sdxn, dx.to(DX.dtype.element_ty), mask=mask)
            if ONE_CHUNK:
                dw_reg += tl.sum(yw, axis=0)
            else:
                prev = tl.load(DWrow + n0 + cols, mask=cm & (m0 > start), other=0.0)
                tl.store(DWrow + n0 + cols, prev + tl.sum(yw, axis=0), mask=cm)
    if ONE_CHUNK:
        tl.store(DWrow + cols, dw_reg, mask=cols < N)


# --- host side ---------------------------------------------------------------------------------
def _new(shape, dtype, device) -> torch.Tensor:
    """Every buffer the kernels write (tests poison it to check that every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tile(M: int, group_size: int, blocks: Blocks) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps)."""
    bn = min(pow2_at_least(group_size), blocks.block_n)
    bm = max(1, min(blocks.block_m, blocks.tile_elems // bn, pow2_at_least(M)))
    warps = blocks.num_warps or min(8, max(1, bm * bn // 256))
    return bm, bn, warps


def gated_rmsnorm_fwd(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True, out=None,
                      blocks: Blocks = DEFAULT):
    """The forward on validated 2-D inputs (rows, N) in any strides: (y in x's dtype, rstd (rows,
    groups) in the accumulation dtype). y is written into `out` when given."""
    M, N = x.shape
    gs = N if group_size is None else group_size
    G = N // gs
    ready(x, "x")
    acc = acc_dtype(x, weight, z)
    if out is None:
        out = _new((M, N), x.dtype, x.device)
    rstd = _new((M, G), torch.float64 if acc == tl.float64 else torch.float32, x.device)
    bm, bn, warps = _tile(M, gs, blocks)
    zz = z if z is not None else x
    _norm_fwd[(triton.cdiv(M, bm), G)](
        x, zz, weight, out, rstd, M, gs, G, *x.stride(), *zz.stride(), *out.stride(), float(eps),
        HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate), ACC=acc, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps)
    return out, rstd


def gated_rmsnorm_bwd(x, weight, z, rstd, dy, group_size=None, norm_before_gate=True, dx=None, dz=None,
                      blocks: Blocks = DEFAULT):
    """(dx, dz or None, dweight) on 2-D inputs; dx, dz written into the buffers given, else new
    ones in x's and z's dtypes; dweight in weight's dtype."""
    M, N = x.shape
    gs = N if group_size is None else group_size
    G = N // gs
    ready(x, "x")
    acc = acc_dtype(x, weight, z)
    bm, bn, warps = _tile(M, gs, blocks)
    nprog = min(triton.cdiv(M, bm), blocks.bwd_programs)
    per = triton.cdiv(triton.cdiv(M, nprog), bm) * bm   # whole tiles per program
    nprog = triton.cdiv(M, per)
    if dx is None:
        dx = _new((M, N), x.dtype, x.device)
    if z is not None and dz is None:
        dz = _new((M, N), z.dtype, z.device)
    dwp = _new((nprog, N), torch.float64 if acc == tl.float64 else torch.float32, x.device)
    zz, dzz = (z, dz) if z is not None else (x, dx)   # never read or written without z
    _norm_bwd[(nprog, G)](
        x, zz, weight, rstd, dy, dx, dzz, dwp, M, gs, G, per,
        *x.stride(), *zz.stride(), *dy.stride(), *dx.stride(), *dzz.stride(),
        HAS_Z=z is not None, NORM_BEFORE_GATE=bool(norm_before_gate), ACC=acc, BLOCK_M=bm, BLOCK_N=bn,
        ONE_CHUNK=gs <= bn, num_warps=warps)
    return dx, (dz if z is not None else None), dwp.sum(0).to(weight.dtype)


def _rows(t, n):
    return t.reshape(-1, n) if t is not None else None


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, z, eps, group_size, norm_before_gate, blocks):
        n = x.shape[-1]
        x2, z2 = _rows(x, n), _rows(z, n)
        y, rstd = gated_rmsnorm_fwd(x2, weight, z2, eps, group_size, norm_before_gate, blocks=blocks)
        ctx.save_for_backward(x2, weight, z2, rstd)
        ctx.shape, ctx.group_size, ctx.norm_before_gate, ctx.blocks = x.shape, group_size, norm_before_gate, blocks
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, z2, rstd = ctx.saved_tensors
        dx, dz, dw = gated_rmsnorm_bwd(x2, weight, z2, rstd, _rows(dy, x2.shape[1]), ctx.group_size,
                                       ctx.norm_before_gate, blocks=ctx.blocks)
        need = ctx.needs_input_grad
        return (dx.view(ctx.shape) if need[0] else None, dw if need[1] else None,
                dz.view(ctx.shape) if dz is not None and need[2] else None, None, None, None, None)


def check_args(x, weight, z=None, eps=1e-6, group_size=None) -> None:
    """Refuse what the kernels do not take, naming the argument."""
    check_float("x", x)
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"x: expected a non-empty tensor (..., N), got shape {tuple(x.shape)}")
    n = x.shape[-1]
    check_float("weight", weight)
    if tuple(weight.shape) != (n,):
        raise ValueError(f"weight: expected shape ({n},) (x's last dimension), got {tuple(weight.shape)}")
    if z is not None:
        check_float("z", z)
        if z.shape != x.shape:
            raise ValueError(f"z: expected x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if group_size is not None and (type(group_size) is not int or group_size < 1 or n % group_size):
        raise ValueError(f"group_size: expected a positive int dividing N={n} (or None), got {group_size!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a float >= 0, got {eps!r}")
    for name, t in (("weight", weight), ("z", z)):
        check_device(name, t, x, "x")


def gated_rmsnorm(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True,
                  blocks: Blocks = DEFAULT):
    """Gated RMSNorm of x (..., N) with weight (N,), gate z (x's shape) or None, per group of
    group_size columns (None: all N). Returns x's shape and dtype; differentiable in x, weight
    and z."""
    check_args(x, weight, z, eps, group_size)
    return _GatedRMSNorm.apply(x, weight, z, float(eps), group_size, bool(norm_before_gate), blocks)
