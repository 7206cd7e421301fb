"""The five-stage SSD forward built from generated kernels.

`plan()` turns a call into a list of `Launch`es (kernel name, grid, arguments, options). The same
plan runs on a GPU or in Triton's interpreter (`run`), and is cross-compiled for any arch from
meta tensors (`autossd.compile`), so the launched and the compiled code cannot drift apart.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver

from ... import problem as _problem
from ...grad import forward_only
from ...render import interpreting, launch_options, load
from ...space import STATE_DTYPES, Config

_TORCH_STATE = {k: getattr(torch, v) for k, v in STATE_DTYPES.items()}


@dataclass
class Launch:
    stage: str
    kernel: str
    grid: tuple[int, ...]
    args: dict           # name -> tensor / int / float / None, in the kernel's order
    constexprs: dict     # name -> bool
    options: dict = field(default_factory=dict)


@dataclass
class Buffers:
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


def _strides(t, n):
    return tuple(t.stride()) if t is not None else (0,) * n


SYNC_SCRATCH = 1024   # >= the lanes of a fused program (8 warps x 64 on AMD)


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


def _sync_words(prob: _problem.Problem, config: Config) -> int:
    """int64 words of the sync buffer, zeroed once: the fused depths' ticket counter and flags (+
    scratch words for the AMD hand-off's per-lane fences, fused.jinja's _pass_state); at pdl = 3
    the walk's ticket counter and one flag per walk program (state_walk_gluon.jinja); else none."""
    if config.launches != 5:
        return 1 + chains(prob, config) + SYNC_SCRATCH
    if config.pdl == 3:
        return 1 + walk_programs(prob)
    return 0


def allocate(prob: _problem.Problem, config: Config, device, state_dtype=None,
             poison: bool = False) -> Buffers:
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    xdt = _problem.TORCH_DTYPES[prob.dtype]
    sdt = state_dtype or _TORCH_STATE[config.state_dtype]
    f32 = torch.float32
    depth = config.launches
    # the single launch keeps entering states in registers; it writes them only for varlen states
    need_states = depth != 1 or prob.return_varlen_states
    need_final = prob.return_final_states or depth != 5
    # (one allocation carved into these measured slower: views cost more than the allocator)
    buf = Buffers(
        y=torch.empty(b, l, h, p, dtype=xdt, device=device),
        dt=torch.empty(b, h, nc, q, dtype=f32, device=device),
        dA=torch.empty(b, h, nc, q, dtype=f32, device=device),
        cb=torch.empty(b, nc, g, q, q, dtype=xdt, device=device) if depth != 1 else None,
        states=torch.empty(b, nc, h, p, n, dtype=sdt, device=device) if need_states else None,
        final=torch.empty(b, h, p, n, dtype=f32, device=device) if need_final else None,
        sync=torch.zeros(words, dtype=torch.int64, device=device) if (words := _sync_words(prob, config)) else None,
        w=torch.empty(b, h, nc, q, dtype=f32, device=device) if config.walk_weights else None)
    if config.walk_split > 1 and config.state_walk:
        nseg = walk_segments(prob, config)[1]
        buf.gam = torch.empty(b, h, nc, dtype=f32, device=device)
        buf.gseg = torch.empty(b, h, nseg, dtype=f32, device=device)
        if nseg > 1:
            buf.seg = torch.empty(b, h, nseg, p, n, dtype=f32, device=device)
            buf.sen = torch.empty(b, h, nseg, p, n, dtype=sdt, device=device)
    if poison:  # NaN everywhere: an element the kernels fail to write shows up in the error
        for t in (buf.y, buf.dt, buf.dA, buf.cb, buf.states, buf.final, buf.w, buf.gam, buf.gseg, buf.seg,
                  buf.sen):
            if t is not None:
                t.fill_(float("nan"))
    return buf


