"""The SSD forward's inputs to the static model: the bytes, FLOPs, grid, tile and dependent chain
of each launch of a config (`stage_costs`), from the problem and the launch plan's tiling. How
they become a time is the op-independent part, `autossd.tuner.model` (its docstring describes
the model and its constants)."""
from __future__ import annotations

from ...problem import DTYPE_BYTES, Problem
from ...core.cost import SECTOR, StageCost
from ...core.cost import cdiv as _cdiv
from .fwd_knobs import Config
from .plan import chains as ssd_chains


def _causal_tiles(q: int, bm: int, bn: int) -> int:
    """Tiles of a QxQ lower-triangular matrix a (bm x bn) tiling launches work for."""
    return sum(1 for i in range(_cdiv(q, bm)) for j in range(_cdiv(q, bn))
               if j * bn <= (i + 1) * bm - 1)


def stage_costs(problem: Problem, config: Config) -> list[StageCost]:
    """Bytes and FLOPs of each stage (see the module docstring)."""
    b, l, h, p, n, g = (problem.batch, problem.seqlen, problem.nheads, problem.headdim,
                        problem.dstate, problem.ngroups)
    q = config.chunk_size
    nc = _cdiv(l, q)
    e = DTYPE_BYTES[problem.dtype]
    s = DTYPE_BYTES[config.state_dtype]
    f4 = 4
    ddA = 2 * b * h * nc * q * f4                         # dt' and dA, fp32
    x_bytes = b * l * h * p * e
    bc_bytes = b * l * g * n * e                          # one of B or C
    states = b * nc * h * p * n * s
    out = []

    # 1. cumsum: dt in (b, l, h) fp32, each program loads block_h heads x q tokens (strided by h)
    bh = config.cumsum_block_h
    grid = nc * _cdiv(h, bh) * b
    out.append(StageCost("cumsum", grid, b * l * h * f4 + ddA, 0.0, 0.0,
                         sector_eff=min(1.0, bh * f4 / SECTOR)))

    # 2. bmm: CB = C Bᵀ per (chunk, group), causal tiles only
    bm, bn, bk = config.bmm_block_m, config.bmm_block_n, config.bmm_block_k
    tiles = _causal_tiles(q, bm, bn)
    progs = tiles * nc * b * g
    reads = progs * (bm + bn) * n * e
    cb_bytes = progs * bm * bn * e
    out.append(StageCost("bmm", _cdiv(q, bm) * _cdiv(q, bn) * nc * b * g,
                         2 * bc_bytes + cb_bytes, max(0.0, reads - 2 * bc_bytes),
                         2.0 * progs * bm * bn * n, (bm, bn, bk), config.bmm_stages))

    # 3. chunk state: (p x n) per (chunk, head), tiles of x and B over the chunk's tokens
    bm, bn, bk = config.state_block_m, config.state_block_n, config.state_block_k
    tp, tn = _cdiv(p, bm), _cdiv(n, bn)
    progs = tp * tn * nc * b * h
    reads = progs * q * (bm + bn) * e + progs * q * 2 * f4
    unique_in = x_bytes + bc_bytes + ddA
    out.append(StageCost("chunk_state", progs, unique_in + states, max(0.0, reads - unique_in),
                         2.0 * progs * q * bm * bn, (bm, bn, bk), config.state_stages))

    # 4. state passing: read and rewrite every chunk state in place, chunk after chunk
    pb = config.pass_block
    progs = _cdiv(p * n, pb) * b * h
    final = b * h * p * n * f4 if problem.return_final_states else 0
    out.append(StageCost("state_passing", progs, 2 * states + b * h * nc * f4 + final, 0.0,
                         2.0 * states / s, chain=nc))

    # 5. chunk scan: y = causal(CB) (dt x) + C S exp(dA) + D x, tiles of (time, headdim)
    bm, bn, bk, bd = (config.scan_block_m, config.scan_block_n, config.scan_block_k,
                      config.scan_block_d)
    tm, tp = _cdiv(q, bm), _cdiv(p, bn)
    progs = tm * tp * nc * b * h
    k_tokens = sum(min(q, (i + 1) * bm) for i in range(tm))   # Σ over m tiles of the causal k range
    per_chunk_head = tp * (tm * bm * n * e                  # C rows
                           + tm * bn * n * s                # the passed state (headdim tile x n)
                           + k_tokens * bm * e              # CB rows, causal part
                           + k_tokens * bn * e              # x rows over the causal range
                           + k_tokens * 2 * f4)             # dt', dA
    reads = per_chunk_head * nc * b * h
    z_bytes = x_bytes if problem.has_z else 0
    unique_in = x_bytes + bc_bytes + b * nc * g * q * q * e // 2 + states + ddA + z_bytes
    flops = 2.0 * nc * b * h * tp * (tm * bm * n * bn + k_tokens * bm * bn)
    out.append(StageCost("chunk_scan", progs, unique_in + x_bytes, max(0.0, reads - unique_in),
                         flops, (bm, bn, min(bk, bd)), config.scan_stages))
    if config.launches == 5:
        return out
    cum, bmm_c, state, _, scan = out
    chains = ssd_chains(problem, config)
    carry = 2 * nc * chains * config.state_block_m * config.state_block_n * f4   # read + write, fp32
    if config.launches == 3:
        # cumsum folded in (dt read, dt'/dA written), local states never stored: the passed
        # states are written once; the running state goes through L2 (carry)
        fused = StageCost("state_fused", nc * chains, state.unique_bytes - states - ddA + cum.unique_bytes
                          + states, state.reread_bytes + carry, state.flops, state.block, state.stages,
                          chain=nc, ordered=True)
        return [bmm_c, fused, scan]
    # one launch: no CB, no states in HBM; CB = C·Bᵀ recomputed per head and headdim tile
    tp = _cdiv(p, config.state_block_m)
    bm, bk = config.scan_block_m, config.scan_block_k
    tm = _cdiv(q, bm)
    k_tokens = sum(min(q, (i + 1) * bm) for i in range(tm))
    cb_flops = 2.0 * nc * b * h * tp * k_tokens * bm * n
    z_bytes = x_bytes if problem.has_z else 0
    unique = x_bytes * 2 + 2 * bc_bytes + b * l * h * f4 + ddA + z_bytes
    rereads = (state.reread_bytes + scan.reread_bytes - b * nc * g * q * q * e // 2 + carry
               + nc * b * h * tp * k_tokens * n * e)            # B rows re-read per m block
    return [StageCost("fused", nc * chains, unique, max(0.0, rereads),
                      state.flops + scan.flops + cb_flops, (bm, config.state_block_m, bk),
                      config.scan_stages, chain=nc, ordered=True)]
