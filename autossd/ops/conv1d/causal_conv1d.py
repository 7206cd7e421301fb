"""Causal depthwise conv1d over time, with bias and optional SiLU: Triton forward and backward.

    out[b, t, c] = act(bias[c] + sum_j weight[c, j] * x[b, t - (width - 1) + j, c])

x is (batch, seqlen, channels) in any strides (Mamba-2 passes xBC, a slice of the in-projection's
output, whose token stride is the whole projection's width); width is 2 to 4. With seq_idx
(batch, seqlen), a token sees only earlier tokens of its own sequence (equal seq_idx), so packed
sequences stay apart, as causal_conv1d's seq_idx does. `naive.causal_conv1d_ref` is the contract.

Tiles are BLOCK_L tokens by BLOCK_C channels, channels fastest (contiguous in Mamba's layout).
The backward recomputes the pre-activation where SiLU needs it rather than saving it (one
(batch, seqlen, channels) tensor less kept between forward and backward). Each backward program
walks `bwd_tiles` token tiles of one channel block and keeps its dweight and dbias sums in
registers, then writes them as one partial row; the partials are added in torch in a fixed order.
No atomics: the gradients are bitwise reproducible run to run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...knobs import pow2_at_least
from ..common.direct import acc_dtype, check_device, check_float, ready

WIDTHS = (2, 3, 4)
ACTIVATIONS = (None, "silu", "swish")


@dataclass(frozen=True)
class Blocks:
    """The kernels' tile sizes (powers of two; clipped to the problem's padded sizes). The
    defaults compile for sm90 without spills (cross-compiled, bf16, width 4: the forward takes 80
    registers, the backward, which holds 2 * width - 1 shifted tiles of x, 128); larger backward
    tiles spill. Not timed on a GPU yet."""
    block_l: int = 32        # forward: tokens per tile
    block_c: int = 64        # forward: channels per tile
    num_warps: int = 8
    bwd_block_l: int = 16    # backward: tokens per tile
    bwd_block_c: int = 32    # backward: channels per tile
    bwd_warps: int = 4
    bwd_tiles: int = 16      # token tiles one backward program walks: fewer dweight partials to add

    def __post_init__(self) -> None:
        for name in ("block_l", "block_c", "num_warps", "bwd_block_l", "bwd_block_c", "bwd_warps"):
            v = getattr(self, name)
            if type(v) is not int or v < 1 or v & (v - 1):
                raise ValueError(f"Blocks.{name}: expected a power of two, got {v!r}")
        if type(self.bwd_tiles) is not int or self.bwd_tiles < 1:
            raise ValueError(f"Blocks.bwd_tiles: expected a positive int, got {self.bwd_tiles!r}")


DEFAULT = Blocks()


@triton.jit
def _conv_fwd(X, W, Bias, Seq, Out, L, C,
              sxb, sxl, sxc, swc, sww, ssb, ssl, sob, sol, soc,
              WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
              ACC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_l = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t = pid_l.to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)   # int64: long sequences of wide rows
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    tm = t < L
    cm = c < C
    acc = tl.zeros((BLOCK_L, BLOCK_C), dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(Bias + c, mask=cm, other=0.0).to(ACC)[None, :]
    if HAS_SEQ:
        seq_t = tl.load(Seq + b * ssb + t * ssl, mask=tm, other=0)
    for j in tl.static_range(WIDTH):
        u = t - (WIDTH - 1 - j)
        ok = tm & (u >= 0)
        if HAS_SEQ:
            ok = ok & (tl.load(Seq + b * ssb + u * ssl, mask=ok, other=0) == seq_t)
        xv = tl.load(X + b * sxb + u[:, None] * sxl + c[None, :] * sxc, mask=ok[:, None] & cm[None, :], other=0.0)
        wv = tl.load(W + c * swc + j * sww, mask=cm, other=0.0)
        acc += xv.to(ACC) * wv.to(ACC)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(Out + b * sob + t[:, None] * sol + c[None, :] * soc, acc.to(Out.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


@triton.jit
def _conv_bwd(X, W, Bias, Seq, DY, DX, DWp, DBp, L, C, tiles,
              sxb, sxl, sxc, swc, sww, ssb, ssl, syb, syl, syc, sdb, sdl, sdc,
              WIDTH: tl.constexpr, WPAD: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr,
              SILU: tl.constexpr, ACC: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx for `tiles` token tiles of one channel block, and that range's dweight / dbias partials.

    With g[r] the gradient at the conv's pre-activation of token r (dy[r] * act'(a[r])), token s
    feeds tokens r = s .. s + width - 1 of its own sequence through weight[width - 1 - (r - s)]:
    dx[s] = sum_k g[s + k] * weight[width - 1 - k], and dweight[j] = sum_s g[s] * x[s - (width - 1) + j].
    A tile loads x (and seq_idx) once at each of the 2 * width - 1 shifts it needs, rows
    s - (width - 1) .. s + width - 1, and builds every term from those registers: tile m of the
    tuples holds row s + m - (width - 1)."""
    pid_s = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    nsplit = tl.num_programs(0)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    jj = tl.arange(0, WPAD)
    ws = ()
    for j in tl.static_range(WIDTH):
        ws = ws + (tl.load(W + c * swc + j * sww, mask=cm, other=0.0).to(ACC)[None, :],)
    if HAS_BIAS:
        bias = tl.load(Bias + c, mask=cm, other=0.0).to(ACC)[None, :]
    dw = tl.zeros((BLOCK_C, WPAD), dtype=ACC)
    db = tl.zeros((BLOCK_C,), dtype=ACC)
    for i in range(tiles):
        s = (pid_s * tiles + i).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
        sm = s < L
        xs = ()
        ss = ()
        for m in tl.static_range(2 * WIDTH - 1):
            u = s + (m - (WIDTH - 1))
            ok = (u >= 0) & (u < L)
            if SILU or m < WIDTH:   # rows past s feed only the recomputed pre-activation
                xs = xs + (tl.load(X + b * sxb + u[:, None] * sxl + c[None, :] * sxc,
                                   mask=ok[:, None] & cm[None, :], other=0.0).to(ACC),)
            if HAS_SEQ:
                ss = ss + (tl.load(Seq + b * ssb + u * ssl, mask=ok, other=0)[:, None],)
        dx = tl.zeros((BLOCK_L, BLOCK_C), dtype=ACC)
        for k in tl.static_range(WIDTH):
            r = s + k
            g = tl.load(DY + b * syb + r[:, None] * syl + c[None, :] * syc, mask=(r < L)[:, None] & cm[None, :],
                        other=0.0).to(ACC)
            if SILU:
                if HAS_BIAS:
                    a = bias + tl.zeros((BLOCK_L, BLOCK_C), dtype=ACC)
                else:
                    a = tl.zeros((BLOCK_L, BLOCK_C), dtype=ACC)
                for j in tl.static_range(WIDTH):
                    term = xs[k + j] * ws[j]   # x at row r - (width - 1) + j
                    if HAS_SEQ:
                        term = tl.where(ss[k + j] == ss[k + WIDTH - 1], term, 0.0)
                    a += term
                sg = 1.0 / (1.0 + tl.exp(-a))
                g = g * sg * (1.0 + a * (1.0 - sg))
            if HAS_SEQ:
                if k > 0:
                    g = tl.where(ss[k + WIDTH - 1] == ss[WIDTH - 1], g, 0.0)
            if k == 0:
                # g at the tile's own tokens: the bias and weight gradients
                if HAS_BIAS:
                    db += tl.sum(g, axis=0)
                for j in tl.static_range(WIDTH):
                    gx = g * xs[j]   # x at row s - (width - 1) + j
                    if HAS_SEQ:
                        gx = tl.where(ss[j] == ss[WIDTH - 1], gx, 0.0)
                    dw += tl.where(jj[None, :] == j, tl.sum(gx, axis=0)[:, None], 0.0)
            dx += g * ws[WIDTH - 1 - k]
        tl.store(DX + b * sdb + s[:, None] * sdl + c[None, :] * sdc, dx.to(DX.dtype.element_ty),
                 mask=sm[:, None] & cm[None, :])
    row = b * nsplit + pid_s
    tl.store(DWp + row * C * WIDTH + c[:, None] * WIDTH + jj[None, :], dw,
             mask=cm[:, None] & (jj[None, :] < WIDTH))
    if HAS_BIAS:
        tl.store(DBp + row * C + c, db, mask=cm)