# --- workspace ----------------------------------------------------------------------------
# The intermediates (dt, dA, CB, local/passed states, the fused depths' carry and ticket words)
# never leave a call, so an eager call reuses them instead of allocating them anew: ~6 us of host
# time per tensor, ~20 us per call at 2.7b 1x2048 (BENCHMARKS.md §42). Reuse is safe because the
# kernels of one stream run in order: a workspace belongs to one (problem, config, device,
# stream), and a lock keeps two threads from interleaving their launches on it. The outputs
# (y, final states) are always fresh. Used only by eager callers (execute(keep=True): the eager
# drop-in, Kernel calls, ssd_forward, the tuner), never by the custom op torch.compile runs (its
# CUDA-graph warm-up allocates in the graph's pool without capturing, and a kept tensor there
# fails torch's pool check), nor while a stream captures a CUDA graph, nor for large problems,
# whose host time is negligible beside their GPU time. The budget is least-recently-used.
# A limit: a workspace is allocated wherever the first eager call's allocations go; code that
# routes eager allocations into a pool it later frees (torch.cuda.use_mem_pool, offloading
# allocators) should set AUTOSSD_WORKSPACE_MB=0.
def _budget_from_env() -> int:
    text = os.environ.get("AUTOSSD_WORKSPACE_MB", "256")
    try:
        return max(0, int(float(text) * (1 << 20)))
    except (ValueError, OverflowError):   # OverflowError: "inf"
        import logging
        logging.getLogger("autossd").warning(
            "autossd: AUTOSSD_WORKSPACE_MB=%r is not a number of MiB; using 256", text)
        return 256 << 20


WORKSPACE_BYTES = _budget_from_env()
WORKSPACE_MAX_ONE = 64 << 20      # bytes: a larger workspace is not kept
_workspaces: OrderedDict = OrderedDict()   # key -> (lock, Buffers of the intermediates, bytes)
_workspace_sizes: dict = {}                # key -> bytes, also for keys too large to keep
_workspaces_lock = threading.Lock()
_INTERNAL = ("dt", "dA", "cb", "states", "final", "sync", "w", "gam", "gseg", "seg", "sen")


def _nbytes(buf: Buffers) -> int:
    return sum(v.numel() * v.element_size() for k in _INTERNAL if (v := getattr(buf, k)) is not None)


def clear_workspaces() -> None:
    with _workspaces_lock:
        _workspaces.clear()
        _workspace_sizes.clear()


def _forget_workspace(key) -> None:
    with _workspaces_lock:
        _workspaces.pop(key, None)


def _workspace(prob, config, device, state_dtype, stream):
    """(lock, Buffers) of the kept intermediates for this call, or None (not kept)."""
    key = (prob, config, device, state_dtype, stream)
    with _workspaces_lock:
        ws = _workspaces.get(key)
        if ws is not None:
            _workspaces.move_to_end(key)
            return ws[:2]
        size = _workspace_sizes.get(key)
    # the workspace holds `final` as the fused depths' carry; a call that returns it gets its own
    kprob = prob.replace(return_final_states=False)
    if size is None:   # measured on meta tensors: nothing is allocated for a key never kept
        size = _nbytes(allocate(kprob, config, "meta", state_dtype))
        with _workspaces_lock:
            if len(_workspace_sizes) > 4096:
                _workspace_sizes.clear()
            _workspace_sizes[key] = size
    if size > min(WORKSPACE_MAX_ONE, WORKSPACE_BYTES):
        return None
    buf = allocate(kprob, config, device, state_dtype)
    buf.y = None   # every call returns a fresh y
    with _workspaces_lock:
        ws = _workspaces.setdefault(key, (threading.Lock(), buf, size))
        total = sum(w[2] for w in _workspaces.values())
        while total > WORKSPACE_BYTES and len(_workspaces) > 1:
            _, old = _workspaces.popitem(last=False)   # streams order its last kernels before reuse
            total -= old[2]
    return ws[:2]


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
    s_seq = _strides(seq, 2)
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
    # walk's 128-token ring but 16% slower for its 64-token ring at 2.7b 4x16384 (BENCHMARKS.md
    # §156; why, not found): there it is stored as before
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
    tensors stand for one: compile_config has checked the arch), no interpreter."""
    if backend != "cuda" or interpreting() or x.device.type not in ("cuda", "meta"):
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
    from ...space import gluon_scan_violations
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
    from ...space import walk_violations
    x, B = t["x"], t["B"]
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    why = walk_violations(config, prob) + _sm90_gaps("the Gluon walk", x, backend)
    why += _tma_view_gaps(prob, (("x", x, h * p), ("B", B, g * n)))
    if buf.states is None or not buf.states.is_contiguous():
        why.append("the states must be a contiguous buffer")
    if buf.final is not None and not buf.final.is_contiguous():
        why.append("the final states must be a contiguous buffer")
    if max(b * l, b * triton.cdiv(l, config.chunk_size) * h * p) >= _INT32:
        why.append("a TMA coordinate would pass 2**31")
    return why


def _tma_desc(base: torch.Tensor, shape: list, row_stride: int, block: list):
    """A TMA descriptor of `base` viewed as 2-D rows (shape, row_stride) in `block` tiles, in the
    default swizzled shared layout for the block. The base is the caller's tensor itself, so the
    launch cache can put a new call's tensor in its place."""
    from triton.experimental.gluon import language as ttgl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = ttgl.NVMMASharedLayout.get_default_for(block, getattr(ttgl, str(base.dtype).split(".")[1]))
    return TensorDescriptor(base, shape, [row_stride, 1], block, layout)


