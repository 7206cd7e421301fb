"""The SSD backward's sm90 data paths, each the check of whether a call fits it and its launch:
dx in Gluon (templates/ssd_bwd/dx_gluon.jinja, the forward's chunk-walking scan run in reverse
time), dCB in Gluon (dcb_gluon.jinja, the tl stage's contract on wgmma tiles), and the reverse
walk (state_walk_rev_gluon.jinja, the forward's state walk run backwards over the chunks, in
place of the dstates and reverse state-passing stages). `backward.plan` takes each where the
config asks (dx_gluon = 1, dcb_gluon = 1, rev_walk = 1) and the call fits; each writes the
buffers of the tl stages it replaces."""
from __future__ import annotations

import triton

from .bwd_knobs import BwdConfig, dcb_gluon_violations, dx_gluon_violations
from .stage_knobs import gluon_problem_violations
from .plan import _INT32, Launch, _sm90_gaps, _tma_desc, _tma_view_gaps, strides


def dx_gluon_gaps(prob, config: BwdConfig, t: dict, buf, backend: str) -> list[str]:
    """Why this call cannot run the Gluon dx; empty when it can: the config's and problem's limits,
    an sm90 GPU, B and dy as TMA-addressable 2-D views, the staged C·Bᵀ a contiguous 16-bit
    buffer, coordinates in 32 bits. A call that cannot runs the tl dx of the same config, with
    the same result to rounding."""
    B, dy, x = t["B"], buf.dy, t["x"]
    q = config.chunk_size
    b, l, h, p, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.ngroups
    why = dx_gluon_violations(config, prob) + _sm90_gaps("the Gluon dx", x, backend)
    if why:
        return why
    why += _tma_view_gaps(prob, (("B", B, g * prob.dstate), ("dy", dy, h * p)))
    if buf.cb is None or not buf.cb.is_contiguous() or buf.cb.element_size() != 2 or buf.cb.dtype != dy.dtype:
        why.append("the staged C·Bᵀ must be a contiguous buffer in dy's 16-bit type")
    if B.dtype != dy.dtype:
        why.append(f"B ({B.dtype}) and dy ({dy.dtype}) must share a type")
    if not buf.dst.is_contiguous():
        why.append("the state gradients must be a contiguous buffer")
    if max(b * l, b * triton.cdiv(l, q) * g * q) >= _INT32:
        why.append("a TMA coordinate would pass 2**31")
    return why


def dcb_gluon_gaps(prob, config: BwdConfig, t: dict, buf, backend: str) -> list[str]:
    """Why this call cannot run the Gluon dCB; empty when it can: the config's and problem's
    limits, an sm90 GPU, C, B, dy and x as TMA-addressable 2-D views of one 16-bit type,
    coordinates in 32 bits. A call that cannot runs the tl dCB of the same config, with the same
    result to rounding."""
    B, C, dy, x = t["B"], t["C"], buf.dy, t["x"]
    b, l, h, p, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.ngroups
    why = dcb_gluon_violations(config, prob) + _sm90_gaps("the Gluon dCB", x, backend)
    if why:
        return why
    why += _tma_view_gaps(prob, (("C", C, g * prob.dstate), ("B", B, g * prob.dstate), ("dy", dy, h * p),
                                 ("x", x, h * p)))
    if len({B.dtype, C.dtype, dy.dtype, x.dtype}) > 1:
        why.append(f"B, C, dy and x must share a type, got {B.dtype}, {C.dtype}, {dy.dtype}, {x.dtype}")
    if b * l + config.chunk_size >= _INT32:   # row tiles run up to a chunk past the last token
        why.append("a TMA coordinate would pass 2**31")
    return why


