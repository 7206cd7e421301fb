"""The SSD backward's fused mode (`cb = "fused"`): its launch, the shapes of the partial sums it
writes, and its cost for the static model. The kernel is templates/ssd_bwd/fused.jinja (its
docstring-comment holds the math); the other stages of the mode are the staged modes' own:

  gate, cumsum, chunk_state, state_passing     as the staged modes (recompute where needed)
  dstates, state_passing_rev                   G, the gradient wrt the state leaving each chunk
  dx (the fused kernel)                        per (batch, chunk, group, head split, block of
                                               source tokens): dx, the dt terms (ddir, dsx and the
                                               causal dap partials), dD partials, dB for the split
                                               (causal and state parts, summed over the split's
                                               heads on chip) and the split's dCB panel
  dc                                           dC from the dCB panels and the entering state's
                                               part (the staged dc kernel, unchanged)
  ddt                                          the fixed-order sums to dt, A, dt_bias

The split's partials (dB, dC over the splits; dap and dD over the source blocks) are summed in a
fixed order, so the gradients stay bitwise reproducible without atomics.
"""
from __future__ import annotations

import triton

from ...problem import DTYPE_BYTES
from .plan import Launch


def partial_slots(config, headdim: int) -> dict[str, int]:
    """How many partials of each per-token sum a mode writes: ddir (causal x·dx), dsx (the
    state's x·dx), dD's row blocks, and the causal dap partials (the dc stage's own follow)."""
    q = config.chunk_size
    if config.cb == "fused":
        nj = triton.cdiv(q, config.fused_block_s)
        return dict(ddir=1, dsx=1, rows=nj, dap=nj)
    return dict(ddir=triton.cdiv(q, config.dcb_block_m), dsx=triton.cdiv(headdim, config.dx_block_n),
                rows=triton.cdiv(q, config.dx_block_m), dap=triton.cdiv(q, config.dcb_block_k))


def _named(prefix, names, t):
    st = tuple(t.stride()) if t is not None else (0,) * len(names)
    return {f"{prefix}_{k}": s for k, s in zip(names, st)}


def fused_launch(prob, config, t: dict, buf, seq, D, opts: dict) -> Launch:
    """The fused kernel's launch (stage "dx"): grid (source blocks x head splits x groups,
    chunks, batch), source blocks fastest so that a chunk's programs run side by side and share
    its dy, C and G in L2."""
    q = config.chunk_size
    b, l, h, p, n, g = prob.batch, prob.seqlen, prob.nheads, prob.headdim, prob.dstate, prob.ngroups
    nc = triton.cdiv(l, q)
    nj = triton.cdiv(q, config.fused_block_s)
    x, B, C = t["x"], t["B"], t["C"]
    s_D = (0, 0) if D is None else (D.stride(0), D.stride(1) if D.dim() == 2 else 0)
    return Launch(
        "dx", "ssd_bwd_fused", (nj * config.group_split * g, nc, b),
        dict(x_ptr=x, dy_ptr=buf.dy, B_ptr=B, C_ptr=C, dt_ptr=buf.dt, dA_ptr=buf.dA, seq_ptr=seq, gst_ptr=buf.dst,
             D_ptr=D, dx_ptr=buf.dx, dcb_ptr=buf.dcb, dB_ptr=buf.dBp, ddir_ptr=buf.ddir, dsx_ptr=buf.dsx,
             dap_ptr=buf.dap, dD_ptr=buf.dDp, L=l, H=h, P=p, N=n, heads_per_group=h // g,
             **_named("s_x", "blhp", x), **_named("s_dy", "blhp", buf.dy), **_named("s_B", "blgn", B),
             **_named("s_C", "blgn", C),
             s_dt_b=buf.dt.stride(0), s_dt_h=buf.dt.stride(1), s_dt_c=buf.dt.stride(2),
             **_named("s_seq", ("b", "l"), seq), **_named("s_g", ("b", "c", "h", "p", "n"), buf.dst),
             s_D_h=s_D[0], s_D_p=s_D[1], **_named("s_dx", "blhp", buf.dx),
             **_named("s_cb", ("b", "c", "s", "g", "i", "j"), buf.dcb),
             **_named("s_o", ("b", "l", "s", "g", "n"), buf.dBp),
             **_named("s_dr", ("b", "h", "c"), buf.ddir), **_named("s_dd", ("b", "h", "c"), buf.dsx),
             **_named("s_da", ("b", "h", "c", "j"), buf.dap), **_named("s_dD", ("b", "c", "m", "h"), buf.dDp)),
        dict(HAS_SEQ=seq is not None, HAS_D=D is not None, D_HAS_HDIM=prob.D_has_hdim, NEED_DB=buf.dBp is not None,
             P2=max(16, triton.next_power_of_2(p)), N2=max(16, triton.next_power_of_2(n))),
        opts["dx"])


def fused_stage_costs(problem, config) -> list:
    """The fused mode's dx (fused), dc and ddt stages for the static model. The fused kernel:
    x, dy, B, C and G read once each (the chunk's re-reads by its source blocks are L2 hits),
    dx, dB's partials and dCB written; its products span the whole chunk's rows for each block
    (the masked half included): C·Bᵀ once per program, per head K = dy x_sᵀ, Mᵀ dy and the
    state's two (three at dx_g_split 2), and dCBᵀ C once per program."""
    from ...tuner.model import StageCost, _cdiv
    b, l, h, p, n, g = (problem.batch, problem.seqlen, problem.nheads, problem.headdim,
                        problem.dstate, problem.ngroups)
    q = config.chunk_size
    nc = _cdiv(l, q)
    e = DTYPE_BYTES[problem.dtype]
    gs = config.group_split
    nj = _cdiv(q, config.fused_block_s)
    x = b * l * h * p * e
    bc = b * l * g * n * e
    st = b * nc * h * p * n
    dcb = b * nc * g * gs * q * q * e
    mm = lambda m, k, nn: 2.0 * m * k * nn  # noqa: E731
    split = 1 if problem.dtype == "fp32" else config.dx_g_split
    bs = config.fused_block_s
    per_head = 2 * mm(q, p, bs) + (split + 1) * mm(bs, n, p)
    per_prog = 2 * mm(q, n, bs)
    fused = StageCost("dx", nj * gs * g * nc * b,
                      3 * x + 2 * bc + st * 4 + dcb + b * l * g * n * 4 * gs + 3 * b * h * nc * q * 4 * (nj + 2),
                      0.0, b * nc * nj * (h * per_head + g * gs * per_prog),
                      (q, bs, p), config.dx_stages)
    grid = nc * b * g * gs * _cdiv(q, config.dbc_block_m) * _cdiv(n, config.dbc_block_n)
    dc = StageCost("dc", grid, x + bc + st * 4 + dcb + b * l * g * n * 4 * gs, 0.0,
                   b * nc * (h * mm(q, p, n) + g * gs * mm(q, q, n) / 2),
                   (config.dbc_block_m, config.dbc_block_n, config.dbc_block_k), config.dbc_stages)
    ddt = StageCost("ddt", nc * _cdiv(h, config.cumsum_block_h) * b, b * l * h * 4 * (3 + nj), 0.0, 0.0)
    return [fused, dc, ddt]