def _gluon_walk(prob, config, t, buf, s_dt, split: bool = False, first_stored: int = 0) -> Launch:
    """The Gluon walk's launch (chunk state + state passing), for a call that fits it
    (walk_gaps; plan() runs the two tl stages of the same config otherwise). `split`: cut into
    walk_split's segments, its final states into buf.seg for the join. `first_stored`: the first
    chunk whose entering state it stores (1 where chunk 0's is 0 and the scan does not read it).
    Without final states it stops at the last chunk's entering state."""
    x, B, init = t["x"], t["B"], t.get("initial_states")
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    bn, kb = min(n, 128), min(q, config.walk_block)
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
    segments, where 256 (4096 // SEGS at 16) took 13.8 us and 512 took 7-13 (BENCHMARKS §147)."""
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
    st = _strides(t, len(dims))
    return {f"{prefix}_{d}": s for d, s in zip(dims, st)}


def run(launches: list[Launch], module) -> list:
    """Launch through triton's JIT; returns what it returns (the compiled kernels)."""
    return [getattr(module, ln.kernel)[ln.grid](**ln.args, **ln.constexprs, **ln.options)
            for ln in launches]


def _never_compiled(fn, device: int) -> bool:
    """Whether this process has compiled nothing of `fn` for `device` (triton 3.6's JIT keeps
    its compiled kernels per device in device_caches; False where that is not so)."""
    caches = getattr(fn, "device_caches", None)
    if caches is None or not hasattr(caches, "get"):
        return False
    entry = caches.get(device)
    return entry is None or not entry[0]


def warm_up(launches: list[Launch], module) -> int:
    """Compile a call's kernels side by side when this process has compiled none of them yet.
    Left to triton's JIT, the first call compiles them one after another at their launches, each
    kernel and then its C launcher (a gcc run); side by side, a cold first call at 2.7b 1x2048
    took 3.5 s instead of 5.4 s on a slow host (BENCHMARKS.md §56): the compilers' subprocesses
    (ptxas, gcc) overlap, the Python front end does not. Nothing is
    launched here; each thread compiles (JITFunction.warmup) and loads (_init_handles) one
    kernel, and the launches that follow find them compiled. Returns how many were compiled."""
    if interpreting() or len(launches) < 2 or torch.cuda.is_current_stream_capturing():
        return 0
    device = torch.cuda.current_device()   # what triton's driver reports (CUDA and ROCm)
    cold = [ln for ln in launches if _never_compiled(getattr(module, ln.kernel), device)]
    if len(cold) < 2:
        return 0

    def one(ln):
        with torch.cuda.device(device):   # a new thread starts on device 0
            ck = getattr(module, ln.kernel).warmup(**ln.args, **ln.constexprs, **ln.options, grid=ln.grid)
            ck._init_handles()

    with ThreadPoolExecutor(len(cold), thread_name_prefix="autossd-compile") as ex:
        list(ex.map(one, cold))   # re-raises a compile error here, as the launch would
    return len(cold)


def varlen_states(prob, config, t, buf, cu_seqlens) -> torch.Tensor:
    """States at the last token of each packed sequence (batch 1): the state entering that
    token's chunk, decayed, plus the chunk's tokens of the same sequence up to it.
    cu_seqlens's values stay on the GPU (reading them would cost a synchronization per call), so
    they are not checked on the host. Indices are clamped into the sequence, so a malformed
    cu_seqlens never reads out of bounds (no device-side assert); then every state is NaN
    (malformed: an entry below 0 or past seqlen, or decreasing). Padding before the first or
    after the last sequence is allowed, as in mamba_ssm. An empty sequence's state is 0."""
    q = config.chunk_size
    h, g = prob.nheads, prob.ngroups
    cu = cu_seqlens.long()
    malformed = (cu[0] < 0) | (cu[-1] > prob.seqlen) | (cu[1:] < cu[:-1]).any()
    empty = cu[1:] <= cu[:-1]                                          # (s,)
    ends = (cu[1:] - 1).clamp(0, prob.seqlen - 1)                     # (s,)
    chunk = ends // q
    pos = torch.arange(q, device=ends.device)
    tok = chunk[:, None] * q + pos[None, :]                            # (s, q)
    valid = (pos[None, :] <= (ends - chunk * q)[:, None]) & (tok < prob.seqlen)
    tokc = tok.clamp(max=prob.seqlen - 1)
    seq = t["seq_idx"][0].long()
    same = valid & (seq[tokc] == seq[ends][:, None])
    dA = buf.dA[0][:, chunk].permute(1, 0, 2)                          # (s, h, q)
    dt = buf.dt[0][:, chunk].permute(1, 0, 2)
    dA_end = torch.gather(dA, 2, (ends - chunk * q)[:, None, None].expand(-1, h, 1))  # (s, h, 1)
    w = torch.where(same[:, None, :], torch.exp(dA_end - dA) * dt, 0.0)  # (s, h, q)
    xs = t["x"][0][tokc].float()                                       # (s, q, h, p)
    bs = t["B"][0][tokc].float().repeat_interleave(h // g, dim=2)      # (s, q, h, n)
    local = torch.einsum("shq,sqhp,sqhn->shpn", w, xs, bs)
    prev_tok = (chunk * q - 1).clamp(min=0)
    carry = (seq[ends] == seq[prev_tok]).float()[:, None, None, None]
    prev = buf.states[0][chunk].float()                                # (s, h, p, n)
    out = local + carry * torch.exp(dA_end)[..., None] * prev
    out = torch.where(empty[:, None, None, None], 0.0, out)
    return torch.where(malformed, float("nan"), out)


def ssd_forward(x, dt, A, B, C, chunk_size=256, D=None, z=None, dt_bias=None, initial_states=None,
                seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                return_final_states=False, return_varlen_states=False, state_dtype=None,
                config: Config | None = None, backend: str = "cuda", poison: bool = False):
    """Validate, pick the config (the given one, else the arch default), and run the five
    stages. Returns y, or a tuple with final_states / varlen_states as mamba_ssm does."""
    from ...space import default_config
    prob = _problem.from_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                              cu_seqlens, dt_softplus, dt_limit, return_final_states,
                              return_varlen_states, state_dtype)
    if config is None:
        config = default_config("gfx942" if backend == "hip" else "sm90", prob)
    # by value, as the drop-in does: the launch cache keys on it, and a 0-d tensor changed in
    # place would otherwise replay its old value
    dt_limit = tuple(float(v) for v in dt_limit)
    t = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
             seq_idx=seq_idx)
    return forward_only(lambda: execute(prob, config, t, cu_seqlens=cu_seqlens, dt_limit=dt_limit,
                                        state_dtype=state_dtype, backend=backend, poison=poison,
                                        keep=True), t)


