"""Which kernels one SSD forward launches, with which grids and arguments: `plan()` and its Gluon
launch builders, with the checks of whether a call fits the Gluon kernels (the gaps).

`plan()` turns a call into a list of `Launch`es (kernel name, grid, arguments, options). The same
plan runs on a GPU or in Triton's interpreter (`chunk.run`), and is cross-compiled for any arch from
meta tensors (`autossd.compile`), so the launched and the compiled code cannot drift apart.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton

from ... import problem as _problem
from ...render import interpreting, launch_options
from .fwd_knobs import Config, gluon_scan_violations, walk_violations


@dataclass
class Buffers:
    """The forward's intermediates and outputs of one call (allocated by workspace.allocate)."""
    y: torch.Tensor
    dt: torch.Tensor        # (b, h, c, q) fp32, processed dt
    dA: torch.Tensor        # (b, h, c, q) fp32, within-chunk cumsum of dt * A
    cb: torch.Tensor | None      # (b, c, g, q, q), launches 5 and 3
    states: torch.Tensor | None  # (b, c, h, p, n) state dtype: local states, then passed states
    final: torch.Tensor | None   # (b, h, p, n) fp32; the fused depths' running state (carry)
    # int64, zeroed once: ticket counter, then one flag per chain; both only grow (fused_common.jinja)
    sync: torch.Tensor | None = None
    w: torch.Tensor | None = None   # (b, h, c, q) fp32, the walk's per-token weights (walk_weights)
    # walk_split > 1: the decay from its segment's start to each chunk (b, h, c) and over each
    # segment (b, h, s), fp32; the segments' final states (b, h, s, p, n) fp32, and their entering
    # states, in the states' dtype
    gam: torch.Tensor | None = None
    gseg: torch.Tensor | None = None
    seg: torch.Tensor | None = None
    sen: torch.Tensor | None = None


@dataclass
class Launch:
    stage: str
    kernel: str
    grid: tuple[int, ...]
    args: dict           # name -> tensor / int / float / None, in the kernel's order
    constexprs: dict     # name -> bool
    options: dict = field(default_factory=dict)


def strides(t, n: int) -> tuple:
    """A tensor's strides, or n zeros for an argument not given (a kernel's unused strides)."""
    return tuple(t.stride()) if t is not None else (0,) * n


def chains(prob: _problem.Problem, config: Config) -> int:
    """Ordered state chains of the fused depths: one per (batch, head, state tile)."""
    tiles = triton.cdiv(prob.headdim, config.state_block_m)
    if config.launches == 3:
        tiles *= triton.cdiv(prob.dstate, config.state_block_n)
    return prob.batch * prob.nheads * tiles


def walk_programs(prob: _problem.Problem) -> int:
    """Programs of the whole Gluon walk: one per (64-row headdim tile, dstate tile of up to 128,
    head, batch); walk_split multiplies them by its segments."""
    return prob.batch * prob.nheads * triton.cdiv(prob.headdim, 64) * triton.cdiv(prob.dstate, 128)


def walk_segments(prob: _problem.Problem, config: Config) -> tuple[int, int]:
    """(chunks per segment, segments per sequence) of the walk at walk_split: whole chunks, the
    last segment possibly shorter; (chunks, 1) when the walk is not cut."""
    nc = triton.cdiv(prob.seqlen, config.chunk_size)
    seg = triton.cdiv(nc, config.walk_split) if config.state_walk else nc
    return seg, triton.cdiv(nc, seg)


