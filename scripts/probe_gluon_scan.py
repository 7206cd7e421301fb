"""Probe: Gluon chunk scans, v5 (BENCHMARKS §91), v6 (§92), v7 (§122), v8 (§123) and v9 (§125).
v6 ships as the `scan_gluon` knob (templates/ssd_fwd/chunk_scan_gluon.jinja, §93); this script
keeps all of them for experiments. Needs an sm90 GPU to run (Gluon has no interpreter);
`--compile-only` cross-compiles.

v7-v9 run one program per (chunk, head, headdim tile), walking the chunk's row tiles in order,
with their operands streamed through one ring in the order of use (`_issue7` for v7 and v8, `_issue9`,
each item refilled RS items ahead). v7 keeps the state tile and every x block resident (72 KB,
3 CTAs per SM, a third fewer L2 reads than v6); v8 is v7 with 128-row tiles in two warpgroups;
v9 streams v6's operand pairs through v6's 48 KB ring. None beat v6 by more than 1-3% (§122-§125).

Same grid and program as the tl kernel (one program per (64-row tile, head, headdim tile), chunk,
batch), but every MMA operand arrives by TMA. v5: C and the state tile at the program's start,
the CB and x blocks in a ring of two slots (64 KB, 3 CTAs per SM). v6: one ring of three 16 KB
stages that holds C and the state tile first, then the blocks (48 KB, 4 CTAs per SM). The CB
tiles are read from shared memory into registers, take their decay there and feed the wgmma as
its register operand; x and the state tile feed it from shared memory; dA/dt are plain loads.
The epilogue's D·x reads x from the diagonal block's slot.

Scope: full chunks of 256, headdim a multiple of 64, dstate 128, 16-bit inputs and states, no
seq_idx, no z. v5's ASYNC=True overlaps block k's MMA with block k+1's weights; v6's PREFETCH
loads the next block's dA/dt one block ahead. The harness runs autossd's five launches (which
fill CB, the states, dA and dt), then each variant on the same buffers into a poisoned y,
compares y with the tl kernel's and times every chunk scan eagerly and by graph replay.

    python scripts/probe_gluon_scan.py [--compile-only [--maxnreg R]] [--variants JSON] [--out DIR]
        [--rounds N] [--shapes 'a;b']
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                 warpgroup_mma_wait)

ACC = ttgl.constexpr(ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
A_OP = ttgl.constexpr(ttgl.DotOperandLayout(0, ACC.value, 2))
ROW = ttgl.constexpr(ttgl.SliceLayout(1, ACC.value))
COL = ttgl.constexpr(ttgl.SliceLayout(0, ACC.value))
LOG2E = ttgl.constexpr(1.4426950408889634)
CHUNK = ttgl.constexpr(256)


@gluon.jit
def _weights(cb_s, bars, slot, k, pid_m, dA_k, dt_k, dA_r, dA_m, rows, cols, dtype: ttgl.constexpr):
    # block k's A operand: CB with its decay, in the wgmma's register-operand layout
    mbarrier.wait(bars.index(1 + slot), (k // 2) & 1)
    cb = cb_s.index(slot).load(ACC).to(ttgl.float32)
    if k < pid_m:
        w = cb * (ttgl.exp2((dA_r - dA_k) * LOG2E) * dt_k)[None, :]
    else:
        keep = rows[:, None] >= cols[None, :]
        w = ttgl.where(keep, cb * ttgl.exp2((dA_m * LOG2E)[:, None] - (dA_k * LOG2E)[None, :]), 0.0)
        w = w * dt_k[None, :]
    return ttgl.convert_layout(w.to(dtype), A_OP)


@gluon.jit
def _refill(cb_desc, x_desc, cb_s, x_s, bars, slot, k, cb_row, t0, col_x):
    # block k into the slot (every warp is done reading it, and its MMA is done)
    ttgl.thread_barrier()
    mbarrier.expect(bars.index(1 + slot), 2 * 64 * 64 * 2)
    tma.async_copy_global_to_shared(cb_desc, [cb_row, k * 64], bars.index(1 + slot), cb_s.index(slot))
    tma.async_copy_global_to_shared(x_desc, [t0 + k * 64, col_x], bars.index(1 + slot), x_s.index(slot))


@gluon.jit
def scan_v5(C_desc, st_desc, cb_desc, x_desc, dA_ptr, dt_ptr, y_ptr, D_ptr,
            L, H, P, G, heads_per_group, s_y_l, s_y_h, s_dt_b, s_dt_h, s_dt_c,
            N: ttgl.constexpr, HAS_D: ttgl.constexpr, ASYNC: ttgl.constexpr):
    dtype: ttgl.constexpr = C_desc.dtype
    T: ttgl.constexpr = CHUNK // 64
    npn = P // 64
    pid0 = ttgl.program_id(0)
    c = ttgl.program_id(1)
    b = ttgl.program_id(2)
    per_head = T * npn
    h = pid0 // per_head
    r = pid0 % per_head
    pid_m = r // npn
    pid_n = r % npn
    g = h // heads_per_group
    NC = L // CHUNK
    t0 = b * L + c * CHUNK                      # row of the chunk's first token in the 2-D views

    c_s = ttgl.allocate_shared_memory(dtype, [64, N], C_desc.layout)
    s_s = ttgl.allocate_shared_memory(dtype, [64, N], st_desc.layout)
    cb_s = ttgl.allocate_shared_memory(dtype, [2, 64, 64], cb_desc.layout)
    x_s = ttgl.allocate_shared_memory(dtype, [2, 64, 64], x_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(4):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    # everything this program needs, issued at once: C rows x dstate, the state tile and the
    # first two (CB, x) blocks
    mbarrier.expect(bars.index(0), 2 * 64 * N * 2)
    tma.async_copy_global_to_shared(C_desc, [t0 + pid_m * 64, g * N], bars.index(0), c_s)
    tma.async_copy_global_to_shared(st_desc, [((b * NC + c) * H + h) * P + pid_n * 64, 0], bars.index(0), s_s)
    cb_row = ((b * NC + c) * G + g) * CHUNK + pid_m * 64
    for k in ttgl.static_range(2):
        if k <= pid_m:
            mbarrier.expect(bars.index(1 + k), 2 * 64 * 64 * 2)
            tma.async_copy_global_to_shared(cb_desc, [cb_row, k * 64], bars.index(1 + k), cb_s.index(k))
            tma.async_copy_global_to_shared(x_desc, [t0 + k * 64, h * P + pid_n * 64], bars.index(1 + k),
                                            x_s.index(k))

    rows = ttgl.arange(0, 64, layout=ROW)
    cols = ttgl.arange(0, 64, layout=COL)
    # dA/dt (fp32, L2-resident): the row tile's, dA_r, and block 0's; each block's are loaded
    # one block ahead, so no step waits on a global load
    dA_base = dA_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    dt_base = dt_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    dA_m = ttgl.load(dA_base + pid_m * 64 + rows)
    dA_r = ttgl.load(dA_base + ttgl.maximum(pid_m * 64 - 1, 0))
    dA_r = ttgl.where(pid_m > 0, dA_r, 0.0)
    nA = ttgl.load(dA_base + cols)
    nT = ttgl.load(dt_base + cols)
    mbarrier.wait(bars.index(0), 0)
    acc = warpgroup_mma(c_s, s_s.permute((1, 0)), ttgl.zeros([64, 64], ttgl.float32, ACC), use_acc=False)
    acc = acc * ttgl.exp(dA_r)
    if ASYNC:
        # block k's MMA runs while block k+1's weights are computed; one MMA in flight at a time
        dA_k = nA
        dt_k = nT
        kn = ttgl.minimum(1, pid_m) * 64
        nA = ttgl.load(dA_base + kn + cols)
        nT = ttgl.load(dt_base + kn + cols)
        w = _weights(cb_s, bars, 0, 0, pid_m, dA_k, dt_k, dA_r, dA_m, rows, cols, dtype)
        for k in range(0, pid_m + 1):
            slot = k % 2
            if k == pid_m:
                acc = acc * ttgl.exp2((dA_m - dA_r) * LOG2E)[:, None]
            w_cur = w
            acc = warpgroup_mma(w_cur, x_s.index(slot), acc, is_async=True)
            if k < pid_m:
                dA_k = nA
                dt_k = nT
                kn = ttgl.minimum(k + 2, pid_m) * 64
                nA = ttgl.load(dA_base + kn + cols)
                nT = ttgl.load(dt_base + kn + cols)
                w = _weights(cb_s, bars, (k + 1) % 2, k + 1, pid_m, dA_k, dt_k, dA_r, dA_m, rows, cols, dtype)
            acc, w_cur = warpgroup_mma_wait(0, deps=[acc, w_cur])   # the MMA reads w_cur's registers until done
            if k + 2 <= pid_m:
                _refill(cb_desc, x_desc, cb_s, x_s, bars, slot, k + 2, cb_row, t0, h * P + pid_n * 64)
    else:
        for k in range(0, pid_m + 1):
            slot = k % 2
            dA_k = nA
            dt_k = nT
            kn = ttgl.minimum(k + 1, pid_m) * 64
            nA = ttgl.load(dA_base + kn + cols)
            nT = ttgl.load(dt_base + kn + cols)
            if k == pid_m:  # the diagonal: the accumulator takes the row factor first
                acc = acc * ttgl.exp2((dA_m - dA_r) * LOG2E)[:, None]
            w = _weights(cb_s, bars, slot, k, pid_m, dA_k, dt_k, dA_r, dA_m, rows, cols, dtype)
            acc = warpgroup_mma(w, x_s.index(slot), acc)
            if k + 2 <= pid_m:
                _refill(cb_desc, x_desc, cb_s, x_s, bars, slot, k + 2, cb_row, t0, h * P + pid_n * 64)
    if HAS_D:              # x's rows of this tile are the diagonal block's B tile, still in shared memory
        xm = x_s.index(pid_m % 2).load(ACC).to(ttgl.float32)
        acc += xm * ttgl.load(D_ptr + h)
    tok = (t0 + pid_m * 64 + rows).to(ttgl.int64)
    ttgl.store(y_ptr + tok[:, None] * s_y_l + h * s_y_h + (pid_n * 64 + cols)[None, :], acc.to(dtype))
    for i in ttgl.static_range(4):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _refill6(cb_desc, x_desc, ring, bars, stage, k, cb_row, t0, col_x):
    # block k's (CB, x) tiles into ring stage `stage` (tiles 2*stage, 2*stage + 1)
    mbarrier.expect(bars.index(stage), 2 * 64 * 64 * 2)
    tma.async_copy_global_to_shared(cb_desc, [cb_row, k * 64], bars.index(stage), ring.index(2 * stage))
    tma.async_copy_global_to_shared(x_desc, [t0 + k * 64, col_x], bars.index(stage), ring.index(2 * stage + 1))


@gluon.jit
def scan_v6(C_desc, st_desc, cb_desc, x_desc, dA_ptr, dt_ptr, y_ptr, D_ptr,
            L, H, P, G, heads_per_group, s_y_l, s_y_h, s_dt_b, s_dt_h, s_dt_c,
            N: ttgl.constexpr, HAS_D: ttgl.constexpr, PREFETCH: ttgl.constexpr):
    # v5 fitted to 4 CTAs per SM: one ring of three 16 KB stages (48 KB) holds C and the state
    # tile first (stages 0 and 1, dstate in two 64-wide halves) and block 0 (stage 2); once the
    # state MMA is done, stages 0 and 1 take blocks 1 and 2. Block k lives in stage (k + 2) % 3.
    # The diagonal block is peeled off the loop; the blocks before it take one column factor
    # exp(dA_r - dA_k) * dt_k.
    ttgl.static_assert(N == 128)
    dtype: ttgl.constexpr = C_desc.dtype
    T: ttgl.constexpr = CHUNK // 64
    npn = P // 64
    pid0 = ttgl.program_id(0)
    c = ttgl.program_id(1)
    b = ttgl.program_id(2)
    per_head = T * npn
    h = pid0 // per_head
    r = pid0 % per_head
    pid_m = r // npn
    pid_n = r % npn
    g = h // heads_per_group
    NC = L // CHUNK
    t0 = b * L + c * CHUNK
    col_x = h * P + pid_n * 64
    cb_row = ((b * NC + c) * G + g) * CHUNK + pid_m * 64

    ring = ttgl.allocate_shared_memory(dtype, [6, 64, 64], cb_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(3):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(bars.index(0), 2 * 64 * 64 * 2)
    tma.async_copy_global_to_shared(C_desc, [t0 + pid_m * 64, g * N], bars.index(0), ring.index(0))
    tma.async_copy_global_to_shared(C_desc, [t0 + pid_m * 64, g * N + 64], bars.index(0), ring.index(1))
    st_row = ((b * NC + c) * H + h) * P + pid_n * 64
    mbarrier.expect(bars.index(1), 2 * 64 * 64 * 2)
    tma.async_copy_global_to_shared(st_desc, [st_row, 0], bars.index(1), ring.index(2))
    tma.async_copy_global_to_shared(st_desc, [st_row, 64], bars.index(1), ring.index(3))
    _refill6(cb_desc, x_desc, ring, bars, 2, 0, cb_row, t0, col_x)

    rows = ttgl.arange(0, 64, layout=ROW)
    cols = ttgl.arange(0, 64, layout=COL)
    dA_base = dA_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    dt_base = dt_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    dA_m = ttgl.load(dA_base + pid_m * 64 + rows)
    dA_r = ttgl.load(dA_base + ttgl.maximum(pid_m * 64 - 1, 0))
    dA_r = ttgl.where(pid_m > 0, dA_r, 0.0)
    if PREFETCH:
        nA = ttgl.load(dA_base + cols)
        nT = ttgl.load(dt_base + cols)
    mbarrier.wait(bars.index(0), 0)
    mbarrier.wait(bars.index(1), 0)
    acc = warpgroup_mma(ring.index(0), ring.index(2).permute((1, 0)), ttgl.zeros([64, 64], ttgl.float32, ACC),
                        use_acc=False)
    acc = warpgroup_mma(ring.index(1), ring.index(3).permute((1, 0)), acc)
    ttgl.thread_barrier()              # every warp is done with C and the state tile
    if pid_m >= 1:
        _refill6(cb_desc, x_desc, ring, bars, 0, 1, cb_row, t0, col_x)
    if pid_m >= 2:
        _refill6(cb_desc, x_desc, ring, bars, 1, 2, cb_row, t0, col_x)
    acc = acc * ttgl.exp(dA_r)

    for k in range(0, pid_m):
        stage = (k + 2) % 3
        if PREFETCH:
            f = ttgl.exp2((dA_r - nA) * LOG2E) * nT
            nA = ttgl.load(dA_base + (k + 1) * 64 + cols)
            nT = ttgl.load(dt_base + (k + 1) * 64 + cols)
        else:
            f = ttgl.exp2((dA_r - ttgl.load(dA_base + k * 64 + cols)) * LOG2E) * ttgl.load(dt_base + k * 64 + cols)
        mbarrier.wait(bars.index(stage), ((k + 2) // 3) & 1)
        cb = ring.index(2 * stage).load(ACC).to(ttgl.float32)
        w = ttgl.convert_layout((cb * f[None, :]).to(dtype), A_OP)
        acc = warpgroup_mma(w, ring.index(2 * stage + 1), acc)
        if k + 3 <= pid_m:
            ttgl.thread_barrier()
            _refill6(cb_desc, x_desc, ring, bars, stage, k + 3, cb_row, t0, col_x)

    # the diagonal block: the accumulator takes the row factor first
    stage = (pid_m + 2) % 3
    acc = acc * ttgl.exp2((dA_m - dA_r) * LOG2E)[:, None]
    if PREFETCH:
        dA_k = nA
        dt_k = nT
    else:
        dA_k = ttgl.load(dA_base + pid_m * 64 + cols)
        dt_k = ttgl.load(dt_base + pid_m * 64 + cols)
    mbarrier.wait(bars.index(stage), ((pid_m + 2) // 3) & 1)
    cb = ring.index(2 * stage).load(ACC).to(ttgl.float32)
    keep = rows[:, None] >= cols[None, :]
    w = ttgl.where(keep, cb * ttgl.exp2((dA_m * LOG2E)[:, None] - (dA_k * LOG2E)[None, :]), 0.0) * dt_k[None, :]
    acc = warpgroup_mma(ttgl.convert_layout(w.to(dtype), A_OP), ring.index(2 * stage + 1), acc)
    if HAS_D:
        xm = ring.index(2 * stage + 1).load(ACC).to(ttgl.float32)
        acc += xm * ttgl.load(D_ptr + h)
    tok = (t0 + pid_m * 64 + rows).to(ttgl.int64)
    ttgl.store(y_ptr + tok[:, None] * s_y_l + h * s_y_h + (pid_n * 64 + cols)[None, :], acc.to(dtype))
    for i in ttgl.static_range(3):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _chunk_program(L, H, P, G, heads_per_group, N: ttgl.constexpr):
    # v7-v9's program: (headdim tile, head) on axis 0, chunk, batch; its coordinates in the
    # descriptors' 2-D views (x, C, CB, the states) and its chunk's length
    npn = P // 64
    pid0 = ttgl.program_id(0)
    c = ttgl.program_id(1)
    b = ttgl.program_id(2)
    h = pid0 // npn
    pid_n = pid0 % npn
    g = h // heads_per_group
    NC = L // CHUNK
    row0 = b * L + c * CHUNK
    cb_row0 = ((b * NC + c) * G + g) * CHUNK
    st_row = ((b * NC + c) * H + h) * P + pid_n * 64
    return pid0, c, b, h, pid_n, row0, h * P + pid_n * 64, g * N, cb_row0, st_row, ttgl.minimum(CHUNK, L - c * CHUNK)


@gluon.jit
def _advance(nm, nj, per_tile):
    # the item after (row tile nm, item nj), where row tile nm has per_tile items
    nj += 1
    if nj >= per_tile:
        nm += 1
        nj = 0
    return nm, nj


@gluon.jit
def _issue7(C_desc, cb_desc, ring, bars, j, nm, nj, M, row0, col_c, cb_row0,
            RS: ttgl.constexpr, NH: ttgl.constexpr, ROWS: ttgl.constexpr = 64):
    # item (nm, nj) of the program's sequence into ring stage j % RS: row tile nm's C halves
    # (nj < NH), then its CB tiles (ROWS x 64: blocks nj - NH = 0 .. (nm + 1) ROWS / 64 - 1);
    # nothing past the last row tile. v7: 64-row tiles; v8: 128
    if nm < M:
        s = j % RS
        mbarrier.expect(bars.index(s), ROWS * 64 * 2)
        if nj < NH:
            tma.async_copy_global_to_shared(C_desc, [row0 + nm * ROWS, col_c + nj * 64], bars.index(s), ring.index(s))
        else:
            tma.async_copy_global_to_shared(cb_desc, [cb_row0 + nm * ROWS, (nj - NH) * 64], bars.index(s),
                                            ring.index(s))


@gluon.jit
def _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M, row0, col_c, cb_row0, RS: ttgl.constexpr, NH: ttgl.constexpr,
           ROWS: ttgl.constexpr = 64):
    # every warp is done with item j's stage: refill it with item j + RS, the generator's next
    ttgl.thread_barrier()
    _issue7(C_desc, cb_desc, ring, bars, j + RS, nm, nj, M, row0, col_c, cb_row0, RS, NH, ROWS)
    return _advance(nm, nj, NH + (ROWS // 64) * (nm + 1))


@gluon.jit
def scan_v7(C_desc, st_desc, cb_desc, x_desc, dA_ptr, dt_ptr, y_ptr, D_ptr,
            L, H, P, G, heads_per_group, s_y_l, s_y_h, s_dt_b, s_dt_h, s_dt_c,
            N: ttgl.constexpr, HAS_D: ttgl.constexpr, RS: ttgl.constexpr = 3, XSCALE: ttgl.constexpr = 0):
    # One program per (headdim tile, head, chunk, batch) walks the chunk's 64-row tiles in
    # order (v6: one program per row tile). The kernel is bound by L2 -> SM reads (§121: 12 GB of
    # TMA reads at 2.7b 1x131072 against 3.5 GB of DRAM traffic): v6 reads the state tile once per
    # row tile, and x block k once per row tile from k on. Here the state tile and every x block
    # stay in shared memory for the whole chunk (each read once); C's halves and the CB tiles
    # stream through a ring of RS 64 x 64 stages in the order they are used, each refilled with
    # the item RS ahead once every warp is done with it. 72 KB at RS = 3: 3 CTAs per SM.
    # XSCALE = 1 (v10, §126): no register work on CB before the diagonal. A block k < m's weight
    # exp(dA_r - dA_s) dt_s is exp(dA_r - dA_e) * exp(dA_e - dA_s) dt_s with e = k's last token: the
    # second factor scales x block k's rows once, in shared memory, after row tile k has used it
    # raw; the first is a scalar per block, taken by the accumulator as a running ratio before
    # each block (exp(dA_e(k) - dA_e(k-1)) <= 1; the last one leaves exp(dA_r) on the C.S term).
    # Those blocks' wgmmas then read both operands from shared memory: CB as stored, x scaled.
    # XSCALE = 2 (§128): as 1, with every dA/dt load issued a row tile (or a block) before its
    # use: §127 found v10's chain waiting on them (Long Scoreboard 2.7 cycles per instruction).
    ttgl.static_assert(N == 64 or N == 128)
    NH: ttgl.constexpr = N // 64
    dtype: ttgl.constexpr = C_desc.dtype
    T: ttgl.constexpr = CHUNK // 64
    pid0, c, b, h, pid_n, row0, col_x, col_c, cb_row0, st_row, clen = _chunk_program(L, H, P, G, heads_per_group, N)
    M = (clen + 63) // 64

    ring = ttgl.allocate_shared_memory(dtype, [RS, 64, 64], cb_desc.layout)
    xs = ttgl.allocate_shared_memory(dtype, [T, 64, 64], x_desc.layout)
    sts = ttgl.allocate_shared_memory(dtype, [NH, 64, 64], st_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [RS, 1], mbarrier.MBarrierLayout())
    xbars = ttgl.allocate_shared_memory(ttgl.int64, [T + 1, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(RS):
        mbarrier.init(bars.index(i), count=1)
    for i in ttgl.static_range(T + 1):
        mbarrier.init(xbars.index(i), count=1)
    fence_async_shared()
    # the state tile (barrier T), then the ring's first RS items, then the x blocks
    mbarrier.expect(xbars.index(T), NH * 64 * 64 * 2)
    for j in ttgl.static_range(NH):
        tma.async_copy_global_to_shared(st_desc, [st_row, j * 64], xbars.index(T), sts.index(j))
    zero = pid0 * 0   # (loop-carried counters start as tensors, not constexprs)
    nm = zero    # the next item to issue: row tile nm, item nj
    nj = zero
    for i in ttgl.static_range(RS):
        _issue7(C_desc, cb_desc, ring, bars, i, nm, nj, M, row0, col_c, cb_row0, RS, NH)
        nm, nj = _advance(nm, nj, NH + nm + 1)
    for i in ttgl.static_range(T):
        if i < M:
            mbarrier.expect(xbars.index(i), 64 * 64 * 2)
            tma.async_copy_global_to_shared(x_desc, [row0 + i * 64, col_x], xbars.index(i), xs.index(i))

    rows = ttgl.arange(0, 64, layout=ROW)
    cols = ttgl.arange(0, 64, layout=COL)
    dA_base = dA_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    dt_base = dt_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    keep = rows[:, None] >= cols[None, :]
    if HAS_D:
        Dh = ttgl.load(D_ptr + h)
    j = zero     # items consumed
    if XSCALE == 2:   # row tile 0's dA/dt vectors and block 0's last dA; later ones a step ahead
        p_dA = ttgl.load(dA_base + rows)
        p_dt = ttgl.load(dt_base + rows)
        p_nA = ttgl.load(dA_base + cols)
        p_nT = ttgl.load(dt_base + cols)
        e0 = ttgl.load(dA_base + 63)
    mbarrier.wait(xbars.index(T), 0)
    for m in range(M):
        if XSCALE == 2:   # this row tile's, loaded a row tile ago; the next one's now
            dA_m = p_dA
            dt_m = p_dt
            nA = p_nA
            nT = p_nT
            mn = ttgl.minimum(m + 1, M - 1)
            p_dA = ttgl.load(dA_base + mn * 64 + rows)
            p_dt = ttgl.load(dt_base + mn * 64 + rows)
            p_nA = ttgl.load(dA_base + mn * 64 + cols)
            p_nT = ttgl.load(dt_base + mn * 64 + cols)
            e_m = ttgl.load(dA_base + m * 64 + 63)   # for x block m's scaling, after the diagonal
        else:
            dA_m = ttgl.load(dA_base + m * 64 + rows)
            dA_r = ttgl.load(dA_base + ttgl.maximum(m * 64 - 1, 0))
            dA_r = ttgl.where(m > 0, dA_r, 0.0)
            nA = ttgl.load(dA_base + cols)
            nT = ttgl.load(dt_base + cols)
        acc = ttgl.zeros([64, 64], ttgl.float32, ACC)
        # exp(dA_t) C_t S_prev: C's halves from the ring, the state tile resident
        for hh in ttgl.static_range(NH):
            s = j % RS
            mbarrier.wait(bars.index(s), (j // RS) & 1)
            acc = warpgroup_mma(ring.index(s), sts.index(hh).permute((1, 0)), acc)
            nm, nj = _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M, row0, col_c, cb_row0, RS, NH)
            j += 1
        if XSCALE:
            if XSCALE == 2:
                prev = e0 * 0.0
                e_n = e0
            else:
                prev = dA_r * 0.0
            for k in range(0, m):
                if XSCALE == 2:   # block k's last dA, loaded a block ago
                    dA_e = e_n
                    e_n = ttgl.load(dA_base + (k + 1) * 64 + 63)
                else:
                    dA_e = ttgl.load(dA_base + k * 64 + 63)
                acc = acc * ttgl.exp(dA_e - prev)
                prev = dA_e
                s = j % RS
                mbarrier.wait(bars.index(s), (j // RS) & 1)
                mbarrier.wait(xbars.index(k), 0)
                acc = warpgroup_mma(ring.index(s), xs.index(k), acc)
                nm, nj = _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M, row0, col_c, cb_row0, RS, NH)
                j += 1
            if XSCALE == 2:
                dA_r = prev   # the last token before this row tile (0 for the first)
            else:
                nA = ttgl.load(dA_base + m * 64 + cols)   # the diagonal block's
                nT = ttgl.load(dt_base + m * 64 + cols)
        else:   # blocks before the diagonal, as v6
            acc = acc * ttgl.exp(dA_r)
            for k in range(0, m):
                f = ttgl.exp2((dA_r - nA) * LOG2E) * nT
                nA = ttgl.load(dA_base + (k + 1) * 64 + cols)
                nT = ttgl.load(dt_base + (k + 1) * 64 + cols)
                s = j % RS
                mbarrier.wait(bars.index(s), (j // RS) & 1)
                cb = ring.index(s).load(ACC).to(ttgl.float32)
                w = ttgl.convert_layout((cb * f[None, :]).to(dtype), A_OP)
                mbarrier.wait(xbars.index(k), 0)
                acc = warpgroup_mma(w, xs.index(k), acc)
                nm, nj = _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M, row0, col_c, cb_row0, RS, NH)
                j += 1
        # the diagonal block
        acc = acc * ttgl.exp2((dA_m - dA_r) * LOG2E)[:, None]
        s = j % RS
        mbarrier.wait(bars.index(s), (j // RS) & 1)
        cb = ring.index(s).load(ACC).to(ttgl.float32)
        w = ttgl.where(keep, cb * ttgl.exp2((dA_m * LOG2E)[:, None] - (nA * LOG2E)[None, :]) * nT[None, :], 0.0)
        mbarrier.wait(xbars.index(m), 0)
        acc = warpgroup_mma(ttgl.convert_layout(w.to(dtype), A_OP), xs.index(m), acc)
        nm, nj = _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M, row0, col_c, cb_row0, RS, NH)
        j += 1
        if HAS_D or XSCALE:
            xm = xs.index(m).load(ACC).to(ttgl.float32)
        if HAS_D:
            acc += xm * Dh
        if XSCALE:
            if m + 1 < M:   # later row tiles read this block scaled by exp(dA_e - dA_s) dt_s
                if XSCALE == 2:
                    wrow = ttgl.exp2((e_m - dA_m) * LOG2E) * dt_m
                else:
                    dA_e = ttgl.load(dA_base + m * 64 + 63)
                    wrow = ttgl.exp2((dA_e - dA_m) * LOG2E) * ttgl.load(dt_base + m * 64 + rows)
                xs.index(m).store((xm * wrow[:, None]).to(dtype))
                fence_async_shared()
                ttgl.thread_barrier()
        tok = (row0 + m * 64 + rows).to(ttgl.int64)
        ttgl.store(y_ptr + tok[:, None] * s_y_l + h * s_y_h + (pid_n * 64 + cols)[None, :], acc.to(dtype))
    for i in ttgl.static_range(RS):
        mbarrier.invalidate(bars.index(i))
    for i in ttgl.static_range(T + 1):
        mbarrier.invalidate(xbars.index(i))


@gluon.jit
def _issue9(C_desc, st_desc, cb_desc, x_desc, ring, bars, j, nm, nj, M, row0, col_c, col_x, cb_row0, st_row,
            RS: ttgl.constexpr, NH: ttgl.constexpr):
    # pair item (nm, nj) into ring stage j % RS (tiles 2 s, 2 s + 1): row tile nm's (C half,
    # state half) pairs for nj < NH, then its (CB, x) block pairs k = nj - NH = 0 .. nm
    if nm < M:
        s = j % RS
        mbarrier.expect(bars.index(s), 2 * 64 * 64 * 2)
        if nj < NH:
            tma.async_copy_global_to_shared(C_desc, [row0 + nm * 64, col_c + nj * 64], bars.index(s),
                                            ring.index(2 * s))
            tma.async_copy_global_to_shared(st_desc, [st_row, nj * 64], bars.index(s), ring.index(2 * s + 1))
        else:
            tma.async_copy_global_to_shared(cb_desc, [cb_row0 + nm * 64, (nj - NH) * 64], bars.index(s),
                                            ring.index(2 * s))
            tma.async_copy_global_to_shared(x_desc, [row0 + (nj - NH) * 64, col_x], bars.index(s),
                                            ring.index(2 * s + 1))


@gluon.jit
def _next9(C_desc, st_desc, cb_desc, x_desc, ring, bars, j, nm, nj, M, row0, col_c, col_x, cb_row0, st_row,
           RS: ttgl.constexpr, NH: ttgl.constexpr):
    ttgl.thread_barrier()   # as _next7, for v9's pairs
    _issue9(C_desc, st_desc, cb_desc, x_desc, ring, bars, j + RS, nm, nj, M, row0, col_c, col_x, cb_row0, st_row,
            RS, NH)
    return _advance(nm, nj, NH + nm + 1)


@gluon.jit
def scan_v9(C_desc, st_desc, cb_desc, x_desc, dA_ptr, dt_ptr, y_ptr, D_ptr,
            L, H, P, G, heads_per_group, s_y_l, s_y_h, s_dt_b, s_dt_h, s_dt_c,
            N: ttgl.constexpr, HAS_D: ttgl.constexpr, RS: ttgl.constexpr = 3):
    # v6's data (each row tile reads C, the state tile and its blocks, 48 KB of ring: 4 CTAs per
    # SM), but one program walks the chunk's row tiles in order, as v7, with every operand pair
    # streaming through one ring in the order of use: the next row tile's C and state tile arrive
    # while this one's blocks run, and a program's prologue and exit drain (§121: ~7% of the
    # cycles) are paid once per chunk and head instead of once per row tile.
    ttgl.static_assert(N == 64 or N == 128)
    NH: ttgl.constexpr = N // 64
    dtype: ttgl.constexpr = C_desc.dtype
    pid0, c, b, h, pid_n, row0, col_x, col_c, cb_row0, st_row, clen = _chunk_program(L, H, P, G, heads_per_group, N)
    M = (clen + 63) // 64

    ring = ttgl.allocate_shared_memory(dtype, [2 * RS, 64, 64], cb_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [RS, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(RS):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    zero = pid0 * 0
    nm = zero
    nj = zero
    for i in ttgl.static_range(RS):
        _issue9(C_desc, st_desc, cb_desc, x_desc, ring, bars, i, nm, nj, M, row0, col_c, col_x, cb_row0, st_row,
                RS, NH)
        nm, nj = _advance(nm, nj, NH + nm + 1)

    rows = ttgl.arange(0, 64, layout=ROW)
    cols = ttgl.arange(0, 64, layout=COL)
    dA_base = dA_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    dt_base = dt_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    keep = rows[:, None] >= cols[None, :]
    if HAS_D:
        Dh = ttgl.load(D_ptr + h)
    j = zero
    for m in range(M):
        dA_m = ttgl.load(dA_base + m * 64 + rows)
        dA_r = ttgl.load(dA_base + ttgl.maximum(m * 64 - 1, 0))
        dA_r = ttgl.where(m > 0, dA_r, 0.0)
        nA = ttgl.load(dA_base + cols)
        nT = ttgl.load(dt_base + cols)
        acc = ttgl.zeros([64, 64], ttgl.float32, ACC)
        for hh in ttgl.static_range(NH):
            s = j % RS
            mbarrier.wait(bars.index(s), (j // RS) & 1)
            acc = warpgroup_mma(ring.index(2 * s), ring.index(2 * s + 1).permute((1, 0)), acc)
            nm, nj = _next9(C_desc, st_desc, cb_desc, x_desc, ring, bars, j, nm, nj, M, row0, col_c, col_x,
                              cb_row0, st_row, RS, NH)
            j += 1
        acc = acc * ttgl.exp(dA_r)
        for k in range(0, m):
            f = ttgl.exp2((dA_r - nA) * LOG2E) * nT
            nA = ttgl.load(dA_base + (k + 1) * 64 + cols)
            nT = ttgl.load(dt_base + (k + 1) * 64 + cols)
            s = j % RS
            mbarrier.wait(bars.index(s), (j // RS) & 1)
            cb = ring.index(2 * s).load(ACC).to(ttgl.float32)
            w = ttgl.convert_layout((cb * f[None, :]).to(dtype), A_OP)
            acc = warpgroup_mma(w, ring.index(2 * s + 1), acc)
            nm, nj = _next9(C_desc, st_desc, cb_desc, x_desc, ring, bars, j, nm, nj, M, row0, col_c, col_x,
                              cb_row0, st_row, RS, NH)
            j += 1
        acc = acc * ttgl.exp2((dA_m - dA_r) * LOG2E)[:, None]
        s = j % RS
        mbarrier.wait(bars.index(s), (j // RS) & 1)
        cb = ring.index(2 * s).load(ACC).to(ttgl.float32)
        w = ttgl.where(keep, cb * ttgl.exp2((dA_m * LOG2E)[:, None] - (nA * LOG2E)[None, :]) * nT[None, :], 0.0)
        acc = warpgroup_mma(ttgl.convert_layout(w.to(dtype), A_OP), ring.index(2 * s + 1), acc)
        if HAS_D:   # x's rows of this tile are the diagonal block's x tile, read before the refill
            acc += ring.index(2 * s + 1).load(ACC).to(ttgl.float32) * Dh
        nm, nj = _next9(C_desc, st_desc, cb_desc, x_desc, ring, bars, j, nm, nj, M, row0, col_c, col_x,
                          cb_row0, st_row, RS, NH)
        j += 1
        tok = (row0 + m * 64 + rows).to(ttgl.int64)
        ttgl.store(y_ptr + tok[:, None] * s_y_l + h * s_y_h + (pid_n * 64 + cols)[None, :], acc.to(dtype))
    for i in ttgl.static_range(RS):
        mbarrier.invalidate(bars.index(i))


ACC8 = ttgl.constexpr(ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, 64, 16]))
A_OP8 = ttgl.constexpr(ttgl.DotOperandLayout(0, ACC8.value, 2))
ROW8 = ttgl.constexpr(ttgl.SliceLayout(1, ACC8.value))
COL8 = ttgl.constexpr(ttgl.SliceLayout(0, ACC8.value))


@gluon.jit
def scan_v8(C_desc, st_desc, cb_desc, x_desc, dA_ptr, dt_ptr, y_ptr, D_ptr,
            L, H, P, G, heads_per_group, s_y_l, s_y_h, s_dt_b, s_dt_h, s_dt_c,
            N: ttgl.constexpr, HAS_D: ttgl.constexpr, RS: ttgl.constexpr = 3):
    # v7 with 128-row tiles in two warpgroups (8 warps; each warpgroup's wgmma takes 64 rows):
    # the state tile and the x blocks resident for the chunk, C's halves and the 128 x 64 CB
    # tiles through a ring of RS 16 KB stages. 96 KB at RS = 3: two CTAs of 8 warps
    # per SM, as many warps as v6's four CTAs of 4, and 208 KB of L2 reads per chunk and head
    # against v6's 288. The two blocks on a tile's diagonal take their decay per element; the
    # upper one's right half is masked to 0 (computed, not skipped). Full chunks only.
    ttgl.static_assert(N == 64 or N == 128)
    NH: ttgl.constexpr = N // 64
    dtype: ttgl.constexpr = C_desc.dtype
    T: ttgl.constexpr = CHUNK // 64
    M2: ttgl.constexpr = CHUNK // 128
    pid0, c, b, h, pid_n, row0, col_x, col_c, cb_row0, st_row, _ = _chunk_program(L, H, P, G, heads_per_group, N)

    ring = ttgl.allocate_shared_memory(dtype, [RS, 128, 64], cb_desc.layout)
    xs = ttgl.allocate_shared_memory(dtype, [T * 64, 64], x_desc.layout)   # block k: rows 64 k ...
    sts = ttgl.allocate_shared_memory(dtype, [NH, 64, 64], st_desc.layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [RS, 1], mbarrier.MBarrierLayout())
    xbars = ttgl.allocate_shared_memory(ttgl.int64, [T + 1, 1], mbarrier.MBarrierLayout())
    for i in ttgl.static_range(RS):
        mbarrier.init(bars.index(i), count=1)
    for i in ttgl.static_range(T + 1):
        mbarrier.init(xbars.index(i), count=1)
    fence_async_shared()
    mbarrier.expect(xbars.index(T), NH * 64 * 64 * 2)
    for i in ttgl.static_range(NH):
        tma.async_copy_global_to_shared(st_desc, [st_row, i * 64], xbars.index(T), sts.index(i))
    zero = pid0 * 0
    nm = zero
    nj = zero
    for i in ttgl.static_range(RS):
        _issue7(C_desc, cb_desc, ring, bars, i, nm, nj, M2, row0, col_c, cb_row0, RS, NH, 128)
        nm, nj = _advance(nm, nj, NH + 2 * nm + 2)
    for i in ttgl.static_range(T):
        mbarrier.expect(xbars.index(i), 64 * 64 * 2)
        tma.async_copy_global_to_shared(x_desc, [row0 + i * 64, col_x], xbars.index(i), xs.slice(i * 64, 64))

    rows = ttgl.arange(0, 128, layout=ROW8)
    cols = ttgl.arange(0, 64, layout=COL8)
    dA_base = dA_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    dt_base = dt_ptr + b.to(ttgl.int64) * s_dt_b + h * s_dt_h + c.to(ttgl.int64) * s_dt_c
    if HAS_D:
        Dh = ttgl.load(D_ptr + h)
    j = zero
    mbarrier.wait(xbars.index(T), 0)
    for m in ttgl.static_range(M2):   # (unrolled: the D term slices x's rows at a constant)
        dA_m = ttgl.load(dA_base + m * 128 + rows)
        dA_r = ttgl.load(dA_base + ttgl.maximum(m * 128 - 1, 0))
        dA_r = ttgl.where(m > 0, dA_r, 0.0)
        nA = ttgl.load(dA_base + cols)
        nT = ttgl.load(dt_base + cols)
        acc = ttgl.zeros([128, 64], ttgl.float32, ACC8)
        for hh in ttgl.static_range(NH):
            s = j % RS
            mbarrier.wait(bars.index(s), (j // RS) & 1)
            acc = warpgroup_mma(ring.index(s), sts.index(hh).permute((1, 0)), acc)
            nm, nj = _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M2, row0, col_c, cb_row0, RS, NH, 128)
            j += 1
        acc = acc * ttgl.exp(dA_r)
        for k in ttgl.static_range(2 * m):   # blocks wholly before the tile
            f = ttgl.exp2((dA_r - nA) * LOG2E) * nT
            nA = ttgl.load(dA_base + (k + 1) * 64 + cols)
            nT = ttgl.load(dt_base + (k + 1) * 64 + cols)
            s = j % RS
            mbarrier.wait(bars.index(s), (j // RS) & 1)
            cb = ring.index(s).load(ACC8).to(ttgl.float32)
            w = ttgl.convert_layout((cb * f[None, :]).to(dtype), A_OP8)
            mbarrier.wait(xbars.index(k), 0)
            acc = warpgroup_mma(w, xs.slice(k * 64, 64), acc)
            nm, nj = _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M2, row0, col_c, cb_row0, RS, NH, 128)
            j += 1
        acc = acc * ttgl.exp2((dA_m - dA_r) * LOG2E)[:, None]
        for d in ttgl.static_range(2):   # the two blocks on the diagonal: decay per element
            if d == 1:
                nA = ttgl.load(dA_base + (2 * m + d) * 64 + cols)
                nT = ttgl.load(dt_base + (2 * m + d) * 64 + cols)
            s = j % RS
            mbarrier.wait(bars.index(s), (j // RS) & 1)
            cb = ring.index(s).load(ACC8).to(ttgl.float32)
            keep = rows[:, None] >= (d * 64 + cols)[None, :]
            w = ttgl.where(keep, cb * ttgl.exp2((dA_m * LOG2E)[:, None] - (nA * LOG2E)[None, :]) * nT[None, :], 0.0)
            mbarrier.wait(xbars.index(2 * m + d), 0)
            acc = warpgroup_mma(ttgl.convert_layout(w.to(dtype), A_OP8), xs.slice((2 * m + d) * 64, 64), acc)
            nm, nj = _next7(C_desc, cb_desc, ring, bars, j, nm, nj, M2, row0, col_c, cb_row0, RS, NH, 128)
            j += 1
        if HAS_D:   # x's rows of this tile: blocks 2m and 2m + 1, read as one 128-row view
            xm = xs.slice(m * 128, 128).load(ACC8).to(ttgl.float32)
            acc += xm * Dh
        tok = (row0 + m * 128 + rows).to(ttgl.int64)
        ttgl.store(y_ptr + tok[:, None] * s_y_l + h * s_y_h + (pid_n * 64 + cols)[None, :], acc.to(dtype))
    for i in ttgl.static_range(RS):
        mbarrier.invalidate(bars.index(i))
    for i in ttgl.static_range(T + 1):
        mbarrier.invalidate(xbars.index(i))


def descriptors(x, C, cb, states, box_n=None, rows=64):
    """TMA descriptors of C, the states, CB and x; C's and the states' box is box_n wide in dstate
    (all of it for v5, 64 for v6-v8); C's and CB's box is `rows` tall (128 for v8)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GD
    b, l, h, p = x.shape
    g, n = C.shape[2], C.shape[3]
    nc, q = cb.shape[1], cb.shape[3]
    box_n = box_n or n
    gdt = {torch.float16: ttgl.float16, torch.bfloat16: ttgl.bfloat16}[x.dtype]
    lay64 = ttgl.NVMMASharedLayout.get_default_for([64, 64], gdt)
    layN = ttgl.NVMMASharedLayout.get_default_for([64, box_n], gdt)
    assert x.is_contiguous() and C.is_contiguous() and cb.is_contiguous() and states.is_contiguous()
    layR = ttgl.NVMMASharedLayout.get_default_for([rows, box_n], gdt)
    layRC = ttgl.NVMMASharedLayout.get_default_for([rows, 64], gdt)
    return (GD(C, [b * l, g * n], [g * n, 1], [rows, box_n], layR),
            GD(states, [b * nc * h * p, n], [n, 1], [64, box_n], layN),
            GD(cb, [b * nc * g * q, q], [q, 1], [rows, 64], layRC),
            GD(x, [b * l, h * p], [h * p, 1], [64, 64], lay64))