# --- launch cache -------------------------------------------------------------------------
# A call's launches depend only on the problem, the config and the inputs' dtypes, strides and
# 16-byte alignment (what triton specializes on); buffers (fresh or kept) are whole allocations of
# the same shapes, always aligned.
# The first call of such a key goes through triton's JIT (which compiles and returns the compiled
# kernels) and records, per launch, the compiled kernel and where each argument comes from; later
# calls fill in the tensors and launch the compiled kernels directly, skipping the plan (~50 us)
# and triton's per-launch binding (~30 us of ~40 arguments each), measured on the H100 host.
INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")
_BUFFERS = ("y", "dt", "dA", "cb", "states", "final", "sync", "w", "gam", "gseg", "seg", "sen")
_launch_cache: dict[tuple, list] = {}
LAUNCH_CACHE_MAX = 4096   # recorded calls kept (one per sequence length and config); then start over
_fast = os.environ.get("AUTOSSD_FAST_LAUNCH", "1") != "0"


def remember(cache: dict, key, value, limit: int) -> None:
    """cache[key] = value, starting the cache over once it holds `limit` entries (a server sees
    every prompt length: the per-call caches must not grow without bound)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value


def input_sig(t: dict) -> tuple:
    """What a launch specializes on, per input: dtype, shape, strides, device, 16-byte alignment,
    and the aliasing pattern (a record made when B is C must not serve a call where they
    differ). A few µs: the drop-in also keys its cache of validated calls on it
    (runtime._forward). Raises AttributeError for a non-tensor input."""
    out = []
    seen = {}
    for k in INPUTS:
        v = t.get(k)
        if v is None:
            out.append(None)
            continue
        out.append((v.dtype, v.shape, v.stride(), v.device, v.data_ptr() % 16 == 0,
                    seen.setdefault(id(v), len(out))))
    return tuple(out)


def _record(launches: list[Launch], compiled: list, t: dict, buf: Buffers, module) -> list:
    """Per launch: (compiled kernel, grid, argument sources in the kernel's parameter order,
    the argument list with every constant in place and None for each pointer, and the pointers'
    (position, from an input?, name, TMA descriptor or None)), and its _DirectLaunch where one can
    be made: a replay copies the list and fills in only the pointers."""
    ids = {id(v): ("in", k) for k in INPUTS if (v := t.get(k)) is not None}
    ids.update({id(v): ("buf", k) for k in _BUFFERS if (v := getattr(buf, k)) is not None})
    out = []
    for ln, ck in zip(launches, compiled):
        values = {**ln.args, **ln.constexprs}
        srcs = []
        descs = {}   # position -> the TMA descriptor recorded there (its base is replaced per call)
        for name in getattr(module, ln.kernel).arg_names:
            v = values[name]
            if isinstance(v, torch.Tensor):
                srcs.append(ids[id(v)])
            elif isinstance(v, _TMA_DESCRIPTORS):
                descs[len(srcs)] = v
                srcs.append(ids[id(v.base)])
            else:
                srcs.append(("const", v))
        ck._init_handles()  # loads the module once, so the replay can take ck.function directly
        template = [k if kind == "const" else None for kind, k in srcs]
        slots = tuple((i, kind == "in", k, descs.get(i)) for i, (kind, k) in enumerate(srcs) if kind != "const")
        direct = _DirectLaunch.of(ck, template, slots)
        out.append((ck, tuple(ln.grid) + (1,) * (3 - len(ln.grid)), tuple(srcs), template, slots, direct))  # 3-D grid
    return out


def _tma_descriptor_types() -> tuple:
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:   # a triton without Gluon: no descriptor is ever planned
        return ()
    return (TensorDescriptor,)


_TMA_DESCRIPTORS = _tma_descriptor_types()


class _DescArg:
    """A recorded TMA descriptor on a new call's tensor: what triton's launcher reads of a
    descriptor argument (base, shape, strides, padding) to encode it at launch. The shapes and
    strides are the recorded call's: the launch-cache key (problem, input strides) fixes them."""
    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base, desc):
        self.base, self.shape, self.strides, self.padding = base, desc.shape, desc.strides, desc.padding


