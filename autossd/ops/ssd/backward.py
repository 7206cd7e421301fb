"""The SSD backward's entry: `plan()` (which kernels one backward launches, with which grids and
arguments), `execute()` (allocate, launch, reduce the partial sums in a fixed order) and the
float64 reference gradients.

The stages, in order (templates/ssd_bwd; the op's declaration is ops/ssd/bwd.py):
  gate            (with z) dy' = dout·silu(z) and dz, from the ungated output y' recomputed by the forward
  cumsum          dt' and its within-chunk cumsum dA per (batch, head, chunk)       [recompute]
  chunk_state     each chunk's local state                                           [recompute]
  state_passing   the entering state of every chunk                                 [recompute]
  bmm             C·Bᵀ per (chunk, group)                                           [cb = "stage"]
  dstates         per chunk, the gradient wrt its entering state from its own outputs
  state_passing_rev  that gradient carried backwards over the chunks (with the final state's
                  gradient): the gradient wrt the state leaving each chunk, the initial state's
                  gradient, and the entering state's part of each chunk's last dA gradient
                  (on sm90 with rev_walk = 1, both stages as one Gluon walk: bwd_gluon.py)
  dx              dx, per token the state's part of x·dx (a part of d dt'), and dD's partial sums
                  (on sm90 with dx_gluon = 1, in Gluon: bwd_gluon.py)
  dcb             per (chunk, group) the causal products' gradient dCB = sum over heads of
                  dt'·decay·(dy·xᵀ), one partial per group split; per head the causal parts of
                  x·dx and of C·dC (the gradients wrt dt' and dA), from the same fp32 products
  db, dc          dB and dC per group: the state's part per head (looped in a fixed order) and
                  the causal part as one product with the group's dCB; the state's part of C·dC
  ddt             d dA summed to the chunk's end -> d dt', dA, d dt_bias, d dt
Nothing is accumulated with atomics: every cross-program sum is written as partials and added in
a fixed order, so the gradients are bitwise reproducible run to run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import SimpleNamespace

import torch
import triton

from ...core import select as _select
from ...render import launch_options, load
from ..common import launch_cache as _lc
from .chunk import run, warm_up
from .bwd_gluon import dcb_gluon, dcb_gluon_gaps, dx_gluon, dx_gluon_gaps, rev_walk, rev_walk_gaps, rev_walk_slots
from .bwd_knobs import STATE_DTYPES, BwdConfig, recompute_walk_modes, recompute_walk_violations
from .naive import ssd_chunked, ssd_recurrent
from .plan import Launch, _gluon_walk, walk_call_gaps

_TORCH_STATE = {k: getattr(torch, v) for k, v in STATE_DTYPES.items()}
GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _named(prefix, names, t):
    st = tuple(t.stride()) if t is not None else (0,) * len(names)
    return {f"{prefix}_{k}": s for k, s in zip(names, st)}


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(int(n)))


@dataclass
class Saved:
    """What the forward kept for the backward (save_states = 1): the entering state of every
    chunk (b, c, h, p, n), dt' and dA (b, h, c, q) fp32."""
    states: torch.Tensor
    dt: torch.Tensor
    dA: torch.Tensor


@dataclass
class BwdBuffers:
    dy: torch.Tensor          # gradient wrt the ungated output
    dz: torch.Tensor | None
    dt: torch.Tensor          # (b, h, c, q) fp32
    dA: torch.Tensor
    states: torch.Tensor      # (b, c, h, p, n) entering states
    cb: torch.Tensor | None   # (b, c, g, q, q) fp32, or the inputs' type (cb_dtype)
    dst: torch.Tensor         # (b, c, h, p, n) fp32, or the inputs' type (_dst_dtype)
    dlast: torch.Tensor       # (b, h, c, pass blocks) fp32
    dinit: torch.Tensor | None
    dx: torch.Tensor
    dcb: torch.Tensor         # (b, c, group_split, g, q, q): the group's dCB, one partial per split
    ddir: torch.Tensor        # (b, h, c, dcb row tiles, q) fp32: x·dx, the causal part
    dsx: torch.Tensor         # (b, h, c, headdim tiles, q) fp32: x·dx, the state's part
    dDp: torch.Tensor | None  # (b, c, row tiles, h, p) fp32
    dBp: torch.Tensor | None  # (b, l, group_split, g, n) fp32 (one split: B's type)
    dCp: torch.Tensor         # (b, l, group_split, g, n) fp32 (one split: C's type)
    dap: torch.Tensor         # (b, h, c, dcb column tiles + dstate tiles, q) fp32: C·dC
    ddt: torch.Tensor         # (b, l, h) in dt's dtype
    dAp: torch.Tensor         # (b, h, c) fp32
    dbp: torch.Tensor         # (b, h, c) fp32


