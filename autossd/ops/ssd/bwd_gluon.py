"""The SSD backward's sm90 data path: dx in Gluon (templates/ssd_bwd/dx_gluon.jinja, the forward's
chunk-walking scan run in reverse time), the check of whether a call fits it, and its launch.
`backward.plan` takes it in place of the tl dx kernel where the config asks (dx_gluon = 1) and
the call fits; the two write the same buffers."""
from __future__ import annotations

import triton

from .bwd_knobs import BwdConfig, dx_gluon_violations
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
                  # one warpgroup, its ring in the template. Not in the module's LAUNCH table: a
                  # row there would change every config's kernel hash and leave every record stale
                  dict(num_warps=4, num_stages=1))