class _DirectLaunch:
    """A recorded kernel launched by the launcher's compiled entry point itself. triton's
    launcher (CudaLauncher) wraps that entry point in Python at every launch: the scratch
    allocations' closures (0.6 us a launch on a CPU here), and for a kernel that takes TMA
    descriptors an encoding of each one on the host (a driver call, cuTensorMapEncodeTiled):
    four per Gluon chunk scan, 13 us per eager call at 2.7b 1x2048 (BENCHMARKS §94). A recorded
    descriptor's shape, strides and block are fixed by the launch-cache key, so only its base
    address varies: each is encoded once per address (by triton's own encoder). `of` returns
    None where the launcher is not the one this was written against (HIP, another triton,
    scratch memory): the replay then goes through triton's launcher."""
    __slots__ = ("raw", "head", "template", "slots", "encode")
    KEEP = 8   # encodings kept per descriptor argument: a few caller buffers take turns

    def __init__(self, raw, head, template, slots, encode):
        self.raw, self.head, self.template, self.slots, self.encode = raw, head, template, slots, encode

    @classmethod
    def of(cls, ck, template: list, slots: tuple) -> "_DirectLaunch | None":
        run = ck.run
        if type(run).__name__ != "CudaLauncher" or getattr(run, "global_scratch_size", 1) \
                or getattr(run, "profile_scratch_size", 1):
            return None
        descs = {i: d for i, _, _, d in slots if d is not None}
        encode = getattr(sys.modules.get(type(run).__module__), "make_tensordesc_arg", None)
        wrapper = run.launch   # the entry point, or triton's wrap_handle_tensordesc closure around it
        code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None) or ()
        free = dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code else {}
        if not descs:
            raw = wrapper   # what CudaLauncher.__call__ calls, less its scratch allocations (none)
        elif encode is None or "launcher" not in free or set(free.get("tensordesc_indices", ())) != set(descs):
            raw = None
        else:
            raw = free["launcher"]
        if raw is None:
            return None
        metas = iter(free.get("tensordesc_meta") or [None] * len(descs))
        xtemplate, at = [], {}
        for i, v in enumerate(template):   # descriptor i expands to [encoded, *its constant sizes]
            if i in descs:
                meta = next(metas)
                width = len(encode(_DescArg(descs[i].base, descs[i]), meta))   # the recorded call's
                at[i] = (len(xtemplate), width, meta)
                xtemplate.extend([None] * width)
            else:
                at[i] = (len(xtemplate), 1, None)
                xtemplate.append(v)
        # pointers, then descriptors (each with its encodings by address)
        xslots = (tuple((at[i][0], from_input, k) for i, from_input, k, d in slots if d is None),
                  tuple((at[i][0], at[i][1], from_input, k, d, at[i][2], {})
                        for i, from_input, k, d in slots if d is not None))
        head = (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None, ck.packed_metadata,
                None, None, None)   # scratch buffers (none), launch metadata and hooks (none)
        return cls(raw, head, xtemplate, xslots, encode)

    def __call__(self, grid: tuple, stream, t: dict, buf: Buffers) -> None:
        args = self.template.copy()
        ptrs, descs = self.slots
        for at, from_input, k in ptrs:
            args[at] = (t[k] if from_input else getattr(buf, k)).data_ptr()
        for at, width, from_input, k, desc, meta, enc in descs:
            v = t[k] if from_input else getattr(buf, k)
            ptr = v.data_ptr()
            e = enc.get(ptr) if meta is not None else None
            if e is None:
                e = self.encode(_DescArg(v, desc), meta)
                if meta is not None:   # an encoding holds the address only (without meta: the tensor)
                    if len(enc) >= self.KEEP:
                        enc.pop(next(iter(enc)), None)
                    enc[ptr] = e
            args[at:at + width] = e
        self.raw(grid[0], grid[1], grid[2], stream, *self.head, *args)