def plan(prob: _problem.Problem, config: Config, t: dict, buf: Buffers, backend: str = "cuda",
         dt_limit=(0.0, float("inf"))) -> list[Launch]:
    """The launches of one forward. `t` maps argument names to tensors (or None)."""
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    opts = launch_options(config, backend)
    x, dt, A, B, C = t["x"], t["dt"], t["A"], t["B"], t["C"]
    D, z, bias, init, seq = t.get("D"), t.get("z"), t.get("dt_bias"), t.get("initial_states"), t.get("seq_idx")
    s_dt = buf.dt.stride()[:3]
    s_seq = strides(seq, 2)
    if D is None:
        s_D = (0, 0)
    else:
        s_D = (D.stride(0), D.stride(1) if D.dim() == 2 else 0)
    lo, hi = (float(v) for v in dt_limit)
    hpg = h // g
    depth = config.launches
    flags = dict(HAS_BIAS=bias is not None, SOFTPLUS=prob.dt_softplus, HAS_LIMIT=prob.has_dt_limit)
    dt_in = dict(dt_ptr=dt, A_ptr=A, bias_ptr=bias)
    dt_strides = dict(s_dt_b=dt.stride(0), s_dt_l=dt.stride(1), s_dt_h=dt.stride(2), s_A_h=A.stride(0),
                      s_bias_h=bias.stride(0) if bias is not None else 0)
    dt_out = dict(s_o_b=s_dt[0], s_o_h=s_dt[1], s_o_c=s_dt[2])
    st_strides = _named("s_st", ("b", "c", "h", "p", "n"), buf.states)
    fin = dict(s_fin_b=buf.final.stride(0) if buf.final is not None else 0,
               s_fin_h=buf.final.stride(1) if buf.final is not None else 0)
    init_strides = _named("s_init", ("b", "h", "p", "n"), init)
    seq_strides = dict(s_seq_b=s_seq[0], s_seq_l=s_seq[1])
    scan_io = dict(**_named("s_x", "blhp", x), **_named("s_z", "blhp", z), **_named("s_y", "blhp", buf.y))
    epilogue = dict(HAS_D=D is not None, D_HAS_HDIM=prob.D_has_hdim, HAS_Z=z is not None)
    bmm = Launch("bmm", "ssd_bmm",
                 (triton.cdiv(q, config.bmm_block_m) * triton.cdiv(q, config.bmm_block_n) * g, nc, b),
                 dict(C_ptr=C, B_ptr=B, cb_ptr=buf.cb, L=l, G=g, N=n,
                      **_named("s_C", "blgn", C), **_named("s_B", "blgn", B),
                      **_named("s_cb", ("b", "c", "g", "i", "j"), buf.cb)),
                 {}, opts["bmm"])
    # the Gluon kernels run where the call fits them (the gaps), else the tl ones of the same config
    walk_fits = bool(config.state_walk) and not walk_gaps(prob, config, t, buf, backend)
    scan_fits = bool(config.scan_gluon) and not gluon_scan_gaps(prob, config, t, buf, backend)
    chunk_walking = scan_fits and config.scan_gluon >= 2   # the scan is ssd_chunk_scan_gluon_chunk
    # walk_split: the walk runs cut into segments only before the chunk-walking Gluon scan, which
    # completes their states (chunk_scan_gluon.jinja); anywhere else it runs whole
    split = buf.seg is not None and chunk_walking and config.pdl == 0 and walk_fits
    # chunk 0's entering state is 0 without an initial state: the chunk-walking scan skips its
    # term, and then the walk need not store it. Not storing it measured 2-4% faster for the
    # walk's 128-token ring but 16% slower for its 64-token ring at 2.7b 4x16384 on the H100
    # (why was not found): there it is stored as before
    first = int(init is None and chunk_walking and config.walk_block >= 128)
    walk = _gluon_walk(prob, config, t, buf, s_dt, split, first) if walk_fits else None
    scan = _gluon_scan(prob, config, t, buf, opts, s_dt, s_D, walk is not None, split) if scan_fits else None
    scan = scan or Launch("chunk_scan", "ssd_chunk_scan",
                  (triton.cdiv(q, config.scan_block_m) * triton.cdiv(p, config.scan_block_n) * h, nc, b),
                  dict(x_ptr=x, z_ptr=z, y_ptr=buf.y, C_ptr=C, cb_ptr=buf.cb, dt_ptr=buf.dt, dA_ptr=buf.dA,
                       st_ptr=buf.states, D_ptr=D, seq_ptr=seq,
                       L=l, H=h, P=p, N=n, heads_per_group=hpg, **scan_io,
                       **_named("s_C", "blgn", C), **_named("s_cb", ("b", "c", "g", "i", "j"), buf.cb),
                       s_dt_b=s_dt[0], s_dt_h=s_dt[1], s_dt_c=s_dt[2], **st_strides,
                       s_D_h=s_D[0], s_D_p=s_D[1], **seq_strides),
                  # EVEN_L drops the row/column masks: only when tiles cannot pass the chunk
                  # (ssd_forward takes any config; violations() would refuse such tiles)
                  dict(**epilogue, HAS_SEQ=seq is not None,
                       EVEN_L=l % q == 0 and config.scan_block_m <= q and config.scan_block_k <= q,
                       EVEN_P=p % config.scan_block_n == 0, EVEN_N=n % config.scan_block_d == 0),
                  opts["chunk_scan"])
    # the fused kernels take a 1-D grid: a program's work comes from its ticket, not its id
    grid = (nc * chains(prob, config),)
    if depth == 3:
        return [bmm, Launch(
            "state_fused", "ssd_state_fused", grid,
            dict(x_ptr=x, **dt_in, B_ptr=B, seq_ptr=seq, init_ptr=init, dt_out_ptr=buf.dt, dA_out_ptr=buf.dA,
                 st_ptr=buf.states, carry_ptr=buf.final, sync_ptr=buf.sync,
                 L=l, H=h, P=p, N=n, NB=b, heads_per_group=hpg, dt_lo=lo, dt_hi=hi,
                 **_named("s_x", "blhp", x), **dt_strides, **_named("s_B", "blgn", B), **seq_strides,
                 **init_strides, **dt_out, **st_strides, **fin),
            dict(**flags, HAS_INIT=init is not None, HAS_SEQ=seq is not None), opts["state_fused"]), scan]
    if depth == 1:
        return [Launch(
            "fused", "ssd_fused", grid,
            dict(x_ptr=x, z_ptr=z, y_ptr=buf.y, **dt_in, B_ptr=B, C_ptr=C, D_ptr=D, seq_ptr=seq,
                 init_ptr=init, dt_out_ptr=buf.dt, dA_out_ptr=buf.dA, st_ptr=buf.states,
                 carry_ptr=buf.final, sync_ptr=buf.sync,
                 L=l, H=h, P=p, N=n, NB=b, heads_per_group=hpg, dt_lo=lo, dt_hi=hi, **scan_io,
                 **dt_strides, **_named("s_B", "blgn", B), **_named("s_C", "blgn", C),
                 s_D_h=s_D[0], s_D_p=s_D[1], **seq_strides, **init_strides, **dt_out, **st_strides, **fin),
            dict(**flags, HAS_INIT=init is not None, HAS_SEQ=seq is not None,
                 HAS_STATES=buf.states is not None, **epilogue), opts["fused"])]
    state_grid0 = triton.cdiv(p, config.state_block_m) * triton.cdiv(n, config.state_block_n) * h
    passing = Launch("state_passing", "ssd_state_passing", (triton.cdiv(p * n, config.pass_block), b * h),
                     dict(st_ptr=buf.states, dA_ptr=buf.dA, init_ptr=init, final_ptr=buf.final, seq_ptr=seq,
                          L=l, H=h, N=n, PN=p * n, nchunks=nc,
                          s_st_b=buf.states.stride(0), s_st_c=buf.states.stride(1),
                          s_st_h=buf.states.stride(2), s_dA_b=s_dt[0], s_dA_h=s_dt[1], s_dA_c=s_dt[2],
                          **init_strides, **fin, **seq_strides),
                     dict(HAS_INIT=init is not None, HAS_FINAL=buf.final is not None, HAS_SEQ=seq is not None),
                     opts["state_passing"])
    # walk_weights: the cumsum writes the walk's weights, when the walk runs (else it has no such
    # arguments: a walk_weights = 0 kernel is as it was)
    w_out = dict(w_out_ptr=buf.w) if config.walk_weights else {}
    w_flag = dict(HAS_W=walk is not None) if config.walk_weights else {}
    cumsum = Launch("cumsum", "ssd_cumsum", (nc, triton.cdiv(h, config.cumsum_block_h), b),
                    dict(**dt_in, dt_out_ptr=buf.dt, dA_out_ptr=buf.dA, **w_out, L=l, H=h, dt_lo=lo, dt_hi=hi,
                         **dt_strides, **dt_out), dict(**flags, **w_flag), opts["cumsum"])
    if config.fold_prep == 2:   # cumsum and C·Bᵀ in one launch: bmm's tiles, then cumsum's head blocks
        prep = [Launch("prep", "ssd_prep", (bmm.grid[0] + cumsum.grid[1], nc, b),
                       dict(**dt_in, C_ptr=C, B_ptr=B, cb_ptr=buf.cb, dt_out_ptr=buf.dt, dA_out_ptr=buf.dA,
                            **w_out, L=l, H=h, G=g, N=n, dt_lo=lo, dt_hi=hi, **dt_strides, **dt_out,
                            **_named("s_C", "blgn", C), **_named("s_B", "blgn", B),
                            **_named("s_cb", ("b", "c", "g", "i", "j"), buf.cb)),
                       dict(**flags, **w_flag), opts["bmm"])]   # bmm's warps and stages: its tiles hold the matmul
    else:
        prep = [cumsum, bmm]
    if walk is not None and split:
        return [*prep, walk, _walk_join(prob, config, t, buf), scan]
    if walk is not None:
        return [*prep, walk, scan]
    if config.fold_prep == 1:
        # cumsum and C·Bᵀ inside the chunk-state launch: bmm's tiles follow the state programs
        return [Launch(
            "chunk_state", "ssd_chunk_state_prep", (state_grid0 + bmm.grid[0], nc, b),
            dict(x_ptr=x, **dt_in, B_ptr=B, C_ptr=C, seq_ptr=seq, st_ptr=buf.states, cb_ptr=buf.cb,
                 dt_out_ptr=buf.dt, dA_out_ptr=buf.dA, L=l, H=h, P=p, N=n, heads_per_group=hpg,
                 dt_lo=lo, dt_hi=hi, **_named("s_x", "blhp", x), **dt_strides,
                 **_named("s_B", "blgn", B), **_named("s_C", "blgn", C),
                 **_named("s_cb", ("b", "c", "g", "i", "j"), buf.cb), **dt_out, **seq_strides, **st_strides),
            dict(**flags, HAS_SEQ=seq is not None), opts["chunk_state"]), passing, scan]
    return [
        *prep,
        Launch("chunk_state", "ssd_chunk_state", (state_grid0, nc, b),
               dict(x_ptr=x, B_ptr=B, dt_ptr=buf.dt, dA_ptr=buf.dA, seq_ptr=seq, st_ptr=buf.states,
                    L=l, H=h, P=p, N=n, heads_per_group=hpg,
                    **_named("s_x", "blhp", x), **_named("s_B", "blgn", B),
                    s_dt_b=s_dt[0], s_dt_h=s_dt[1], s_dt_c=s_dt[2], **seq_strides, **st_strides),
               dict(HAS_SEQ=seq is not None), opts["chunk_state"]),
        passing,
        scan,
    ]