def dcb_gluon(prob, config: BwdConfig, t: dict, buf, s_dt: tuple) -> Launch:
    """The Gluon dCB's launch: one program per (causal pair of 64-token tiles, heads split, group,
    chunk, batch)."""
    B, C, x, dy = t["B"], t["C"], t["x"], buf.dy
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc, T = triton.cdiv(l, q), q // 64
    tile = [64, 64]
    descs = dict(C_desc=_tma_desc(C, [b * l, g * n], C.stride(1), tile),
                 B_desc=_tma_desc(B, [b * l, g * n], B.stride(1), tile),
                 dy_desc=_tma_desc(dy, [b * l, h * p], dy.stride(1), tile),
                 x_desc=_tma_desc(x, [b * l, h * p], x.stride(1), tile))
    scb, sdd, sda = strides(buf.dcb, 6), strides(buf.ddir, 4), strides(buf.dap, 4)
    return Launch("dcb", "ssd_bwd_dcb_gluon", (T * (T + 1) // 2 * config.group_split * g, nc, b),
                  dict(**descs, dt_ptr=buf.dt, dA_ptr=buf.dA, dcb_ptr=buf.dcb, ddir_ptr=buf.ddir, dap_ptr=buf.dap,
                       L=l, heads_per_group=h // g,
                       s_dt_b=s_dt[0], s_dt_h=s_dt[1], s_dt_c=s_dt[2],
                       s_cb_b=scb[0], s_cb_c=scb[1], s_cb_s=scb[2], s_cb_g=scb[3], s_cb_i=scb[4], s_cb_j=scb[5],
                       s_dd_b=sdd[0], s_dd_h=sdd[1], s_dd_c=sdd[2], s_dd_j=sdd[3],
                       s_da_b=sda[0], s_da_h=sda[1], s_da_c=sda[2], s_da_j=sda[3]),
                  dict(N=n, P=p),
                  # one warpgroup, its ring in the template; dcb_maxnreg its register cap (not in the
                  # module's LAUNCH table, as for the Gluon dx)
                  _options(config.dcb_maxnreg))


def _options(maxnreg: int) -> dict:
    """A Gluon stage's launch options: one warpgroup, its ring in the template, and the register
    cap its knob gives (0: ptxas's choice)."""
    return dict(num_warps=4, num_stages=1, **({"maxnreg": maxnreg} if maxnreg else {}))


def dx_gluon(prob, config: BwdConfig, t: dict, buf, s_dt: tuple, s_D: tuple) -> Launch:
    """The Gluon dx's launch: one program per (64-wide headdim tile, head, chunk, batch)."""
    B, D = t["B"], t.get("D")
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    tile = [64, 64]
    x, dy = t["x"], buf.dy
    descs = dict(B_desc=_tma_desc(B, [b * l, g * n], B.stride(1), tile),
                 cb_desc=_tma_desc(buf.cb, [b * nc * g * q, q], q, tile),
                 dy_desc=_tma_desc(dy, [b * l, h * p], dy.stride(1), tile))
    sx, sg, sdx, sdd = strides(x, 4), strides(buf.dst, 5), strides(buf.dx, 4), strides(buf.dsx, 4)
    sdD = strides(buf.dDp, 5)
    return Launch("dx", "ssd_bwd_dx_gluon", ((p // 64) * h, nc, b),
                  dict(**descs, x_ptr=x, dt_ptr=buf.dt, dA_ptr=buf.dA, gst_ptr=buf.dst, D_ptr=D,
                       dx_ptr=buf.dx, dsx_ptr=buf.dsx, dD_ptr=buf.dDp,
                       L=l, H=h, P=p, G=g, heads_per_group=h // g,
                       s_x_b=sx[0], s_x_l=sx[1], s_x_h=sx[2], s_x_p=sx[3],
                       s_dt_b=s_dt[0], s_dt_h=s_dt[1], s_dt_c=s_dt[2],
                       s_g_b=sg[0], s_g_c=sg[1], s_g_h=sg[2], s_g_p=sg[3],
                       s_D_h=s_D[0], s_D_p=s_D[1],
                       s_dx_b=sdx[0], s_dx_l=sdx[1], s_dx_h=sdx[2], s_dx_p=sdx[3],
                       s_dd_b=sdd[0], s_dd_h=sdd[1], s_dd_c=sdd[2], s_dd_j=sdd[3],
                       s_dD_b=sdD[0], s_dD_c=sdD[1], s_dD_m=sdD[2], s_dD_h=sdD[3]),
                  dict(N=n, HAS_D=D is not None, D_HAS_HDIM=prob.D_has_hdim),
                  # one warpgroup, its ring in the template; dx_maxnreg its register cap. Not in the
                  # module's LAUNCH table: a row there would change every config's kernel hash and
                  # leave every record stale
                  _options(config.dx_maxnreg))


def rev_walk_tile(prob, config: BwdConfig) -> int:
    """The reverse walk's dstate tile: up to 128 (rev_walk = 1), 64 (rev_walk = 2)."""
    return min(prob.dstate, 64 if config.rev_walk == 2 else 128)


def rev_walk_slots(prob, config: BwdConfig) -> int:
    """The reverse walk's partials of each chunk's last dA gradient per (batch, head): one per row
    of each program's (64-row headdim tile, dstate tile)."""
    if prob.headdim % 64:
        return 0
    return 64 * (prob.headdim // 64) * triton.cdiv(prob.dstate, rev_walk_tile(prob, config))


def rev_walk_gaps(prob, config: BwdConfig, t: dict, buf, backend: str) -> list[str]:
    """Why this call cannot run the reverse Gluon walk (rev_walk = 1); empty when it can: the
    config's and problem's limits, an sm90 GPU, C and dy as TMA-addressable 2-D views, the state
    buffers contiguous, coordinates in 32 bits. A call that cannot runs the dstates and reverse
    state-passing stages of the same config."""
    C, dy, x = t["C"], buf.dy, t["x"]
    b, l, h, p, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.ngroups
    why = gluon_problem_violations("rev_walk=1", prob) + _sm90_gaps("the reverse Gluon walk", x, backend)
    if why:
        return why
    why += _tma_view_gaps(prob, (("C", C, g * prob.dstate), ("dy", dy, h * p)))
    if C.dtype != dy.dtype:
        why.append(f"C ({C.dtype}) and dy ({dy.dtype}) must share a type")
    if not (buf.dst.is_contiguous() and buf.states.is_contiguous()
            and (buf.dinit is None or buf.dinit.is_contiguous())):
        why.append("the states and their gradients must be contiguous buffers")
    if buf.dlast.shape[3] < rev_walk_slots(prob, config):
        why.append("the last-dA partials need a slot per row of each program's tile")
    if max(b * l, b * triton.cdiv(l, config.chunk_size) * h * p) >= _INT32:
        why.append("a TMA coordinate would pass 2**31")
    return why


def rev_walk(prob, config: BwdConfig, t: dict, buf, dfinal) -> Launch:
    """The reverse Gluon walk's launch: one program per (64-row headdim tile, dstate tile, head,
    batch), from the final state's gradient back to the initial state's."""
    C, dy = t["C"], buf.dy
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    bn = rev_walk_tile(prob, config)
    sst, sdf = strides(buf.states, 5), strides(dfinal, 4)
    sdi, sdl = strides(buf.dinit, 4), strides(buf.dlast, 4)
    nc = triton.cdiv(l, config.chunk_size)
    return Launch("state_passing_rev", "ssd_bwd_state_walk_rev", ((p // 64) * (n // bn), h, b),
                  dict(dy_desc=_tma_desc(dy, [b * l, h * p], dy.stride(1), [64, 64]),
                       C_desc=_tma_desc(C, [b * l, g * n], C.stride(1), [64, bn]),
                       dst_desc=_tma_desc(buf.dst, [b * nc * h * p, n], n, [64, bn]),
                       dA_ptr=buf.dA, st_ptr=buf.states, dfin_ptr=dfinal, dinit_ptr=buf.dinit,
                       dlast_ptr=buf.dlast, L=l, H=h, P=p, heads_per_group=h // g,
                       s_dA_b=buf.dA.stride(0), s_dA_h=buf.dA.stride(1), s_dA_c=buf.dA.stride(2),
                       s_st_b=sst[0], s_st_c=sst[1], s_st_h=sst[2], s_st_p=sst[3],
                       s_df_b=sdf[0], s_df_h=sdf[1], s_df_p=sdf[2], s_df_n=sdf[3],
                       s_di_b=sdi[0], s_di_h=sdi[1], s_dl_b=sdl[0], s_dl_h=sdl[1], s_dl_c=sdl[2]),
                  dict(N=n, BN=bn, HAS_DFINAL=dfinal is not None, HAS_DINIT=buf.dinit is not None,
                       EVEN_L=l % config.chunk_size == 0),
                  # one warpgroup, its ring in the template (not in the module's LAUNCH table, as
                  # dx's); rev_walk_maxnreg its register cap
                  _options(config.rev_walk_maxnreg))