def _active(hook) -> bool:
    # triton 3.6 keeps an (empty) HookChain there, never None; earlier versions keep None
    return hook is not None and bool(getattr(hook, "calls", True))


def _replay(cached: list, t: dict, buf: Buffers, stream=None) -> None:
    """Launch recorded kernels on new inputs and buffers. Each launch calls the compiled kernel's
    launcher directly: the device and stream are looked up once per call instead of per launch,
    and pointers go as integers, which the launcher takes as they are (a tensor costs it a
    data_ptr() call and a driver query per pointer). The inputs were validated to be on one GPU
    (problem.from_args), which is the check that query would make. With a launch hook set (a
    profiler), the launch goes through triton's runner, which calls the hooks; without one, the
    launcher gets None for them and no per-launch metadata is built."""
    hooked = _active(knobs.runtime.launch_enter_hook) or _active(knobs.runtime.launch_exit_hook)
    if stream is None and not hooked:
        stream = driver.active.get_current_stream(driver.active.get_current_device())
    for ck, grid, srcs, template, slots, direct in cached:
        if direct is not None and not hooked:
            direct(grid, stream, t, buf)
            continue
        if hooked:
            args = [t[k] if kind == "in" else getattr(buf, k) if kind == "buf" else k for kind, k in srcs]
            for i, _, _, desc in slots:
                if desc is not None:
                    args[i] = _DescArg(args[i], desc)
            ck[grid](*args)
            continue
        args = template.copy()
        for i, from_input, k, desc in slots:
            v = t[k] if from_input else getattr(buf, k)
            args[i] = v.data_ptr() if desc is None else _DescArg(v, desc)
        ck.run(grid[0], grid[1], grid[2], stream, ck.function, ck.packed_metadata, None, None, None, *args)