_INT32 = 2**31


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _sm90_gaps(what: str, x: torch.Tensor, backend: str) -> list[str]:
    """Why a Gluon kernel for sm90 cannot run this call's device: a GPU that is an sm90 (meta
    tensors stand for one: compile_config has checked the arch, and they never run, so the
    interpreter does not apply to them), no interpreter."""
    if backend != "cuda" or (interpreting() and x.device.type != "meta") or x.device.type not in ("cuda", "meta"):
        return [f"{what} runs on an NVIDIA GPU only (no interpreter)"]
    if x.device.type == "cuda" and (torch.version.hip or not _is_sm90(x.device.index or 0)):
        return [f"{what} needs an sm90 GPU"]
    return []


def _tma_view_gaps(prob: _problem.Problem, views) -> list[str]:
    """Why these (name, tensor (batch, seqlen, k, m), k * m) inputs do not make TMA-addressable 2-D
    views (batch * seqlen, k * m): rows one stride apart, 16-byte aligned."""
    why = []
    b, l = prob.batch, prob.seqlen
    for name, v, inner in views:
        if not (v.stride(3) == 1 and v.stride(2) == v.shape[3] and (b == 1 or v.stride(0) == l * v.stride(1))
                and v.stride(1) * v.element_size() % 16 == 0 and v.stride(1) >= inner
                and v.data_ptr() % 16 == 0):
            why.append(f"{name}'s strides {tuple(v.stride())} do not make a TMA-addressable "
                       f"(batch * seqlen, {inner}) view")
    return why


