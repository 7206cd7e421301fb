"""Packed prefill's sm90 data path: the forward's Gluon walk and chunk-walking scan over the chunk
table (their packed form in templates/ssd/state_walk_gluon.jinja and chunk_scan_gluon.jinja), the
checks of whether a call fits them, and their launches. `varlen.plan` takes them in place of the
chunk-state, state-passing and chunk-scan stages where the config asks (state_walk = 1) and the
call fits."""
from __future__ import annotations

from .plan import _INT32, Launch, _sm90_gaps, _tma_desc, strides
from .varlen_knobs import VarlenConfig, VarlenProblem


def _view_gaps(views) -> list[str]:
    """Why these (name, tensor (tokens, k, m)) do not make TMA-addressable 2-D views (tokens,
    k * m): rows one stride apart, 16-byte aligned."""
    why = []
    for name, v in views:
        if not (v.stride(2) == 1 and v.stride(1) == v.shape[2] and v.stride(0) >= v.shape[1] * v.shape[2]
                and v.stride(0) * v.element_size() % 16 == 0 and v.data_ptr() % 16 == 0):
            why.append(f"{name}'s strides {tuple(v.stride())} do not make a TMA-addressable (tokens, "
                       f"{v.shape[1] * v.shape[2]}) view")
    return why


def gluon_gaps(problem: VarlenProblem, config: VarlenConfig, t: dict, backend: str) -> list[str]:
    """Why this call cannot run the Gluon walk and scan its config takes (state_walk = 1); empty
    when it can: an sm90 GPU, inputs (and y, which scan_gluon = 3 stores by TMA) TMA can address
    as 2-D views, coordinates in 32 bits. A call that cannot runs the tl stages of the same
    config, with the same result to rounding."""
    x, B, C, y = t["x"], t["B"], t["C"], t["out"]
    k, q, h, p, g = problem.chunks, problem.chunk_size, problem.nheads, problem.headdim, problem.ngroups
    why = _sm90_gaps("the Gluon walk and scan", x, backend)
    why += _view_gaps((("x", x), ("B", B), ("C", C)) + ((("out", y),) if config.scan_gluon == 3 else ()))
    if max(problem.tokens, k * h * p, k * g * q) >= _INT32:
        why.append("a TMA coordinate would pass 2**31")
    return why


def gluon_walk(problem: VarlenProblem, config: VarlenConfig, t: dict, buf: dict) -> Launch:
    """The Gluon walk over the chunk table (state_walk_gluon.jinja's packed form): one program per
    (64-row headdim tile, dstate tile of up to walk_bn, head, sequence), from the sequence's initial
    state through its chunks. It stores each chunk's entering state for the Gluon scan, every
    chunk's end state where `allocate` kept a buffer for them, and each sequence's final state."""
    x, B, init = t["x"], t["B"], t.get("initial_states")
    k, q, h, p, n, g = (problem.chunks, problem.chunk_size, problem.nheads, problem.headdim, problem.dstate,
                        problem.ngroups)
    bn, kb = min(n, config.walk_bn), min(q, config.walk_block)
    sen = buf["entering"]
    ends, fin, init_st = buf["states"], buf["final"], strides(init, 4)
    return Launch("state_walk", "ssd_state_walk", ((p // 64) * (n // bn), h, problem.seqs),
                  dict(x_desc=_tma_desc(x, [problem.tokens, h * p], x.stride(0), [kb, 64]),
                       B_desc=_tma_desc(B, [problem.tokens, g * n], B.stride(0), [kb, bn]),
                       st_desc=_tma_desc(sen, [k * h * p, n], n, [64, bn]),
                       dt_ptr=buf["dtp"], dA_ptr=buf["dA"], init_ptr=init, final_ptr=fin, end_ptr=ends,
                       cu_chunk_ptr=t["cu_chunk_seqlens"], last_chunk_ptr=t["last_chunk_indices"],
                       H=h, P=p, heads_per_group=h // g, s_dt_h=buf["dtp"].stride(0), s_dt_c=buf["dtp"].stride(1),
                       s_init_b=init_st[0], s_init_h=init_st[1], s_init_p=init_st[2], s_init_n=init_st[3],
                       s_fin_b=fin.stride(0), s_fin_h=fin.stride(1),
                       s_end_c=ends.stride(0) if ends is not None else 0,
                       s_end_h=ends.stride(1) if ends is not None else 0),
                  dict(N=n, BN=bn, HAS_INIT=init is not None, KEEP_ENDS=ends is not None, CHUNK=q, KB=kb),
                  # one warpgroup, its ring in the template (as the forward's walk)
                  dict(num_warps=4, num_stages=1))


def gluon_scan(problem: VarlenProblem, config: VarlenConfig, t: dict, buf: dict, opts: dict) -> Launch:
    """The chunk-walking Gluon scan over the chunk table (chunk_scan_gluon.jinja's packed form):
    one program per (64-wide headdim tile, head, chunk), from the entering state the walk
    stored. scan_gluon = 3 stores y's whole row tiles by TMA."""
    x, C, D, z, y = t["x"], t["C"], t.get("D"), t.get("z"), t["out"]
    k, q, h, p, n, g = (problem.chunks, problem.chunk_size, problem.nheads, problem.headdim, problem.dstate,
                        problem.ngroups)
    T, tile = problem.tokens, [64, 64]
    descs = dict(C_desc=_tma_desc(C, [T, g * n], C.stride(0), tile),
                 st_desc=_tma_desc(buf["entering"], [k * h * p, n], n, tile),
                 cb_desc=_tma_desc(buf["cb"], [k * g * q, q], q, tile),
                 x_desc=_tma_desc(x, [T, h * p], x.stride(0), tile))
    if config.scan_gluon == 3:
        descs["y_desc"] = _tma_desc(y, [T, h * p], y.stride(0), tile)
    s_z, s_D = strides(z, 3), strides(D, 2)
    return Launch("chunk_scan", "ssd_chunk_scan_gluon_chunk", ((p // 64) * h, k, 1),
                  dict(**descs, z_ptr=z, y_ptr=y, dt_ptr=buf["dtp"], dA_ptr=buf["dA"], D_ptr=D,
                       cu_chunk_ptr=t["cu_chunk_seqlens"], H=h, P=p, G=g, heads_per_group=h // g,
                       s_z_b=0, s_z_l=s_z[0], s_z_h=s_z[1], s_z_p=s_z[2],
                       s_y_b=0, s_y_l=y.stride(0), s_y_h=y.stride(1), s_y_p=y.stride(2),
                       s_dt_b=0, s_dt_h=buf["dtp"].stride(0), s_dt_c=buf["dtp"].stride(1),
                       s_D_h=s_D[0], s_D_p=s_D[1] if D is not None and D.dim() == 2 else 0),
                  dict(N=n, HAS_D=D is not None, D_HAS_HDIM=problem.D_has_hdim, HAS_Z=z is not None,
                       EVEN_L=False, FIRST_STATE=0, CHUNK=q),
                  # the forward's register cap for this kernel: three CTAs per SM (plan.py)
                  dict(opts["chunk_scan"], num_warps=4, maxnreg=168))