@triton.jit
def _conv_update(X, State, W, Bias, Out, C, T, S,
                 sxb, sxc, sxt, ssb, ssc, sss, swc, sww, sob, soc, sot,
                 WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                 BLOCK_C: tl.constexpr, SPAD: tl.constexpr):
    """T new tokens of one row through the conv, with the row's last S inputs kept in State.

    The window is the state followed by the new tokens: position p < S is State[p], p >= S is
    x[p - S]. Token t's output reads positions S + t - (width - 1) .. S + t; the new state is
    positions T .. T + S - 1. Every read of the old state happens before the barrier, every write
    after it: the threads of a program read state elements that other threads overwrite."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(1).to(tl.int64)
    cm = c < C
    xrow = X + b * sxb + c * sxc
    srow = State + b * ssb + c * ssc
    ws = ()
    for j in tl.static_range(WIDTH):
        ws = ws + (tl.load(W + c * swc + j * sww, mask=cm, other=0.0).to(ACC),)
    if HAS_BIAS:
        bias = tl.load(Bias + c, mask=cm, other=0.0).to(ACC)
    for t in range(T):
        if HAS_BIAS:
            acc = bias
        else:
            acc = tl.zeros((BLOCK_C,), dtype=ACC)
        for j in tl.static_range(WIDTH):
            p = S + t - (WIDTH - 1) + j   # >= 0: the state holds at least width - 1 tokens
            v = tl.load(srow + p * sss, mask=cm & (p < S), other=0.0).to(ACC) \
                + tl.load(xrow + (p - S) * sxt, mask=cm & (p >= S), other=0.0).to(ACC)
            acc += v * ws[j]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(Out + b * sob + c * soc + t * sot, acc.to(Out.dtype.element_ty), mask=cm)
    k = tl.arange(0, SPAD)
    src = k + T
    km = k < S
    old = tl.load(srow[:, None] + src[None, :] * sss, mask=cm[:, None] & (km & (src < S))[None, :], other=0.0)
    new = tl.load(xrow[:, None] + (src - S)[None, :] * sxt, mask=cm[:, None] & (km & (src >= S))[None, :],
                  other=0.0)
    shifted = old.to(ACC) + new.to(ACC)
    tl.debug_barrier()
    tl.store(srow[:, None] + k[None, :] * sss, shifted.to(State.dtype.element_ty), mask=cm[:, None] & km[None, :])


# --- host side ---------------------------------------------------------------------------------
def _new(shape, dtype, device) -> torch.Tensor:
    """Every buffer the kernels write (tests poison it to check that every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _tiles(L: int, C: int, block_l: int, block_c: int) -> tuple[int, int]:
    return min(block_l, pow2_at_least(L)), min(block_c, pow2_at_least(C))


def _seq_args(seq_idx, x):
    if seq_idx is None:
        return x, 0, 0   # never read (HAS_SEQ is off): any pointer will do
    return seq_idx, seq_idx.stride(0), seq_idx.stride(1)


def causal_conv1d_fwd(x, weight, bias=None, seq_idx=None, silu=False, out=None,
                      blocks: Blocks = DEFAULT) -> torch.Tensor:
    """The forward on validated inputs: out (batch, seqlen, channels) in x's dtype, written into
    `out` when given (any strides)."""
    B, L, C = x.shape
    width = weight.shape[1]
    ready(x, "x")
    if out is None:
        out = _new((B, L, C), x.dtype, x.device)
    bl, bc = _tiles(L, C, blocks.block_l, blocks.block_c)
    seq, ssb, ssl = _seq_args(seq_idx, x)
    grid = (triton.cdiv(L, bl), triton.cdiv(C, bc), B)
    _conv_fwd[grid](x, weight, bias, seq, out, L, C, *x.stride(), *weight.stride(), ssb, ssl, *out.stride(),
                    WIDTH=width, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=bool(silu),
                    ACC=acc_dtype(x, weight, bias), BLOCK_L=bl, BLOCK_C=bc, num_warps=blocks.num_warps)
    return out


def causal_conv1d_bwd(x, weight, bias, seq_idx, silu, dout, dx=None, blocks: Blocks = DEFAULT):
    """(dx, dweight, dbias or None) from dout, the gradient of the forward's output (any strides).
    dx is written into `dx` when given; dweight and dbias come in weight's and bias's dtypes."""
    B, L, C = x.shape
    width = weight.shape[1]
    ready(x, "x")
    bl, bc = _tiles(L, C, blocks.bwd_block_l, blocks.bwd_block_c)
    n_tiles = triton.cdiv(L, bl)
    tiles = min(blocks.bwd_tiles, n_tiles)
    nsplit = triton.cdiv(n_tiles, tiles)
    acc = acc_dtype(x, weight, bias)
    part_dtype = torch.float64 if acc == tl.float64 else torch.float32
    if dx is None:
        dx = _new((B, L, C), x.dtype, x.device)
    dwp = _new((B * nsplit, C, width), part_dtype, x.device)
    dbp = _new((B * nsplit, C), part_dtype, x.device) if bias is not None else None
    seq, ssb, ssl = _seq_args(seq_idx, x)
    grid = (nsplit, triton.cdiv(C, bc), B)
    _conv_bwd[grid](x, weight, bias, seq, dout, dx, dwp, dbp, L, C, tiles,
                    *x.stride(), *weight.stride(), ssb, ssl, *dout.stride(), *dx.stride(),
                    WIDTH=width, WPAD=pow2_at_least(width), HAS_BIAS=bias is not None,
                    HAS_SEQ=seq_idx is not None, SILU=bool(silu), ACC=acc, BLOCK_L=bl, BLOCK_C=bc,
                    num_warps=blocks.bwd_warps)
    dweight = dwp.sum(0).to(weight.dtype)
    dbias = dbp.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seq_idx, silu, blocks):
        ctx.save_for_backward(x, weight, bias, seq_idx)
        ctx.silu, ctx.blocks = silu, blocks
        return causal_conv1d_fwd(x, weight, bias, seq_idx, silu, blocks=blocks)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, seq_idx = ctx.saved_tensors
        dx, dweight, dbias = causal_conv1d_bwd(x, weight, bias, seq_idx, ctx.silu, dout, blocks=ctx.blocks)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dweight if need[1] else None,
                dbias if need[2] else None, None, None, None)