def gluon_scan_gaps(prob: _problem.Problem, config: Config, t: dict, buf: Buffers,
                    backend: str = "cuda") -> list[str]:
    """Why this call cannot run a Gluon chunk scan (scan_gluon = 1, 2 or 3); empty when it can. The
    config's and problem's limits (space.gluon_scan_violations), then the call's: an sm90 GPU,
    and x, C, CB and the states laid out as the TMA descriptors' 2-D views need them."""
    x, C = t["x"], t["C"]
    b, l, h, p, n, g, q = (prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups,
                           config.chunk_size)
    why = gluon_scan_violations(config, prob) + _sm90_gaps("the Gluon chunk scan", x, backend)
    why += _tma_view_gaps(prob, (("x", x, h * p), ("C", C, g * n)))
    if buf.cb is None or not buf.cb.is_contiguous() or buf.states is None or not buf.states.is_contiguous():
        why.append("CB and the states must be contiguous buffers")
    nc = triton.cdiv(l, q)
    if max(b * l, b * nc * g * q, b * nc * h * p) >= _INT32:
        why.append("a TMA coordinate would pass 2**31")
    return why


def walk_gaps(prob: _problem.Problem, config: Config, t: dict, buf: Buffers,
              backend: str = "cuda") -> list[str]:
    """Why this call cannot run the Gluon walk (state_walk = 1); empty when it can: the config's
    and problem's limits (space.walk_violations), an sm90 GPU, x and B as TMA-addressable 2-D
    views, contiguous states, and the final states as the walk writes them."""
    return walk_violations(config, prob) + walk_call_gaps(prob, config.chunk_size, t, buf.states, buf.final, backend)


