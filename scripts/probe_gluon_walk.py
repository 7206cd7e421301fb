"""Probe: the chunk state and the state passing as one Gluon walk over the chunks (BENCHMARKS §96).

Five launches spend 1.3 ms of 3.45 at 2.7b 1x131072 fp16 on two stages that move 2 GB: the chunk
state reads x and writes each chunk's local state (0.67 GB), the state passing reads them and
writes the entering states. A walk writes only the entering states: one program per (headdim tile,
dstate tile, head, batch) carries its state tile through every chunk in order, in the wgmma's
accumulator, S <- exp(dA_last) S + sum_t exp(dA_last - dA_t) dt'_t x_t^T B_t. §29's tl walk lost
(2.09 ms) because each chunk's loads were waited for at the chunk's top; here x and B come by TMA
through a ring of STAGES 64-token blocks, issued STAGES blocks ahead, and the entering state leaves
by TMA store. The x block is read transposed from shared memory into registers, scaled by its
tokens' weights there and fed to the wgmma as its register operand; B feeds it from shared memory.

`walk_async` (variant knob ASYNC=1, §100) keeps block t's wgmma in flight while block t+1's
operand is read and scaled, with dA/dt loaded two blocks ahead: slower at every shape (§101).
`SA=1` (§104, not yet run on a GPU) scales x in place in its ring stage, read as stored, and
feeds the wgmma both operands from shared memory (x transposed by the MMA's descriptor) instead
of an ldmatrix.trans read into the register operand. `WP=1` (§119) reads precomputed per-token
weights (shipped as the `walk_weights` knob, §120); with it, `AHEAD=2` (§130, not yet run on a
GPU) issues each block's weights and chunk end two blocks before their use instead of one.

Scope: L a multiple of 256 (chunk 256), headdim a multiple of 64, dstate a multiple of BN, 16-bit
inputs and states, no seq_idx, no initial states. The harness runs autossd's five launches (their
states and final states are the reference), then each variant on the same dA/dt into poisoned
states, compares, and times each variant against the five launches' chunk state + state passing,
eagerly and by graph replay. Needs an sm90 GPU (Gluon has no interpreter); `--compile-only`
cross-compiles and prints registers, spills and shared memory.

    python scripts/probe_gluon_walk.py [--compile-only] [--variants JSON] [--out DIR] [--rounds N]
        [--shapes 'a;b']
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the checkout's autossd

ACC64 = ttgl.constexpr(ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
COL = ttgl.constexpr(ttgl.SliceLayout(0, ACC64.value))
XROWS = ttgl.constexpr(ttgl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))   # x block as stored
LOG2E = ttgl.constexpr(1.4426950408889634)
CHUNK = ttgl.constexpr(256)


@gluon.jit
def _fill(x_desc, B_desc, xs, bs, bars, stage, row, col_x, col_b, BN: ttgl.constexpr, KB: ttgl.constexpr,
          M: ttgl.constexpr = 64):
    # a token block's x tile (KB x M: M / 64 heads' headdim) and B tile (KB x BN) into ring stage `stage`
    mbarrier.expect(bars.index(stage), (KB * M + KB * BN) * 2)
    tma.async_copy_global_to_shared(x_desc, [row, col_x], bars.index(stage), xs.index(stage))
    tma.async_copy_global_to_shared(B_desc, [row, col_b], bars.index(stage), bs.index(stage))


@gluon.jit
def _publish(ss, acc, st_desc, row, col):
    # the state entering a chunk leaves by TMA; the tile buffer is free once the last store is
    tma.store_wait(0)
    ttgl.thread_barrier()
    ss.store(acc.to(st_desc.dtype))
    fence_async_shared()
    ttgl.thread_barrier()
    tma.async_copy_shared_to_global(st_desc, [row, col], ss)


@gluon.jit
def walk(x_desc, B_desc, st_desc, dA_ptr, dt_ptr, final_ptr, L, H, P, heads_per_group,
         s_dt_b, s_dt_h, s_dt_c,
         N: ttgl.constexpr, BN: ttgl.constexpr, STAGES: ttgl.constexpr, KB: ttgl.constexpr,
         XT: ttgl.constexpr = 0, SA: ttgl.constexpr = 0, XH: ttgl.constexpr = 0, WP: ttgl.constexpr = 0,
         AHEAD: ttgl.constexpr = 1):
    # WP = 1 (§119): dt_ptr holds each token's weight exp(dA_last - dA_t) dt'_t, as a prep launch
    # would write it: one load per block and no exponentials in the chain
    ACC: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN, 16])
    A_OP: ttgl.constexpr = ttgl.DotOperandLayout(0, ACC, 2)
    dtype: ttgl.constexpr = x_desc.dtype
    NBN: ttgl.constexpr = N // BN
    PER: ttgl.constexpr = CHUNK // KB    # token blocks per chunk
    pid0 = ttgl.program_id(0)
    h = ttgl.program_id(1)
    b = ttgl.program_id(2)
    pid_m = pid0 // NBN
    pid_n = pid0 % NBN
    g = h // heads_per_group
    NC = L // CHUNK
    T = NC * PER                      # token blocks, walked in order
    row0 = b * L
    col_x = h * P + pid_m * 64
    col_b = g * N + pid_n * BN
    st_row = (b * NC * H + h) * P + pid_m * 64   # chunk c's tile: st_row + c * H * P

    xs = ttgl.allocate_shared_memory(dtype, [STAGES, KB, 64], x_desc.layout)
    bs = ttgl.allocate_shared_memory(dtype, [STAGES, KB, BN], B_desc.layout)
    ss = ttgl.allocate_shared_memory(dtype, [64, BN], st_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in ttgl.static_range(STAGES):
        if i < T:
            _fill(x_desc, B_desc, xs, bs, bars, i, row0 + i * KB, col_x, col_b, BN, KB)

    cols = ttgl.arange(0, KB, layout=COL)
    dA_base = dA_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h
    dt_base = dt_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h
    # dA/dt of the next block and the next chunk's last dA are loaded one step ahead
    if WP == 0:
        nA = ttgl.load(dA_base + cols)
    nT = ttgl.load(dt_base + cols)
    if WP == 1:
        nA = nT   # unused
    nLast = ttgl.load(dA_base + CHUNK - 1)   # the last dA of the next block's chunk
    if AHEAD == 2:   # (WP = 1 only) the block after next's weights and chunk end, a step earlier (§130)
        i2 = ttgl.minimum(1, T - 1)
        nT2 = ttgl.load(dt_base + (i2 // PER).to(ttgl.int64) * s_dt_c + (i2 % PER) * KB + cols)
        nLast2 = ttgl.load(dA_base + (i2 // PER).to(ttgl.int64) * s_dt_c + CHUNK - 1)
    acc = ttgl.zeros([64, BN], ttgl.float32, ACC)
    for it in range(T):
        c = it // PER
        # set in every iteration, not in the branch below: a value the branch assigned from a
        # loop-carried one came out stale in the next chunk (§96's first run)
        dA_last = nLast
        if it % PER == 0:
            _publish(ss, acc, st_desc, st_row + c * H * P, pid_n * BN)
            acc = acc * ttgl.exp(dA_last)
        stage = it % STAGES
        if WP == 0:
            w = ttgl.exp2((dA_last - nA) * LOG2E) * nT
        else:
            w = nT
        if AHEAD == 2:   # what was loaded two blocks ago moves up; block it + 2's is loaded now
            i2 = ttgl.minimum(it + 2, T - 1)
            nT = nT2
            nA = nT
            nLast = nLast2
            nT2 = ttgl.load(dt_base + (i2 // PER).to(ttgl.int64) * s_dt_c + (i2 % PER) * KB + cols)
            nLast2 = ttgl.load(dA_base + (i2 // PER).to(ttgl.int64) * s_dt_c + CHUNK - 1)
        else:
            i1 = ttgl.minimum(it + 1, T - 1)
            off1 = (i1 // PER).to(ttgl.int64) * s_dt_c + (i1 % PER) * KB
            if WP == 0:
                nA = ttgl.load(dA_base + off1 + cols)
            nT = ttgl.load(dt_base + off1 + cols)
            if WP == 1:
                nA = nT
            nLast = ttgl.load(dA_base + (i1 // PER).to(ttgl.int64) * s_dt_c + CHUNK - 1)
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        if SA == 1:   # x scaled in place, read as stored; both MMA operands from shared memory
            xr = xs.index(stage).load(XROWS)                                    # (tokens, headdim)
            wr = ttgl.convert_layout(w, ttgl.SliceLayout(1, XROWS))
            xs.index(stage).store((xr.to(ttgl.float32) * wr[:, None]).to(dtype))
            fence_async_shared()
            ttgl.thread_barrier()   # every warp's scaled rows are in place before the MMA reads them
            acc = warpgroup_mma(xs.index(stage).permute((1, 0)), bs.index(stage), acc)
        elif XH == 1:   # scaled in the input dtype (packed 16-bit multiplies), then converted
            xh = xs.index(stage).permute((1, 0)).load(ACC64)
            a = ttgl.convert_layout(xh * w.to(dtype)[None, :], A_OP)
            acc = warpgroup_mma(a, bs.index(stage), acc)
        elif XH == 2:   # read straight into the operand's layout, scaled there in the input dtype
            xh = xs.index(stage).permute((1, 0)).load(A_OP)
            wa = ttgl.convert_layout(w.to(dtype), ttgl.SliceLayout(0, A_OP))
            acc = warpgroup_mma(xh * wa[None, :], bs.index(stage), acc)
        elif XT == 0:   # transposed by the shared-memory read
            xa = xs.index(stage).permute((1, 0)).load(ACC64).to(ttgl.float32)   # (headdim, tokens)
        else:         # read as stored, transposed in registers
            xa = ttgl.convert_layout(ttgl.permute(xs.index(stage).load(XROWS), (1, 0)), ACC64).to(ttgl.float32)
        if SA == 0 and XH == 0:
            a = ttgl.convert_layout((xa * w[None, :]).to(dtype), A_OP)
            acc = warpgroup_mma(a, bs.index(stage), acc)
        ttgl.thread_barrier()   # every warp has read the stage and its MMA is done
        nxt = it + STAGES
        if nxt < T:
            _fill(x_desc, B_desc, xs, bs, bars, stage, row0 + nxt * KB, col_x, col_b, BN, KB)
    tma.store_wait(0)
    rows = ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, ACC))
    ncol = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, ACC))
    fin = final_ptr + ((b * H + h).to(ttgl.int64) * P + pid_m * 64 + rows)[:, None] * N + (pid_n * BN + ncol)[None, :]
    ttgl.store(fin, acc)
    for i in ttgl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def walk_heads(x_desc, B_desc, st_desc, dA_ptr, dt_ptr, final_ptr, L, H, P, heads_per_group,
               s_dt_b, s_dt_h, s_dt_c,
               N: ttgl.constexpr, BN: ttgl.constexpr, STAGES: ttgl.constexpr, KB: ttgl.constexpr):
    # HEADS = 2 (§117): two adjacent heads of one group per program, headdim 64. Their x^T tiles
    # are stacked into one M = 128 wgmma against the B block they share, issued by two
    # warpgroups (8 warps): each scheduler gets two warps' independent chains where the shipped
    # walk gives it one (§113), for the same number of programs at BN = 64.
    M: ttgl.constexpr = 128
    ACC: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                      instr_shape=[16, BN, 16])
    XL: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                     instr_shape=[16, 64, 16])
    A_OP: ttgl.constexpr = ttgl.DotOperandLayout(0, ACC, 2)
    dtype: ttgl.constexpr = x_desc.dtype
    PER: ttgl.constexpr = CHUNK // KB
    pid_n = ttgl.program_id(0)
    h0 = ttgl.program_id(1) * 2
    b = ttgl.program_id(2)
    g = h0 // heads_per_group
    NC = L // CHUNK
    T = NC * PER
    row0 = b * L
    col_x = h0 * P
    col_b = g * N + pid_n * BN
    st_row = (b * NC * H + h0) * P   # both heads' rows are adjacent (P == 64)

    xs = ttgl.allocate_shared_memory(dtype, [STAGES, KB, M], x_desc.layout)
    bs = ttgl.allocate_shared_memory(dtype, [STAGES, KB, BN], B_desc.layout)
    ss = ttgl.allocate_shared_memory(dtype, [M, BN], st_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in ttgl.static_range(STAGES):
        if i < T:
            _fill(x_desc, B_desc, xs, bs, bars, i, row0 + i * KB, col_x, col_b, BN, KB, M)

    cols = ttgl.arange(0, KB, layout=ttgl.SliceLayout(0, XL))
    second = ttgl.arange(0, M, layout=ttgl.SliceLayout(1, XL)) >= 64        # x^T rows of head h0 + 1
    arow2 = ttgl.arange(0, M, layout=ttgl.SliceLayout(1, ACC)) >= 64       # accumulator rows of h0 + 1
    dA_b1 = dA_ptr + b.to(ttgl.int64) * s_dt_b + h0 * s_dt_h
    dt_b1 = dt_ptr + b.to(ttgl.int64) * s_dt_b + h0 * s_dt_h
    dA_b2 = dA_b1 + s_dt_h
    dt_b2 = dt_b1 + s_dt_h
    nA1 = ttgl.load(dA_b1 + cols)
    nT1 = ttgl.load(dt_b1 + cols)
    nA2 = ttgl.load(dA_b2 + cols)
    nT2 = ttgl.load(dt_b2 + cols)
    nL1 = ttgl.load(dA_b1 + CHUNK - 1)
    nL2 = ttgl.load(dA_b2 + CHUNK - 1)
    acc = ttgl.zeros([M, BN], ttgl.float32, ACC)
    for it in range(T):
        c = it // PER
        dl1 = nL1   # set in every iteration (see walk)
        dl2 = nL2
        if it % PER == 0:
            _publish(ss, acc, st_desc, st_row + c * H * P, pid_n * BN)
            acc = acc * ttgl.exp(ttgl.where(arow2, dl2, dl1))[:, None]
        stage = it % STAGES
        w1 = ttgl.exp2((dl1 - nA1) * LOG2E) * nT1
        w2 = ttgl.exp2((dl2 - nA2) * LOG2E) * nT2
        i1 = ttgl.minimum(it + 1, T - 1)
        off1 = (i1 // PER).to(ttgl.int64) * s_dt_c + (i1 % PER) * KB
        nA1 = ttgl.load(dA_b1 + off1 + cols)
        nT1 = ttgl.load(dt_b1 + off1 + cols)
        nA2 = ttgl.load(dA_b2 + off1 + cols)
        nT2 = ttgl.load(dt_b2 + off1 + cols)
        offL = (i1 // PER).to(ttgl.int64) * s_dt_c + CHUNK - 1
        nL1 = ttgl.load(dA_b1 + offL)
        nL2 = ttgl.load(dA_b2 + offL)
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        xa = xs.index(stage).permute((1, 0)).load(XL).to(ttgl.float32)     # (2 x headdim, tokens)
        w = ttgl.where(second[:, None], w2[None, :], w1[None, :])
        a = ttgl.convert_layout((xa * w).to(dtype), A_OP)
        acc = warpgroup_mma(a, bs.index(stage), acc)
        ttgl.thread_barrier()
        nxt = it + STAGES
        if nxt < T:
            _fill(x_desc, B_desc, xs, bs, bars, stage, row0 + nxt * KB, col_x, col_b, BN, KB, M)
    tma.store_wait(0)
    rows = ttgl.arange(0, M, layout=ttgl.SliceLayout(1, ACC))
    ncol = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, ACC))
    fin = final_ptr + ((b * H + h0).to(ttgl.int64) * P + rows)[:, None] * N + (pid_n * BN + ncol)[None, :]
    ttgl.store(fin, acc)
    for i in ttgl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _operand(xs, bars, it, dA_last, nA, nT, STAGES: ttgl.constexpr, A_OP: ttgl.constexpr,
             dtype: ttgl.constexpr):
    # block it's register operand: x^T scaled by exp(dA_last - dA_t) dt'_t
    w = ttgl.exp2((dA_last - nA) * LOG2E) * nT
    stage = it % STAGES
    mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
    xa = xs.index(stage).permute((1, 0)).load(ACC64).to(ttgl.float32)
    return ttgl.convert_layout((xa * w[None, :]).to(dtype), A_OP)


@gluon.jit
def walk_async(x_desc, B_desc, st_desc, dA_ptr, dt_ptr, final_ptr, L, H, P, heads_per_group,
               s_dt_b, s_dt_h, s_dt_c,
               N: ttgl.constexpr, BN: ttgl.constexpr, STAGES: ttgl.constexpr, KB: ttgl.constexpr):
    # walk with block it's wgmma in flight while block it + 1's operand is read and scaled (the
    # chain per block was ~2,000 cycles with everything in series, §96); one MMA in flight, so a
    # stage is refilled once its MMA is waited for. dA/dt are loaded two blocks ahead.
    ACC: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN, 16])
    A_OP: ttgl.constexpr = ttgl.DotOperandLayout(0, ACC, 2)
    dtype: ttgl.constexpr = x_desc.dtype
    NBN: ttgl.constexpr = N // BN
    PER: ttgl.constexpr = CHUNK // KB
    pid0 = ttgl.program_id(0)
    h = ttgl.program_id(1)
    b = ttgl.program_id(2)
    pid_m = pid0 // NBN
    pid_n = pid0 % NBN
    g = h // heads_per_group
    NC = L // CHUNK
    T = NC * PER
    row0 = b * L
    col_x = h * P + pid_m * 64
    col_b = g * N + pid_n * BN
    st_row = (b * NC * H + h) * P + pid_m * 64

    xs = ttgl.allocate_shared_memory(dtype, [STAGES, KB, 64], x_desc.layout)
    bs = ttgl.allocate_shared_memory(dtype, [STAGES, KB, BN], B_desc.layout)
    ss = ttgl.allocate_shared_memory(dtype, [64, BN], st_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in ttgl.static_range(STAGES):
        if i < T:
            _fill(x_desc, B_desc, xs, bs, bars, i, row0 + i * KB, col_x, col_b, BN, KB)

    cols = ttgl.arange(0, KB, layout=COL)
    dA_base = dA_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h
    dt_base = dt_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h
    # block 0's operand, and block 1's dA/dt and chunk's last dA
    last = ttgl.load(dA_base + CHUNK - 1)
    a_cur = _operand(xs, bars, 0, last, ttgl.load(dA_base + cols), ttgl.load(dt_base + cols), STAGES, A_OP, dtype)
    i1 = ttgl.minimum(1, T - 1)
    off1 = (i1 // PER).to(ttgl.int64) * s_dt_c
    nA = ttgl.load(dA_base + off1 + (i1 % PER) * KB + cols)
    nT = ttgl.load(dt_base + off1 + (i1 % PER) * KB + cols)
    nLast = ttgl.load(dA_base + off1 + CHUNK - 1)
    acc = ttgl.zeros([64, BN], ttgl.float32, ACC)
    for it in range(T):
        c = it // PER
        if it % PER == 0:   # acc is complete here: every MMA was waited for
            tma.store_wait(0)
            ttgl.thread_barrier()
            ss.store(acc.to(dtype))
            fence_async_shared()
            ttgl.thread_barrier()
            tma.async_copy_shared_to_global(st_desc, [st_row + c * H * P, pid_n * BN], ss)
            acc = acc * ttgl.exp(last)
        stage = it % STAGES
        acc = warpgroup_mma(a_cur, bs.index(stage), acc, is_async=True)
        # block it + 1's operand under the MMA (the last iteration reads block T - 1 again)
        a_next = _operand(xs, bars, ttgl.minimum(it + 1, T - 1), nLast, nA, nT, STAGES, A_OP, dtype)
        last = nLast
        i2 = ttgl.minimum(it + 2, T - 1)
        off2 = (i2 // PER).to(ttgl.int64) * s_dt_c
        nA = ttgl.load(dA_base + off2 + (i2 % PER) * KB + cols)
        nT = ttgl.load(dt_base + off2 + (i2 % PER) * KB + cols)
        nLast = ttgl.load(dA_base + off2 + CHUNK - 1)
        acc, a_cur = warpgroup_mma_wait(0, deps=[acc, a_cur])   # it reads a_cur's registers until done
        ttgl.thread_barrier()   # every warp is past block it's stage
        nxt = it + STAGES
        if nxt < T:
            _fill(x_desc, B_desc, xs, bs, bars, stage, row0 + nxt * KB, col_x, col_b, BN, KB)
        a_cur = a_next
    tma.store_wait(0)
    rows = ttgl.arange(0, 64, layout=ttgl.SliceLayout(1, ACC))
    ncol = ttgl.arange(0, BN, layout=ttgl.SliceLayout(0, ACC))
    fin = final_ptr + ((b * H + h).to(ttgl.int64) * P + pid_m * 64 + rows)[:, None] * N + (pid_n * BN + ncol)[None, :]
    ttgl.store(fin, acc)
    for i in ttgl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def _layout(block, dtype):
    return ttgl.NVMMASharedLayout.get_default_for(block, dtype)


def walk_weights(dA, dt):
    """Each token's weight in its chunk's state, exp(dA_last - dA_t) dt'_t, (b, h, nc, q): what
    the reference sums with, and what a prep launch would write for the walk (WP = 1)."""
    return torch.exp(dA[..., -1:] - dA) * dt


def launcher(x, B, states, dA, dt, final, BN=64, STAGES=4, KB=64, XT=0, ASYNC=0, SA=0, XH=0, HEADS=1, WP=0,
             AHEAD=1):
    """A no-argument launch of the walk on these buffers (descriptors built once)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GD
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    nc = states.shape[1]
    gdt = {torch.float16: ttgl.float16, torch.bfloat16: ttgl.bfloat16}[x.dtype]
    assert x.is_contiguous() and B.is_contiguous() and states.is_contiguous() and states.dtype == x.dtype
    assert l % 256 == 0 and p % 64 == 0 and n % BN == 0
    if HEADS == 2:
        assert p == 64 and (h // g) % 2 == 0, "HEADS=2: headdim 64, an even number of heads per group"
    m = 64 * HEADS   # x^T rows per program: one headdim tile, or HEADS heads' whole headdim
    x_d = GD(x, [b * l, h * p], [h * p, 1], [KB, m], _layout([KB, m], gdt))
    B_d = GD(B, [b * l, g * n], [g * n, 1], [KB, BN], _layout([KB, BN], gdt))
    s_d = GD(states, [b * nc * h * p, n], [n, 1], [m, BN], _layout([m, BN], gdt))
    if WP:   # the weights a prep launch would write, in dt's place
        dt = walk_weights(dA, dt)
    args = (x_d, B_d, s_d, dA, dt, final, l, h, p, h // g, dA.stride(0), dA.stride(1), dA.stride(2))
    if HEADS == 2:
        grid = (n // BN, h // 2, b)
        return lambda: walk_heads[grid](*args, N=n, BN=BN, STAGES=STAGES, KB=KB, num_warps=8)
    grid = ((p // 64) * (n // BN), h, b)
    if ASYNC:
        return lambda: walk_async[grid](*args, N=n, BN=BN, STAGES=STAGES, KB=KB, num_warps=4)
    assert AHEAD == 1 or WP == 1, "AHEAD=2 is written for the precomputed weights (WP=1)"
    return lambda: walk[grid](*args, N=n, BN=BN, STAGES=STAGES, KB=KB, XT=XT, SA=SA, XH=XH, WP=WP, AHEAD=AHEAD,
                              num_warps=4)


def reference(x, B, dA, dt, heads_per_group):
    """The entering states (b, nc, h, p, n) and final states in float64, from the same dA/dt."""
    b, l, h, p = x.shape
    n, q = B.shape[3], dA.shape[3]
    nc = l // q
    xc = x.double().view(b, nc, q, h, p)
    Bc = B.double().view(b, nc, q, B.shape[2], n).repeat_interleave(heads_per_group, dim=3)
    dA64, dt64 = dA.double(), dt.double()                       # (b, h, nc, q)
    w = walk_weights(dA64, dt64)                                # (b, h, nc, q)
    local = torch.einsum("bhct,bcthp,bcthn->bchpn", w, xc, Bc)
    S = torch.zeros(b, h, p, n, dtype=torch.float64, device=x.device)
    out = []
    for c in range(nc):
        out.append(S)
        S = torch.exp(dA64[:, :, c, -1])[..., None, None] * S + local[:, c]
    return torch.stack(out, 1), S


def compile_only(BN=64, STAGES=4, KB=64, XT=0, ASYNC=0, SA=0, XH=0, HEADS=1, WP=0, AHEAD=1):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    from autossd.compile import _nvidia_resources
    m = 64 * HEADS
    lx, lB, lS = (_layout(s, ttgl.float16) for s in ([KB, m], [KB, BN], [m, BN]))
    sig = {"x_desc": f"tensordesc<fp16[{KB},{m}],{lx}>", "B_desc": f"tensordesc<fp16[{KB},{BN}],{lB}>",
           "st_desc": f"tensordesc<fp16[{m},{BN}],{lS}>", "dA_ptr": "*fp32", "dt_ptr": "*fp32",
           "final_ptr": "*fp32", "L": "i32", "H": "i32", "P": "i32", "heads_per_group": "i32",
           "s_dt_b": "i32", "s_dt_h": "i32", "s_dt_c": "i32", "N": "constexpr", "BN": "constexpr",
           "STAGES": "constexpr", "KB": "constexpr"}
    consts = {"N": 128, "BN": BN, "STAGES": STAGES, "KB": KB}
    if HEADS == 2:
        fn, name = walk_heads, "walk_heads"
    elif ASYNC:
        fn, name = walk_async, "walk_async"
    else:
        fn, name = walk, "walk"
        for k, v in {"XT": XT, "SA": SA, "XH": XH, "WP": WP, "AHEAD": AHEAD}.items():
            sig[k], consts[k] = "constexpr", v
    k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4 * HEADS})
    regs, spill = _nvidia_resources(k.asm["cubin"])
    print(f"{name} BN={BN} STAGES={STAGES} KB={KB} XT={XT} SA={SA} XH={XH} WP={WP} AHEAD={AHEAD} sm90: {regs} registers, "
          f"{spill} bytes spilled, {k.metadata.shared} bytes of shared memory")
    return k


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--variants", default='[{"BN": 128, "STAGES": 2, "KB": 128}, '
                    '{"BN": 128, "STAGES": 2, "KB": 128, "SA": 1}, {"BN": 128, "STAGES": 3, "KB": 128, "SA": 1}]',
                    help="JSON list of constexpr knobs: dstate tile BN, ring stages, tokens per block KB, "
                         "ASYNC (walk_async), SA (both operands from shared memory)")
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--debug", action="store_true", help="errors per chunk against a float64 walk")
    ap.add_argument("--shapes", default="mamba2-2.7b:b=1,l=131072;mamba2-2.7b:b=4,l=16384;"
                    "codestral-7b:b=1,l=131072;mamba2-2.7b:b=1,l=2048")
    a = ap.parse_args()
    variants = json.loads(a.variants)
    if a.compile_only:
        for v in variants:
            compile_only(**v)
        return
    from triton.testing import do_bench, do_bench_cudagraph

    from autossd.ops.ssd import chunk
    from autossd.render import load
    from autossd.space import default_config
    from autossd.testing import make_inputs, rel_err
    from autossd.tuner.shapes import parse_shape

    def times(fn):
        return (do_bench(fn, warmup=10, rep=100, return_mode="median"),
                do_bench_cudagraph(fn, rep=100, return_mode="median"))

    rows = []
    for rnd in range(a.rounds):
        for dtype in ("fp16", "bf16"):
            for shape in a.shapes.split(";"):
                prob = parse_shape(shape, dtype).replace(return_final_states=True)
                cfg = default_config("sm90", prob)
                assert cfg.launches == 5 and cfg.chunk_size == 256 and cfg.state_dtype == dtype
                t = make_inputs(prob, "cuda", seed=7)
                tensors = {k: t.get(k) for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                                                 "initial_states", "seq_idx")}
                mod = load(cfg, "cuda")
                buf = chunk.allocate(prob, cfg, "cuda")
                launches = chunk.plan(prob, cfg, tensors, buf)
                chunk.run(launches, mod)        # fills dA, dt, the entering states and the final states
                torch.cuda.synchronize()
                st_ref, fin_ref = buf.states.clone(), buf.final.clone()
                two = [ln for ln in launches if ln.stage in ("chunk_state", "state_passing")]
                assert len(two) == 2, [ln.stage for ln in launches]
                ks = [(getattr(mod, ln.kernel), ln) for ln in two]

                def tl_two():
                    for k, ln in ks:
                        k[ln.grid](**ln.args, **ln.constexprs, **ln.options)
                ms_tl, g_tl = times(tl_two)
                row = dict(round=rnd + 1, shape=shape, dtype=dtype, tl_ms=ms_tl, tl_graph_ms=g_tl, variants=[])
                for v in variants:
                    st = torch.full_like(buf.states, float("nan"))   # poisoned: unwritten shows
                    fin = torch.full_like(buf.final, float("nan"))
                    fn = launcher(tensors["x"], tensors["B"], st, buf.dA, buf.dt, fin, **v)
                    fn()
                    torch.cuda.synchronize()
                    res = dict(knobs=v, states_rel_err=rel_err(st, st_ref.double()),
                               final_rel_err=rel_err(fin, fin_ref.double()),
                               nan=bool(torch.isnan(st).any() or torch.isnan(fin).any()))
                    if a.debug:
                        s64, f64 = reference(tensors["x"], tensors["B"], buf.dA, buf.dt, prob.nheads // prob.ngroups)
                        res["chunks_rel_err"] = [rel_err(st[:, c], s64[:, c]) for c in range(min(6, st.shape[1]))]
                        res["tl_chunks_rel_err"] = [rel_err(st_ref[:, c], s64[:, c]) for c in range(min(6, st.shape[1]))]
                        res["final_vs_f64"], res["tl_final_vs_f64"] = rel_err(fin, f64), rel_err(fin_ref, f64)
                    res["ms"], res["graph_ms"] = times(fn)
                    row["variants"].append(res)
                rows.append(row)
                print(json.dumps(row), flush=True)
                del buf, t, tensors
                torch.cuda.empty_cache()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "probe_gluon_walk.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