def check_args(x, weight, bias=None, seq_idx=None, activation=None) -> None:
    """Refuse what the kernels do not take, naming the argument."""
    check_float("x", x)
    if x.dim() != 3:
        raise ValueError(f"x: expected (batch, seqlen, channels), got shape {tuple(x.shape)}")
    B, L, C = x.shape
    if B == 0 or L == 0 or C == 0:
        raise ValueError(f"x: expected non-empty (batch, seqlen, channels), got {tuple(x.shape)}")
    check_float("weight", weight)
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] not in WIDTHS:
        raise ValueError(f"weight: expected (channels={C}, width) with width in {WIDTHS}, got shape "
                         f"{tuple(weight.shape)}")
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (C,):
            raise ValueError(f"bias: expected shape ({C},), got {tuple(bias.shape)}")
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor) or seq_idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seq_idx: expected an int32 (or int64) tensor, got "
                            f"{getattr(seq_idx, 'dtype', type(seq_idx).__name__)}")
        if tuple(seq_idx.shape) != (B, L):
            raise ValueError(f"seq_idx: expected shape (batch, seqlen) = ({B}, {L}), got {tuple(seq_idx.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias), ("seq_idx", seq_idx)):
        check_device(name, t, x, "x")


def causal_conv1d(x, weight, bias=None, seq_idx=None, activation=None, blocks: Blocks = DEFAULT):
    """Causal depthwise conv1d of x (batch, seqlen, channels) with weight (channels, width),
    optional bias (channels,) and seq_idx (batch, seqlen), then SiLU where activation is "silu"
    or "swish" (None: none). Returns (batch, seqlen, channels) in x's dtype, contiguous;
    differentiable in x, weight and bias."""
    check_args(x, weight, bias, seq_idx, activation)
    return _CausalConv1d.apply(x, weight, bias, seq_idx, activation in ("silu", "swish"), blocks)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, block_c: int = 128):
    """The decode form in Mamba's (batch, dim, seqlen) layout, as causal_conv1d's package has it:
    x (batch, dim) for one token per row, or (batch, dim, seqlen) for a few; conv_state
    (batch, dim, state_len) with state_len >= width - 1, the row's last state_len inputs, oldest
    first, updated in place (shifted left by seqlen, the new tokens appended); weight
    (dim, width), bias (dim,), activation None, "silu" or "swish". Returns out shaped like x in
    x's dtype: each new token's conv over the state's last width - 1 inputs and the tokens before
    it. Accumulates in fp32 (float64 for float64 inputs); the state keeps its dtype. Inference
    only: it writes the state, so it is not differentiable."""
    check_float("x", x)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected (batch, dim) or (batch, dim, seqlen), got shape {tuple(x.shape)}")
    x3 = x[..., None] if x.dim() == 2 else x
    Bsz, C, T = x3.shape
    if Bsz == 0 or C == 0 or T == 0:
        raise ValueError(f"x: expected non-empty (batch, dim[, seqlen]), got {tuple(x.shape)}")
    check_float("weight", weight)
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] not in WIDTHS:
        raise ValueError(f"weight: expected (dim={C}, width) with width in {WIDTHS}, got shape "
                         f"{tuple(weight.shape)}")
    width = weight.shape[1]
    check_float("conv_state", conv_state)
    if conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (Bsz, C) or conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state: expected (batch={Bsz}, dim={C}, state_len >= width - 1 = {width - 1}), "
                         f"got shape {tuple(conv_state.shape)}")
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (C,):
            raise ValueError(f"bias: expected shape ({C},), got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    for name, t in (("conv_state", conv_state), ("weight", weight), ("bias", bias)):
        check_device(name, t, x, "x")
    ready(x, "x")
    S = conv_state.shape[2]
    out = _new((Bsz, C, T), x.dtype, x.device)
    bc = min(block_c, pow2_at_least(C))
    _conv_update[(triton.cdiv(C, bc), Bsz)](
        x3, conv_state, weight, bias, out, C, T, S, *x3.stride(), *conv_state.stride(), *weight.stride(),
        *out.stride(), WIDTH=width, HAS_BIAS=bias is not None, SILU=activation in ("silu", "swish"),
        ACC=acc_dtype(x, conv_state, weight, bias), BLOCK_C=bc, SPAD=pow2_at_least(S), num_warps=4)
    return out[..., 0] if x.dim() == 2 else out