def allocate(prob, config: BwdConfig, t: dict, dout, dfinal, need: set, saved: Saved | None,
             dy=None, dz=None, poison: bool = False, backend: str | None = None,
             dst_dtype: torch.dtype | None = None) -> BwdBuffers:
    """The backward's buffers. dst_dtype: the state gradients' type where the caller knows it
    already (a replay of a recorded call: its record's), else _dst_dtype decides."""
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    x, z, dt = t["x"], t.get("z"), t["dt"]
    dev = x.device
    f32 = torch.float32
    # poison (the tuner's gate): what the kernels write whole starts NaN, so an element they miss
    # shows up in its gradient
    e = ((lambda *s, dtype=f32: torch.full(s, float("nan"), dtype=dtype, device=dev)) if poison  # noqa: E731
         else (lambda *s, dtype=f32: torch.empty(*s, dtype=dtype, device=dev)))
    # the partial sums reduced after the kernels (over tiles, heads or positions) start at zero:
    # a tile or position a short chunk leaves unwritten must add nothing, and the GPU's caching
    # allocator hands back memory holding whatever it held (an H200 gave dA off by 1e292 at
    # one-token sequences with these uninitialized)
    # They are carved from one zeroed allocation: one fill instead of six (each a launch and
    # 10-20 us of host time per step), every part starting at a 16-byte boundary as a whole
    # allocation would (what the kernels, and the launch cache's records, assume)
    npb = triton.cdiv(p * n, config.pass_block)
    zshapes = dict(dlast=(b, h, nc, max(npb, rev_walk_slots(prob, config)) if config.rev_walk else npb),
                   ddir=(b, h, nc, triton.cdiv(q, config.dcb_block_m), q),
                   dsx=(b, h, nc, triton.cdiv(p, config.dx_block_n), q),
                   dap=(b, h, nc, triton.cdiv(q, config.dcb_block_k) + triton.cdiv(n, config.dbc_block_n), q),
                   dAp=(b, h, nc), dbp=(b, h, nc))
    padded = {k: -(-math.prod(v) // 4) * 4 for k, v in zshapes.items()}   # 4 fp32 = 16 bytes
    flat = torch.zeros(sum(padded.values()), dtype=f32, device=dev)
    zero, at = {}, 0
    for k, shape in zshapes.items():
        zero[k] = flat[at:at + math.prod(shape)].view(shape)
        at += padded[k]
    # dB and dC: one partial per group split, summed after in fp32; with one split the kernels
    # store the gradient itself, in the input's type (a store rounds as .to() would)
    split = config.group_split
    bc = lambda dtype: e(b, l, split, g, n, dtype=dtype if split == 1 else f32)  # noqa: E731
    if saved is None:
        states = e(b, nc, h, p, n, dtype=_TORCH_STATE[config.state_dtype])
        dtb, dAb = e(b, h, nc, q), e(b, h, nc, q)
    else:
        states, dtb, dAb = saved.states, saved.dt, saved.dA
    dy = dy if dy is not None else e(b, l, h, p, dtype=x.dtype) if z is not None else dout
    dinit = e(b, h, p, n) if "initial_states" in need else None
    return BwdBuffers(
        dy=dy,
        dz=dz if dz is not None else (e(*z.shape, dtype=z.dtype) if z is not None and "z" in need else None),
        dt=dtb, dA=dAb, states=states,
        cb=(e(b, nc, g, q, q, dtype=f32 if config.cb_dtype == "fp32" or x.dtype == f32
              else torch.promote_types(t["B"].dtype, t["C"].dtype))
            if config.cb == "stage" else None),
        # the reverse walk (rev_walk) writes one partial per row of each program's tile, the tl
        # stage one per block
        dst=e(b, nc, h, p, n, dtype=dst_dtype or _dst_dtype(prob, config, t, backend, SimpleNamespace(
            dy=dy, states=states, dinit=dinit, dlast=zero["dlast"],
            dst=torch.empty(b, nc, h, p, n, dtype=x.dtype, device="meta")))),
        dlast=zero["dlast"], dinit=dinit,
        dx=e(b, l, h, p, dtype=x.dtype),
        # dCB in the type its products take it in (B's and C's): the dB and dC stages round it
        # to that before their tensor-core products anyway
        dcb=e(b, nc, config.group_split, g, q, q, dtype=torch.promote_types(t["B"].dtype, t["C"].dtype)),
        ddir=zero["ddir"], dsx=zero["dsx"],
        # every element of these the kernels write (each tile of the grid, rows past the
        # sequence's end masked on both sides): no zero fill (dB's and dC's are 67 MB each at
        # mamba2-2.7b 8 x 2048 with the heads split in 8)
        dDp=e(b, nc, triton.cdiv(q, config.dx_block_m), h, p) if t.get("D") is not None else None,
        dBp=bc(t["B"].dtype) if "B" in need else None,
        dCp=bc(t["C"].dtype), dap=zero["dap"],
        ddt=e(b, l, h, dtype=dt.dtype), dAp=zero["dAp"], dbp=zero["dbp"])


def _dst_dtype(prob, config: BwdConfig, t: dict, backend: str | None, probe) -> torch.dtype:
    """The chunks' state gradients G (b, c, h, p, n): fp32, or the inputs' 16-bit type where the
    reverse Gluon walk writes them and every reader rounds them to that type before its product
    (dx with one 16-bit operand for G, dB): the same gradients bitwise, half of the backward's
    largest buffer (640 MiB at mamba2-2.7b 4 x 16384) and of its traffic. The tl stages' chain
    accumulates in G's buffer itself, so it keeps fp32 (a call the walk cannot take)."""
    x = t["x"]
    if (backend is None or not config.rev_walk or config.dx_g_split != 1
            or x.dtype not in (torch.bfloat16, torch.float16) or t["B"].dtype != x.dtype
            or rev_walk_gaps(prob, config, t, probe, backend)):
        return torch.float32
    return x.dtype


def _split_sum(part: torch.Tensor, dtype) -> torch.Tensor:
    """dB or dC from its (b, l, group split, g, n) partials: the one partial itself, already in the
    input's type, or the fp32 partials summed in a fixed order."""
    return part[:, :, 0] if part.shape[2] == 1 else part.sum(2).to(dtype)


def gate_launch(prob, t: dict, dout, dy, dz, opts: dict) -> Launch:
    """The gate's launch (with z): dy = dout·silu(z), and dz from the ungated output t["y_pre"]
    where dz is given."""
    z, yp = t["z"], t.get("y_pre")
    b, l, h, p = prob.batch, prob.seqlen, prob.nheads, prob.headdim
    return Launch("gate", "ssd_bwd_gate", (triton.cdiv(l, 32), h, b),
                  dict(dout_ptr=dout, z_ptr=z, yp_ptr=yp, dy_ptr=dy, dz_ptr=dz, L=l, P=p,
                       **_named("s_o", "blhp", dout), **_named("s_z", "blhp", z),
                       **_named("s_y", "blhp", yp), **_named("s_dy", "blhp", dy),
                       **_named("s_dz", "blhp", dz)),
                  dict(NEED_DZ=dz is not None, P2=_pow2(p)), opts["gate"])


def plan(prob, config: BwdConfig, t: dict, buf: BwdBuffers, backend: str = "cuda",
         dt_limit=(0.0, float("inf")), dout=None, dfinal=None, saved: bool = False,
         gated: bool = False) -> list[Launch]:
    """The launches of one backward. `t` maps input names to tensors (or None); t["y_pre"] is the
    ungated output where z's gradient is needed. gated: the gate already ran (buf.dy holds its
    output), so it is not among the launches."""
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    opts = launch_options(config, backend)
    dt, A, B, C = t["dt"], t["A"], t["B"], t["C"]
    D, z, bias, seq = t.get("D"), t.get("z"), t.get("dt_bias"), t.get("seq_idx")
    lo, hi = (float(v) for v in dt_limit)
    P2, N2 = _pow2(p), _pow2(n)
    dtb = dict(s_dt_b=buf.dt.stride(0), s_dt_h=buf.dt.stride(1), s_dt_c=buf.dt.stride(2))
    seq_s = _named("s_seq", ("b", "l"), seq)
    dt_in = dict(dt_ptr=dt, A_ptr=A, bias_ptr=bias, L=l, H=h, dt_lo=lo, dt_hi=hi,
                 s_dt_b=dt.stride(0), s_dt_l=dt.stride(1), s_dt_h=dt.stride(2), s_A_h=A.stride(0),
                 s_bias_h=bias.stride(0) if bias is not None else 0)
    dt_flags = dict(HAS_BIAS=bias is not None, SOFTPLUS=prob.dt_softplus, HAS_LIMIT=prob.has_dt_limit)
    st5 = _named("s_st", ("b", "c", "h", "p", "n"), buf.states)
    dy = buf.dy
    out = []
    if z is not None and not gated:
        out.append(gate_launch(prob, t, dout, dy, buf.dz, opts))
    if not saved:
        out.append(Launch("cumsum", "ssd_bwd_cumsum", (nc, triton.cdiv(h, config.cumsum_block_h), b),
                          dict(dt_out_ptr=buf.dt, dA_out_ptr=buf.dA, **{k: v for k, v in dt_in.items()},
                               s_o_b=buf.dt.stride(0), s_o_h=buf.dt.stride(1), s_o_c=buf.dt.stride(2)),
                          dt_flags, opts["cumsum"]))
        # reorder to the kernel's argument order
        a = out[-1].args
        out[-1].args = {k: a[k] for k in ("dt_ptr", "A_ptr", "bias_ptr", "dt_out_ptr", "dA_out_ptr", "L", "H",
                                          "dt_lo", "dt_hi", "s_dt_b", "s_dt_l", "s_dt_h", "s_A_h", "s_bias_h",
                                          "s_o_b", "s_o_h", "s_o_c")}
        out += _recompute_states(prob, config, t, buf, opts, backend, dtb, seq_s, st5)
    cb5 = _named("s_cb", ("b", "c", "g", "i", "j"), buf.cb)
    if config.cb == "stage":
        out.append(Launch("bmm", "ssd_bwd_bmm",
                          (triton.cdiv(q, config.bmm_block_m) * triton.cdiv(q, config.bmm_block_n) * g, nc, b),
                          dict(C_ptr=C, B_ptr=B, cb_ptr=buf.cb, L=l, G=g, N=n, **_named("s_C", "blgn", C),
                               **_named("s_B", "blgn", B), **cb5),
                          dict(N2=N2), opts["bmm"]))
    if config.rev_walk and not rev_walk_gaps(prob, config, t, buf, backend):
        out.append(rev_walk(prob, config, t, buf, dfinal))
    else:
        out += _state_grads_tl(prob, config, t, buf, opts, dtb, seq_s, st5, dfinal)
    if D is None:
        s_D = (0, 0)
    else:
        s_D = (D.stride(0), D.stride(1) if D.dim() == 2 else 0)
    g5 = _named("s_g", ("b", "c", "h", "p", "n"), buf.dst)
    if config.dx_gluon and not dx_gluon_gaps(prob, config, t, buf, backend):
        out.append(dx_gluon(prob, config, t, buf, (dtb["s_dt_b"], dtb["s_dt_h"], dtb["s_dt_c"]), s_D))
    else:
        out.append(_dx_tl(prob, config, t, buf, opts, dtb, seq_s, g5, cb5, s_D, N2))
    out += _dbc(prob, config, t, buf, opts, dtb, seq_s, st5, g5, P2, N2, backend)
    out.append(_ddt(prob, config, buf, dt_in, dt_flags, opts))
    return out


def _recompute_states(prob, config, t, buf, opts, backend, dtb, seq_s, st5) -> list[Launch]:
    """The launches that recompute every chunk's entering state into buf.states: the forward's
    Gluon walk where the config asks (recompute_walk = 1) and the call fits it, else the tl chunk
    state and state passing."""
    b, l, h, p, n = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate
    nc, hpg = triton.cdiv(l, config.chunk_size), h // prob.ngroups
    x, B, init, seq = t["x"], t["B"], t.get("initial_states"), t.get("seq_idx")
    has_seq = seq is not None
    if (config.recompute_walk and not recompute_walk_violations(config, prob)
            and not walk_call_gaps(prob, config.chunk_size, t, buf.states, None, backend)):
        # chunk 0's entering state stored too (FIRST_STORED = 0): dC reads every chunk's; no
        # final state (the walk stops at the last chunk's entering state)
        walk_cfg = SimpleNamespace(chunk_size=config.chunk_size, **recompute_walk_modes(config))
        walk_buf = SimpleNamespace(states=buf.states, final=None, dt=buf.dt, dA=buf.dA)
        return [_gluon_walk(prob, walk_cfg, t, walk_buf, (dtb["s_dt_b"], dtb["s_dt_h"], dtb["s_dt_c"]),
                            bn=walk_cfg.walk_bn)]
    out = []
    grid_st = (triton.cdiv(p, config.state_block_m) * triton.cdiv(n, config.state_block_n) * h, nc, b)
    out.append(Launch("chunk_state", "ssd_bwd_chunk_state", grid_st,
                      dict(x_ptr=x, B_ptr=B, dt_ptr=buf.dt, dA_ptr=buf.dA, seq_ptr=seq, st_ptr=buf.states,
                           L=l, H=h, P=p, N=n, heads_per_group=hpg, **_named("s_x", "blhp", x),
                           **_named("s_B", "blgn", B), **dtb, **seq_s, **st5),
                      dict(HAS_SEQ=has_seq), opts["chunk_state"]))
    out.append(Launch("state_passing", "ssd_bwd_state_passing",
                      (triton.cdiv(p * n, config.pass_block), b * h),
                      dict(st_ptr=buf.states, dA_ptr=buf.dA, init_ptr=init, seq_ptr=seq,
                           L=l, H=h, N=n, PN=p * n, nchunks=nc,
                           s_st_b=st5["s_st_b"], s_st_c=st5["s_st_c"], s_st_h=st5["s_st_h"],
                           s_dA_b=buf.dA.stride(0), s_dA_h=buf.dA.stride(1), s_dA_c=buf.dA.stride(2),
                           **_named("s_init", ("b", "h", "p", "n"), init), **seq_s),
                      dict(HAS_INIT=init is not None, HAS_SEQ=has_seq),
                      opts["state_passing"]))
    return out


def _state_grads_tl(prob, config, t, buf, opts, dtb, seq_s, st5, dfinal) -> list[Launch]:
    """The tl dstates and reverse state-passing launches: each chunk's entering-state gradient from
    its own outputs, then the chain backwards over the chunks."""
    q = config.chunk_size
    b, l, h, p, n = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate
    nc, hpg = triton.cdiv(l, q), h // prob.ngroups
    C, seq, dy = t["C"], t.get("seq_idx"), buf.dy
    has_seq = seq is not None
    out = []
    d5 = _named("s_d", ("b", "c", "h", "p", "n"), buf.dst)
    out.append(Launch("dstates", "ssd_bwd_dstates",
                      (triton.cdiv(p, config.state_block_m) * triton.cdiv(n, config.state_block_n) * h, nc, b),
                      dict(dy_ptr=dy, C_ptr=C, dt_ptr=buf.dt, dA_ptr=buf.dA, seq_ptr=seq, dst_ptr=buf.dst,
                           L=l, H=h, P=p, N=n, heads_per_group=hpg, **_named("s_dy", "blhp", dy),
                           **_named("s_C", "blgn", C), **dtb, **seq_s, **d5),
                      dict(HAS_SEQ=has_seq), opts["dstates"]))
    out.append(Launch("state_passing_rev", "ssd_bwd_state_passing_rev",
                      (triton.cdiv(p * n, config.pass_block), b * h),
                      dict(dst_ptr=buf.dst, st_ptr=buf.states, dfin_ptr=dfinal,
                           dinit_ptr=buf.dinit, dlast_ptr=buf.dlast, dA_ptr=buf.dA, seq_ptr=seq,
                           L=l, H=h, N=n, PN=p * n, nchunks=nc,
                           s_d_b=d5["s_d_b"], s_d_c=d5["s_d_c"], s_d_h=d5["s_d_h"],
                           s_st_b=st5["s_st_b"], s_st_c=st5["s_st_c"], s_st_h=st5["s_st_h"],
                           **_named("s_df", ("b", "h", "p", "n"), dfinal),
                           **_named("s_di", ("b", "h"), buf.dinit),
                           **_named("s_dl", ("b", "h", "c"), buf.dlast),
                           s_dA_b=buf.dA.stride(0), s_dA_h=buf.dA.stride(1), s_dA_c=buf.dA.stride(2), **seq_s),
                      dict(HAS_DFINAL=dfinal is not None, HAS_DINIT=buf.dinit is not None, HAS_SEQ=has_seq),
                      opts["state_passing_rev"]))
    return out


def _dx_tl(prob, config, t, buf, opts, dtb, seq_s, g5, cb5, s_D, N2) -> Launch:
    """The tl dx kernel's launch (dx.jinja)."""
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc, hpg = triton.cdiv(l, q), h // g
    x, B, C, D, seq = t["x"], t["B"], t["C"], t.get("D"), t.get("seq_idx")
    dy = buf.dy
    return Launch("dx", "ssd_bwd_dx",
                  (triton.cdiv(q, config.dx_block_m) * triton.cdiv(p, config.dx_block_n) * h, nc, b),
                  dict(x_ptr=x, dy_ptr=dy, B_ptr=B, C_ptr=C, cb_ptr=buf.cb, dt_ptr=buf.dt, dA_ptr=buf.dA,
                       seq_ptr=seq, gst_ptr=buf.dst, D_ptr=D, dx_ptr=buf.dx, dsx_ptr=buf.dsx,
                       dD_ptr=buf.dDp,
                       L=l, H=h, P=p, N=n, heads_per_group=hpg,
                       **_named("s_x", "blhp", x), **_named("s_dy", "blhp", dy),
                       **_named("s_B", "blgn", B), **_named("s_C", "blgn", C), **cb5, **dtb, **seq_s, **g5,
                       s_D_h=s_D[0], s_D_p=s_D[1], **_named("s_dx", "blhp", buf.dx),
                       **_named("s_dd", ("b", "h", "c", "j"), buf.dsx),
                       **_named("s_dD", ("b", "c", "m", "h"), buf.dDp)),
                  dict(HAS_SEQ=seq is not None, HAS_D=D is not None, D_HAS_HDIM=prob.D_has_hdim, N2=N2),
                  opts["dx"])


def _dbc(prob, config, t, buf, opts, dtb, seq_s, st5, g5, P2, N2, backend) -> list[Launch]:
    """The launches of dCB (with the causal parts of the dt and dA gradients), dB and dC."""
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc, hpg = triton.cdiv(l, q), h // g
    x, B, C, seq = t["x"], t["B"], t["C"], t.get("seq_idx")
    has_seq, dy = seq is not None, buf.dy
    out = []
    dcb6 = _named("s_cb", ("b", "c", "s", "g", "i", "j"), buf.dcb)
    dd4 = _named("s_dd", ("b", "h", "c", "j"), buf.ddir)
    da4 = _named("s_da", ("b", "h", "c", "j"), buf.dap)
    nj = triton.cdiv(q, config.dcb_block_k)
    if config.dcb_gluon and not dcb_gluon_gaps(prob, config, t, buf, backend):
        out.append(dcb_gluon(prob, config, t, buf, (dtb["s_dt_b"], dtb["s_dt_h"], dtb["s_dt_c"])))
    else:
        out.append(Launch("dcb", "ssd_bwd_dcb",
                          (triton.cdiv(q, config.dcb_block_m) * nj * config.group_split * g, nc, b),
                          dict(x_ptr=x, dy_ptr=dy, B_ptr=B, C_ptr=C, dt_ptr=buf.dt, dA_ptr=buf.dA, seq_ptr=seq,
                               dcb_ptr=buf.dcb, ddir_ptr=buf.ddir, dap_ptr=buf.dap, L=l, H=h, P=p, N=n,
                               heads_per_group=hpg, **_named("s_x", "blhp", x), **_named("s_dy", "blhp", dy),
                               **_named("s_B", "blgn", B), **_named("s_C", "blgn", C), **dtb, **seq_s, **dcb6,
                               **dd4, **da4),
                          dict(HAS_SEQ=has_seq, P2=P2, N2=N2), opts["dcb"]))
    grid_bc = (triton.cdiv(q, config.dbc_block_m) * triton.cdiv(n, config.dbc_block_n) * config.group_split * g,
               nc, b)
    if buf.dBp is not None:
        out.append(Launch("db", "ssd_bwd_db", grid_bc,
                          dict(x_ptr=x, dcb_ptr=buf.dcb, C_ptr=C, dt_ptr=buf.dt, dA_ptr=buf.dA, seq_ptr=seq,
                               gst_ptr=buf.dst, dB_ptr=buf.dBp, L=l, H=h, P=p, N=n, heads_per_group=hpg,
                               **_named("s_x", "blhp", x), **dcb6,
                               **_named("s_C", "blgn", C), **dtb, **seq_s, **g5,
                               **_named("s_o", ("b", "l", "s", "g", "n"), buf.dBp)),
                          dict(HAS_SEQ=has_seq, P2=P2), opts["db"]))
    out.append(Launch("dc", "ssd_bwd_dc", grid_bc,
                      dict(dy_ptr=dy, dcb_ptr=buf.dcb, B_ptr=B, C_ptr=C, dA_ptr=buf.dA, seq_ptr=seq,
                           st_ptr=buf.states, dC_ptr=buf.dCp, dap_ptr=buf.dap, L=l, H=h, P=p, N=n,
                           heads_per_group=hpg, NJ=nj, **_named("s_dy", "blhp", dy), **dcb6,
                           **_named("s_B", "blgn", B), **_named("s_C", "blgn", C), **dtb, **seq_s, **st5,
                           **_named("s_o", ("b", "l", "s", "g", "n"), buf.dCp), **da4),
                      dict(HAS_SEQ=has_seq, P2=P2), opts["dc"]))
    return out


def _ddt(prob, config, buf, dt_in, dt_flags, opts) -> Launch:
    """The ddt launch: d dA summed to the chunk's end -> d dt', dA, d dt_bias, d dt."""
    nc = triton.cdiv(prob.seqlen, config.chunk_size)
    return Launch("ddt", "ssd_bwd_ddt", (nc, triton.cdiv(prob.nheads, config.cumsum_block_h), prob.batch),
                  dict(**{k: dt_in[k] for k in ("dt_ptr", "A_ptr", "bias_ptr")},
                       ddir_ptr=buf.ddir, dsx_ptr=buf.dsx, dap_ptr=buf.dap,
                       dlast_ptr=buf.dlast, ddt_ptr=buf.ddt, dAp_ptr=buf.dAp, dbp_ptr=buf.dbp,
                       **{k: dt_in[k] for k in ("L", "H", "dt_lo", "dt_hi")},
                       NDT=buf.ddir.shape[3], NPT=buf.dsx.shape[3], NNT=buf.dap.shape[3], NPB=buf.dlast.shape[3],
                       **{k: dt_in[k] for k in ("s_dt_b", "s_dt_l", "s_dt_h", "s_A_h", "s_bias_h")},
                       **_named("s_dr", ("b", "h", "c", "j"), buf.ddir),
                       **_named("s_dd", ("b", "h", "c", "j"), buf.dsx),
                       **_named("s_da", ("b", "h", "c", "j"), buf.dap),
                       **_named("s_dl", ("b", "h", "c"), buf.dlast),
                       **_named("s_g", ("b", "l", "h"), buf.ddt),
                       s_p_b=buf.dAp.stride(0), s_p_h=buf.dAp.stride(1)),
                  dt_flags, opts["ddt"])


# --- launch cache -------------------------------------------------------------------------------
# As the forward's (chunk.py): a backward's launches depend only on the problem, the config, the
# gradients asked for and the tensors' dtypes, shapes, strides and alignment (its buffers are whole
# allocations whose shapes follow from those). The first call of such a key plans and launches
# through triton's JIT and is recorded; later calls allocate their buffers and replay the recorded
# launches on them. At mamba2-2.7b 8 x 2048 on an H200 a training step issued its launches in
# 3.4 ms of host time against 2.4 ms of GPU time: the plan and triton's per-launch binding of
# 30-odd arguments for each of a dozen launches were most of it.
BWD_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx", "y_pre",
              "dout", "dfinal", "saved_states", "saved_dt", "saved_dA")
_BWD_BUFFERS = tuple(f.name for f in fields(BwdBuffers))
_GATE_BUFFERS = ("dy", "dz")
_launch_cache: dict[tuple, tuple] = {}
LAUNCH_CACHE_MAX = 1024   # recorded calls kept (one per training shape and config); then start over


@_select.on_clear
def clear_launch_cache() -> None:
    """Forget the recorded calls."""
    _launch_cache.clear()


def _launch(launches: list[Launch], module, key, ti: dict, buf, buffers: tuple):
    """Plain launches (compiling side by side what this process has not compiled yet); their
    record for `key`'s replays, or None where nothing is recorded."""
    warm_up(launches, module)
    compiled = run(launches, module)
    if key is None or any(c is None for c in compiled):
        return None
    return _lc.record(launches, compiled, ti, buf, module, BWD_INPUTS, buffers)


def _launch_all(prob, config: BwdConfig, t: dict, dout, dfinal, need: set, dt_limit, saved: Saved | None,
                backend: str, module, drop_y_pre: bool, poison: bool) -> BwdBuffers:
    """Allocate the backward's buffers and launch it: the call's record replayed where one is
    kept (on a GPU, the launch cache on), else planned, launched through triton's JIT and
    recorded. The gate (with y_pre to drop) runs first, on buffers of its own, so that y_pre is
    freed before the rest are allocated."""
    x = t["x"]
    ti = dict(t, dout=dout, dfinal=dfinal)   # every tensor a launch may take, by name
    if saved is not None:
        ti.update(saved_states=saved.states, saved_dt=saved.dt, saved_dA=saved.dA)
    stream = _lc.replay_stream(x.device)
    key = None if stream is None else (prob, config, backend, tuple(float(v) for v in dt_limit), frozenset(need),
                                       drop_y_pre, poison, _lc.input_sig(ti, BWD_INPUTS))
    cached = _launch_cache.get(key) if key is not None else None
    gate_rec = None
    dy = dz = None
    if drop_y_pre and t.get("z") is not None and t.get("y_pre") is not None:
        # the gate first, and the ungated output (as large as x) freed before the backward's
        # other buffers are allocated, so it does not add to the peak: mamba2-2.7b 4 x 16384
        # bf16 holds 640 MiB less at its peak
        dy = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dz = torch.empty_like(t["z"], memory_format=torch.contiguous_format) if "z" in need else None
        gbuf = SimpleNamespace(dy=dy, dz=dz)
        if cached is not None:
            _lc.replay(cached[0], ti, gbuf, stream)
        else:
            gate_rec = _launch([gate_launch(prob, t, dout, dy, dz, launch_options(config, backend))], module, key,
                               ti, gbuf, _GATE_BUFFERS)
        del t["y_pre"], ti["y_pre"], gbuf
    # a replay takes its record's state-gradient type: the same key decides it the same way, and
    # the check (the reverse walk's gaps) costs host time on every call
    buf = allocate(prob, config, t, dout, dfinal, need, saved, dy, dz, poison, backend,
                   cached[2] if cached is not None else None)
    if cached is not None:
        _lc.replay(cached[1], ti, buf, stream)
    else:
        rec = _launch(plan(prob, config, t, buf, backend, dt_limit, dout, dfinal, saved is not None, dy is not None),
                      module, key, ti, buf, _BWD_BUFFERS)
        if rec is not None and (gate_rec is not None or dy is None):
            _lc.remember(_launch_cache, key, (gate_rec, rec, buf.dst.dtype), LAUNCH_CACHE_MAX)
    return buf


def execute(prob, config: BwdConfig, t: dict, dout, dfinal=None, need=frozenset(GRAD_NAMES),
            dt_limit=(0.0, float("inf")), saved: Saved | None = None, backend: str = "cuda",
            module=None, drop_y_pre: bool = False, poison: bool = False) -> dict:
    """The gradients named in `need` (a dict name -> tensor, in each input's dtype) from the
    gradient wrt y (`dout`) and wrt the final states (`dfinal`, or None). t: the forward's inputs
    by name, and "y_pre", the ungated output, where z is given and its gradient needed.
    drop_y_pre: t holds the only reference to y_pre, which may go once the gate has read it."""
    need = set(need)
    if saved is not None and (saved.states.shape[1] != triton.cdiv(prob.seqlen, config.chunk_size)
                              or saved.dt.shape[-1] != config.chunk_size):
        saved = None   # kept at another chunk size: recompute
    if saved is None and config.save_states:
        # nothing kept (the forward's config keeps its states elsewhere, or a caller without a
        # forward, as the tuner): the module that recomputes them
        config, module = config.replace(save_states=0), None
    module = module or load(config, backend)
    buf = _launch_all(prob, config, t, dout, dfinal, need, dt_limit, saved, backend, module, drop_y_pre, poison)
    out = {}
    if "x" in need:
        out["x"] = buf.dx
    if "dt" in need:
        out["dt"] = buf.ddt
    if "A" in need:
        out["A"] = buf.dAp.sum((0, 2)).to(t["A"].dtype)
    if "B" in need:
        out["B"] = _split_sum(buf.dBp, t["B"].dtype)
    if "C" in need:
        out["C"] = _split_sum(buf.dCp, t["C"].dtype)
    if "D" in need and t.get("D") is not None:
        dD = buf.dDp.sum((0, 1, 2))
        out["D"] = (dD if t["D"].dim() == 2 else dD.sum(-1)).to(t["D"].dtype)
    if "z" in need and buf.dz is not None:
        out["z"] = buf.dz
    if "dt_bias" in need and t.get("dt_bias") is not None:
        out["dt_bias"] = buf.dbp.sum((0, 2)).to(t["dt_bias"].dtype)
    if "initial_states" in need and buf.dinit is not None:
        out["initial_states"] = buf.dinit.to(t["initial_states"].dtype)
    return out


def reference_bytes(b: int, l: int, h: int, p: int, n: int, chunk_size: int) -> int:
    """About what autograd through the chunked float64 reference holds at its peak: per head
    and chunk a dozen (q x q) float64 matrices and a few (p x n) states."""
    nc = -(-l // chunk_size)
    return b * nc * h * (12 * chunk_size * chunk_size + 6 * p * n) * 8


def reference(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
              dt_softplus=False, dt_limit=(0.0, float("inf")), dout=None, dfinal=None, recurrent=False,
              max_bytes: int | None = None) -> dict:
    """Float64 gradients of <dout, y> + <dfinal, final_states> wrt every input given, by autograd
    through the float64 reference forward (`naive.ssd_chunked`, or `ssd_recurrent`).
    max_bytes: where autograd would hold more (`reference_bytes`), the heads are taken a slice
    at a time (heads are independent but for B and C, whose gradients add up over a group's
    heads): the same gradients, with a fraction of the memory (codestral 1 x 65536 needs ~200 GB
    whole)."""
    b, l, h, p = x.shape
    if (max_bytes is not None and not recurrent and h > 1
            and reference_bytes(b, l, h, p, B.shape[-1], chunk_size) > max_bytes):
        return _reference_by_heads(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                                   dt_softplus, dt_limit, dout, dfinal, max_bytes)
    f64 = torch.float64
    given = {k: v for k, v in dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                                   initial_states=initial_states).items() if v is not None}
    leaves = {k: v.detach().to(f64).requires_grad_() for k, v in given.items()}
    kw = dict(D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
              initial_states=leaves.get("initial_states"), seq_idx=seq_idx, dt_softplus=dt_softplus,
              dt_limit=dt_limit)
    args = (leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"])
    y, final, _ = (ssd_recurrent(*args, **kw) if recurrent else ssd_chunked(*args, chunk_size, **kw))
    loss = (y * dout.to(f64)).sum()
    if dfinal is not None:
        loss = loss + (final * dfinal.to(f64)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return {k: (g if g is not None else torch.zeros_like(leaves[k])) for k, g in zip(leaves, grads)}


def _reference_by_heads(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
                        dt_limit, dout, dfinal, max_bytes) -> dict:
    """`reference` a slice of heads at a time: a slice lies inside one group, or is whole groups."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    per_head = reference_bytes(b, l, 1, p, n, chunk_size)
    k = max(1, min(h, max_bytes // per_head))
    k = (k // r) * r if k >= r else max(d for d in range(1, r + 1) if r % d == 0 and d <= k)
    parts: dict[str, list] = {}
    dB = torch.zeros(B.shape, dtype=torch.float64, device=B.device)
    dC = torch.zeros(C.shape, dtype=torch.float64, device=C.device)
    per_l = lambda v, hs: v[:, :, hs] if v is not None else None  # noqa: E731 - (b, l, h, ...) tensors
    for h0 in range(0, h, k):
        hs = slice(h0, h0 + k)
        gs = slice(h0 // r, -(-(h0 + k) // r))
        got = reference(per_l(x, hs), per_l(dt, hs), A[hs], B[:, :, gs], C[:, :, gs], chunk_size,
                        D[hs] if D is not None else None, per_l(z, hs), dt_bias[hs] if dt_bias is not None else None,
                        initial_states[:, hs] if initial_states is not None else None, seq_idx, dt_softplus,
                        dt_limit, per_l(dout, hs), dfinal[:, hs] if dfinal is not None else None)
        dB[:, :, gs] += got.pop("B")
        dC[:, :, gs] += got.pop("C")
        for name, v in got.items():
            parts.setdefault(name, []).append(v)
    dim = {"x": 2, "dt": 2, "z": 2, "initial_states": 1}
    out = {name: torch.cat(vs, dim=dim.get(name, 0)) for name, vs in parts.items()}
    out["B"], out["C"] = dB, dC
    return out


# --- the config (the autograd glue, autossd/grad.py, runs the backward) --------------------------
def config_for(prob, arch: str, device: str | None = None) -> BwdConfig:
    """The backward's config for a problem on an arch: a tuned ssd_bwd record where the lookup
    finds one (the records measured on `device`, a GPU's name, first), else the arch default
    (also where no store can be read: the default is always correct). Cached per process."""
    return _select.select("ssd_bwd", prob, arch, device, safe=True).config