def launcher(version, x, C, cb, states, dA, dt, D, y, **knobs):
    """A no-argument launch of v5 or v6 on these buffers (descriptors built once, so a timing
    measures the GPU, not the host's descriptor work)."""
    b, l, h, p = x.shape
    g, n = C.shape[2], C.shape[3]
    nc = cb.shape[1]
    descs = descriptors(x, C, cb, states, 64 if version in ("v6", "v7", "v8", "v9") else None,
                        rows=128 if version == "v8" else 64)
    grid = ((1 if version in ("v7", "v8", "v9") else 4) * h * (p // 64), nc, b)   # v7-v9: a program per chunk and head
    assert D is None or D.dim() == 1, "probe: D per head only"
    kern = {"v5": scan_v5, "v6": scan_v6, "v7": scan_v7, "v8": scan_v8, "v9": scan_v9}[version]
    args = (*descs, dA, dt, y, D if D is not None else dA, l, h, p, g, h // g, y.stride(1), y.stride(2),
            dA.stride(0), dA.stride(1), dA.stride(2))
    kw = dict(N=n, HAS_D=D is not None, num_warps=8 if version == "v8" else 4, **knobs)
    return lambda: kern[grid](*args, **kw)


def compile_only(version: str = "v5", cap: int | None = None, **knobs):
    maxnreg = knobs.pop("maxnreg", cap)
    from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    from triton.backends.compiler import GPUTarget
    box = "64" if version in ("v6", "v7", "v8", "v9") else "128"
    r = 128 if version == "v8" else 64
    lN = ttgl.NVMMASharedLayout.get_default_for([64, int(box)], ttgl.float16)
    lR = ttgl.NVMMASharedLayout.get_default_for([r, int(box)], ttgl.float16)
    l64 = ttgl.NVMMASharedLayout.get_default_for([64, 64], ttgl.float16)
    lR64 = ttgl.NVMMASharedLayout.get_default_for([r, 64], ttgl.float16)
    sig = {"C_desc": f"tensordesc<fp16[{r},{box}],{lR}>", "st_desc": f"tensordesc<fp16[64,{box}],{lN}>",
           "cb_desc": f"tensordesc<fp16[{r},64],{lR64}>", "x_desc": f"tensordesc<fp16[64,64],{l64}>"}
    sig.update({"dA_ptr": "*fp32", "dt_ptr": "*fp32", "y_ptr": "*fp16", "D_ptr": "*fp32", "L": "i32", "H": "i32",
                "P": "i32", "G": "i32", "heads_per_group": "i32", "s_y_l": "i32", "s_y_h": "i32", "s_dt_b": "i32",
                "s_dt_h": "i32", "s_dt_c": "i32", "N": "constexpr", "HAS_D": "constexpr"})
    sig.update({name: "constexpr" for name in knobs})
    kern = {"v5": scan_v5, "v6": scan_v6, "v7": scan_v7, "v8": scan_v8, "v9": scan_v9}[version]
    k = triton.compile(ASTSource(kern, sig, {"N": 128, "HAS_D": True, **knobs}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8 if version == "v8" else 4, **({"maxnreg": maxnreg} if maxnreg else {})})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the checkout's autossd
    from autossd.compile import _nvidia_resources
    regs, spill = _nvidia_resources(k.asm["cubin"])
    print(f"{version} {knobs} sm90: {regs} registers, {spill} bytes spilled, {k.metadata.shared} bytes of shared memory, "
          f"cap {maxnreg}")
    return k


def main():
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--maxnreg", type=int, default=0, help="with --compile-only")
    ap.add_argument("--variants", default='[["v5", {"ASYNC": false}], ["v6", {"PREFETCH": true, "maxnreg": 128}], '
                    '["v6", {"PREFETCH": false}]]', help="JSON list of [version, constexpr knobs and maxnreg]")
    ap.add_argument("--out", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shapes", default="mamba2-2.7b:b=1,l=131072;mamba2-2.7b:b=4,l=16384;mamba2-2.7b:b=1,l=2048")
    a = ap.parse_args()
    variants = json.loads(a.variants)
    if a.compile_only:
        for version, knobs in variants:
            compile_only(version, a.maxnreg or None, **knobs)
        return
    import os
    from triton.testing import do_bench, do_bench_cudagraph
    from autossd.ops.ssd import chunk
    from autossd.render import load
    from autossd.space import default_config
    from autossd.testing import make_inputs, rel_err
    from autossd.tuner.shapes import parse_shape

    def times(fn):
        # eager (back-to-back launches) and by graph replay (no host time in it)
        return (do_bench(fn, warmup=10, rep=100, return_mode="median"),
                do_bench_cudagraph(fn, rep=100, return_mode="median"))

    rows = []
    for rnd in range(a.rounds):
        for dtype in ("fp16", "bf16"):
            for shape in a.shapes.split(";"):
                prob = parse_shape(shape, dtype)
                cfg = default_config("sm90", prob)
                assert cfg.launches == 5 and cfg.chunk_size == 256
                t = make_inputs(prob, "cuda", seed=7)
                tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states",
                                             "seq_idx")}
                mod = load(cfg, "cuda")
                buf = chunk.allocate(prob, cfg, "cuda")
                launches = chunk.plan(prob, cfg, tensors, buf)
                chunk.run(launches, mod)           # fills CB, the states, dA, dt and y
                torch.cuda.synchronize()
                y_tl = buf.y.clone()
                scan = [ln for ln in launches if ln.stage == "chunk_scan"][0]
                k_tl = getattr(mod, scan.kernel)
                ms_tl, g_tl = times(lambda: k_tl[scan.grid](**scan.args, **scan.constexprs, **scan.options))
                row = dict(round=rnd + 1, shape=shape, dtype=dtype, tl_ms=ms_tl, tl_graph_ms=g_tl, variants=[])
                for version, knobs in variants:
                    y = torch.full_like(buf.y, float("nan"))   # poisoned: an unwritten element shows
                    fn = launcher(version, tensors["x"], tensors["C"], buf.cb, buf.states, buf.dA, buf.dt,
                                  tensors["D"], y, **knobs)
                    fn()
                    torch.cuda.synchronize()
                    err, nan = rel_err(y, y_tl.double()), bool(torch.isnan(y).any())
                    ms, gms = times(fn)
                    row["variants"].append(dict(version=version, knobs=knobs, ms=ms, graph_ms=gms,
                                                y_rel_err_vs_tl=err, nan=nan))
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "probe_gluon_scan.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