_STATE_NAMES = {v: k for k, v in _TORCH_STATE.items()}
@functools.lru_cache(maxsize=LAUNCH_CACHE_MAX)
def _with_state_dtype(config: Config, name: str) -> Config:
    return config.replace(state_dtype=name)   # cached: Config.replace validates (~30 us)


def execute(prob, config, t, cu_seqlens=None, dt_limit=(0.0, float("inf")), state_dtype=None,
            backend="cuda", module=None, poison=False, keep=False, sig=None, capturing=None):
    """Run the forward's launches. keep: reuse the kept workspace of intermediates (eager
    callers only: torch.compile's CUDA-graph warm-up runs a custom op with its allocations in
    the graph's pool, not capturing, where a kept tensor would outlive the pool's bookkeeping).
    sig: `input_sig(t)` when the caller has it; capturing: whether the current stream captures,
    when the caller knows (each saves a few µs of host time per call)."""
    x = t["x"]
    device = x.device
    # a varlen-only call allocates `final` too, as it always has; only that case rebuilds the
    # Problem (its validation is a few us of host time per call)
    aprob = prob.replace(return_final_states=True) if prob.return_varlen_states and not prob.return_final_states else prob
    if state_dtype is not None and _STATE_NAMES[state_dtype] != config.state_dtype:
        # a caller's state_dtype (mamba_ssm's argument) is the precision the states are kept
        # in, not only their storage: the kernels round to the config's STATE_DTYPE
        config = _with_state_dtype(config, _STATE_NAMES[state_dtype])
        module = None
    module = module or load(config, backend)
    cpu = device.type == "cpu"   # the interpreter: no compiled kernels, no streams
    stream = None if cpu else driver.active.get_current_stream(driver.active.get_current_device())
    ws = None
    if capturing is None and keep and not cpu:
        capturing = torch.cuda.is_current_stream_capturing()
    if keep and not poison and (cpu or not capturing):
        ws = _workspace(prob, config, device, state_dtype, stream)
    if ws is None:
        return _execute(prob, config, t, allocate(aprob, config, device, state_dtype, poison), cu_seqlens,
                        dt_limit, state_dtype, backend, module, stream, sig)
    lock, kept = ws
    with lock:
        buf = Buffers(y=torch.empty(x.shape, dtype=x.dtype, device=device), dt=kept.dt, dA=kept.dA,
                      cb=kept.cb, states=kept.states, sync=kept.sync, w=kept.w,
                      gam=kept.gam, gseg=kept.gseg, seg=kept.seg, sen=kept.sen,
                      final=torch.empty(prob.batch, prob.nheads, prob.headdim, prob.dstate,
                                        dtype=torch.float32, device=device)
                      if aprob.return_final_states else kept.final)
        try:
            return _execute(prob, config, t, buf, cu_seqlens, dt_limit, state_dtype, backend, module, stream, sig)
        except BaseException:
            # a launch stopped part-way (an exception, a KeyboardInterrupt in the interpreter)
            # may leave the fused depths' ticket counter off its epoch: never reuse these words
            _forget_workspace((prob, config, device, state_dtype, stream))
            raise


def _execute(prob, config, t, buf, cu_seqlens, dt_limit, state_dtype, backend, module, stream, sig=None):
    fast = _fast and stream is not None
    if fast:
        key = (prob, config, backend, tuple(dt_limit), state_dtype, sig if sig is not None else input_sig(t))
    cached = _launch_cache.get(key) if fast else None
    if cached is not None:
        _replay(cached, t, buf, stream)
    else:
        launches = plan(prob, config, t, buf, backend, dt_limit)
        warm_up(launches, module)
        compiled = run(launches, module)
        if fast and all(c is not None for c in compiled):
            remember(_launch_cache, key, _record(launches, compiled, t, buf, module), LAUNCH_CACHE_MAX)
    if not (prob.return_final_states or prob.return_varlen_states):
        return buf.y
    out = (buf.y,)
    if prob.return_final_states:
        out += (buf.final,)
    if prob.return_varlen_states:
        out += (varlen_states(prob, config, t, buf, cu_seqlens),)
    return out