def walk_call_gaps(prob: _problem.Problem, chunk_size: int, t: dict, states, final,
                   backend: str = "cuda") -> list[str]:
    """The call's part of walk_gaps (any op that runs the walk: the forward, and the backward's
    recomputed states): an sm90 GPU, x and B as TMA-addressable 2-D views, the states (and final
    states, where written) contiguous, coordinates in 32 bits."""
    x, B = t["x"], t["B"]
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    why = _sm90_gaps("the Gluon walk", x, backend)
    why += _tma_view_gaps(prob, (("x", x, h * p), ("B", B, g * n)))
    if states is None or not states.is_contiguous():
        why.append("the states must be a contiguous buffer")
    if final is not None and not final.is_contiguous():
        why.append("the final states must be a contiguous buffer")
    if max(b * l, b * triton.cdiv(l, chunk_size) * h * p) >= _INT32:
        why.append("a TMA coordinate would pass 2**31")
    return why


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    # the default swizzled shared layout of a block: building one validates its fields (~40 us
    # of host time, five to eight per packed-prefill call, which launches uncached)
    from triton.experimental.gluon import language as ttgl
    return ttgl.NVMMASharedLayout.get_default_for(list(block), getattr(ttgl, str(dtype).split(".")[1]))


def _tma_desc(base: torch.Tensor, shape: list, row_stride: int, block: list):
    """A TMA descriptor of `base` viewed as 2-D rows (shape, row_stride) in `block` tiles, in the
    default swizzled shared layout for the block. The base is the caller's tensor itself, so the
    launch cache can put a new call's tensor in its place."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    return TensorDescriptor(base, shape, [row_stride, 1], block, _shared_layout(tuple(block), base.dtype))


def _gluon_walk(prob, config, t, buf, s_dt, split: bool = False, first_stored: int = 0, bn: int = 128) -> Launch:
    """The Gluon walk's launch (chunk state + state passing), for a call that fits it
    (walk_gaps; plan() runs the two tl stages of the same config otherwise). `split`: cut into
    walk_split's segments, its final states into buf.seg for the join. `first_stored`: the first
    chunk whose entering state it stores (1 where chunk 0's is 0 and the scan does not read it).
    Without final states it stops at the last chunk's entering state. `bn`: the widest dstate tile
    (128; the backward's recompute_walk = 3 takes 64)."""
    x, B, init = t["x"], t["B"], t.get("initial_states")
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    bn, kb = min(n, bn), min(q, config.walk_block)
    descs = dict(x_desc=_tma_desc(x, [b * l, h * p], x.stride(1), [kb, 64]),
                 B_desc=_tma_desc(B, [b * l, g * n], B.stride(1), [kb, bn]),
                 st_desc=_tma_desc(buf.states, [b * nc * h * p, n], n, [64, bn]))
    final = buf.seg if split else buf.final
    if config.walk_split > 1:   # the segmented kernel; whole, it is one segment of every chunk
        seg, nseg = walk_segments(prob, config) if split else (nc, 1)
        cut = dict(g_ptr=buf.gam, gs_ptr=buf.gseg, SEG=seg, NSEG=nseg, s_fin_k=p * n if split else 0)
    else:
        nseg, cut = 1, {}
    return Launch("state_walk", "ssd_state_walk", ((p // 64) * (n // bn), h, b * nseg),
                  dict(**descs, **({"w_ptr": buf.w} if config.walk_weights else {"dt_ptr": buf.dt}),
                       dA_ptr=buf.dA, init_ptr=None if split else init, final_ptr=final, **cut,
                       L=l, H=h, P=p, heads_per_group=h // g, s_dt_b=s_dt[0], s_dt_h=s_dt[1], s_dt_c=s_dt[2],
                       **_named("s_init", ("b", "h", "p", "n"), None if split else init),
                       s_fin_b=final.stride(0) if final is not None else 0,
                       s_fin_h=final.stride(1) if final is not None else 0,
                       **({"sync_ptr": buf.sync} if config.pdl == 3 else {})),
                  # split: the initial state goes to the join, and every segment's final state out
                  dict(N=n, BN=bn, HAS_INIT=init is not None and not split, HAS_FINAL=final is not None,
                       EVEN_L=l % q == 0, FIRST_STORED=first_stored),
                  # one warpgroup, its ring in the template. Not in render.STAGE_LAUNCH: that table
                  # is rendered into every module, so a row there would change every config's
                  # kernel hash and leave every tuned record stale
                  dict(num_warps=4, num_stages=1, **({"launch_pdl": True} if config.pdl else {})))


def _walk_join(prob, config, t, buf) -> Launch:
    """walk_split's join: the segments' final states (buf.seg) chained into their entering states
    (buf.sen) and the final states, by one associative scan over the segments. The compiler keeps
    every segment of a column in one thread, so the scan is the chain with all its loads issued
    ahead. 1024 columns per 4-warp program (8 per thread) measured 3.3-3.6 us alone at 2-16
    segments, where 256 (4096 // SEGS at 16) took 13.8 us and 512 took 7-13 (H100)."""
    init = t.get("initial_states")
    pn, segs = prob.headdim * prob.dstate, triton.next_power_of_2(buf.seg.shape[2])
    block = 1024   # at 16 segments 242 registers, no spills (two programs per SM)
    return Launch("walk_join", "ssd_walk_join", (triton.cdiv(pn, block), prob.nheads, prob.batch),
                  dict(seg_ptr=buf.seg, gs_ptr=buf.gseg, sen_ptr=buf.sen, init_ptr=init, final_ptr=buf.final,
                       H=prob.nheads, PN=pn, NSEG=buf.seg.shape[2], **_named("s_init", ("b", "h", "p", "n"), init),
                       s_fin_b=buf.final.stride(0) if buf.final is not None else 0,
                       s_fin_h=buf.final.stride(1) if buf.final is not None else 0),
                  dict(N=prob.dstate, HAS_INIT=init is not None, HAS_FINAL=buf.final is not None, BLOCK=block,
                       SEGS=segs),
                  # not in render.STAGE_LAUNCH, as the walk's (every module's kernel hash)
                  dict(num_warps=4, num_stages=1))


def _gluon_scan(prob, config, t, buf, opts, s_dt, s_D, after_walk: bool, split: bool = False) -> Launch:
    """The Gluon chunk scan's launch, for a call that fits it (gluon_scan_gaps; plan() runs the
    tl kernel of the same config otherwise, with the same result to rounding). At pdl = 3 it
    follows the walk's published states when the walk runs (`after_walk`), else it waits for its
    predecessor to end. `split`: the walk ran in walk_split's segments, whose states this scan
    completes."""
    x, C, D, z, init = t["x"], t["C"], t.get("D"), t.get("z"), t.get("initial_states")
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    tile = [64, 64]
    descs = dict(C_desc=_tma_desc(C, [b * l, g * n], C.stride(1), tile),
                 st_desc=_tma_desc(buf.states, [b * nc * h * p, n], n, tile),
                 cb_desc=_tma_desc(buf.cb, [b * nc * g * q, q], q, tile),
                 x_desc=_tma_desc(x, [b * l, h * p], x.stride(1), tile))
    if config.scan_gluon >= 2:
        # one program per chunk and head: 72 KB of shared memory, and a register cap that leaves
        # three CTAs per SM (149 registers; uncapped it takes 172, two CTAs; 128 spills).
        # 3: the same program storing y by TMA
        kernel, grid = "ssd_chunk_scan_gluon_chunk", ((p // 64) * h, nc, b)
        if config.scan_gluon == 3:   # (y is always this call's own contiguous buffer: no gap to check)
            descs["y_desc"] = _tma_desc(buf.y, [b * l, h * p], buf.y.stride(1), tile)
        options = dict(opts["chunk_scan"], maxnreg=168)
        # chunk 0 enters with state 0 unless there is an initial state: no state term there
        flags = dict(FIRST_STATE=int(init is None))
        if config.walk_split > 1:   # the kernel with the segments' correction; off unless split
            seg, nseg = walk_segments(prob, config) if split else (nc, 1)
            cut = dict(gam_ptr=buf.gam if split else None, sen_ptr=buf.sen if split else None,
                       SEG=seg, NSEG=nseg, K1=0 if init is not None else 1)
            flags["SPLIT"] = split
        else:
            cut = {}
    else:   # pdl >= 2: its intra-chunk part before its wait (chunk_scan_gluon.jinja)
        kernel = "ssd_chunk_scan_gluon_early" if config.pdl >= 2 else "ssd_chunk_scan_gluon"
        grid, options = (triton.cdiv(q, 64) * (p // 64) * h, nc, b), opts["chunk_scan"]
        cut, flags = {}, {}
    return Launch("chunk_scan", kernel, grid,
                  dict(**descs, z_ptr=z, y_ptr=buf.y, dt_ptr=buf.dt, dA_ptr=buf.dA, D_ptr=D, **cut,
                       L=l, H=h, P=p, G=g, heads_per_group=h // g,
                       **_named("s_z", "blhp", z), **_named("s_y", "blhp", buf.y),
                       s_dt_b=s_dt[0], s_dt_h=s_dt[1], s_dt_c=s_dt[2], s_D_h=s_D[0], s_D_p=s_D[1],
                       **({"sync_ptr": buf.sync} if config.pdl == 3 else {})),
                  dict(N=n, HAS_D=D is not None, D_HAS_HDIM=prob.D_has_hdim, HAS_Z=z is not None,
                       EVEN_L=l % q == 0, **({"FOLLOW": after_walk} if config.pdl == 3 else {}), **flags),
                  options)


def _named(prefix, dims, t):
    st = strides(t, len(dims))
    return {f"{prefix}_{d}": s for d, s in zip(dims, st)}
