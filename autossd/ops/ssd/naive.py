"""Float64 references for the SSD forward (the contract of mamba_ssm's mamba_chunk_scan_combined).

`ssd_recurrent` steps the recurrence token by token: the definition, slow, for short sequences.
`ssd_chunked` computes the same function chunk by chunk with dense PyTorch ops: fast enough for
production shapes on a GPU, and checked against `ssd_recurrent` in the tests.
Both return (y in float64, final_states, varlen_states) with the optional parts None when not asked.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

f64 = torch.float64


def process_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    dt = dt.to(f64)
    if dt_bias is not None:
        dt = dt + dt_bias.to(f64)
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    lo, hi = dt_limit
    if (lo, hi) != (0.0, float("inf")):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _seq_ends(cu_seqlens):
    return [int(v) - 1 for v in cu_seqlens[1:].tolist()]


def _finish(y, x, D, z):
    if D is not None:
        Dv = D.to(f64)
        y = y + x * (Dv[None, None, :, :] if Dv.dim() == 2 else Dv[None, None, :, None])
    if z is not None:
        zz = z.to(f64)
        y = y * zz * torch.sigmoid(zz)
    return y


def ssd_recurrent(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                  cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    b, l, h, p = x.shape
    g = B.shape[2]
    xx, AA = x.to(f64), A.to(f64)
    Bh = B.to(f64).repeat_interleave(h // g, dim=2)
    Ch = C.to(f64).repeat_interleave(h // g, dim=2)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    S = (initial_states.to(f64).clone() if initial_states is not None
         else torch.zeros(b, h, p, B.shape[3], dtype=f64, device=x.device))
    ends = set(_seq_ends(cu_seqlens)) if cu_seqlens is not None else set()
    varlen = []
    ys = []
    for t in range(l):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).to(f64)
            S = S * keep[:, None, None, None]
        decay = torch.exp(dtp[:, t] * AA)                                   # (b, h)
        S = decay[..., None, None] * S + (dtp[:, t, :, None] * xx[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, Ch[:, t]))
        if t in ends:
            varlen.append(S[0].clone())
    y = _finish(torch.stack(ys, dim=1), xx, D, z)
    return y, S, (torch.stack(varlen) if cu_seqlens is not None else None)


def ssd_chunked(x, dt, A, B, C, chunk_size=256, D=None, z=None, dt_bias=None, initial_states=None,
                seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                group_tokens=16384):
    """Chunked float64 form. `group_tokens` bounds the memory of the intra-chunk matrices."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    q = chunk_size
    nc = -(-l // q)
    pad = nc * q - l
    dev = x.device

    def chunks(t, fill=0.0):  # (b, l, ...) -> (b, nc, q, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad), value=fill) if pad else t
        return t.reshape(b, nc, q, *t.shape[2:])

    dtp = chunks(process_dt(dt, dt_bias, dt_softplus, dt_limit))      # (b,c,q,h), 0 in padding
    xx = chunks(x.to(f64)).reshape(b, nc, q, g, r, p)
    BB = chunks(B.to(f64))                                             # (b,c,q,g,n)
    CC = chunks(C.to(f64))
    if seq_idx is not None:
        last = seq_idx[:, -1:].expand(b, pad) if pad else seq_idx[:, :0]
        seq = torch.cat([seq_idx, last], dim=1).reshape(b, nc, q)
    else:
        seq = torch.zeros(b, nc, q, dtype=torch.int64, device=dev)
    dA = dtp * A.to(f64)
    cs = torch.cumsum(dA, dim=2)                                       # (b,c,q,h)
    cs_last = cs[:, :, -1]                                             # (b,c,h)
    same_last = (seq == seq[:, :, -1:]).to(f64)                        # (b,c,q)
    # local state of each chunk: tokens of the chunk's last sequence, decayed to its end
    w = torch.exp(cs_last[:, :, None] - cs) * dtp * same_last[..., None]   # (b,c,q,h)
    w = w.reshape(b, nc, q, g, r)
    local = torch.einsum("bcqgr,bcqgrp,bcqgn->bcgrpn", w, xx, BB).reshape(b, nc, h, p, n)
    # sequential pass over chunks
    S = (initial_states.to(f64).clone() if initial_states is not None
         else torch.zeros(b, h, p, n, dtype=f64, device=dev))
    prev_seq = seq[:, 0, 0]
    prev = torch.empty(b, nc, h, p, n, dtype=f64, device=dev)
    for c in range(nc):
        prev[:, c] = S
        keep = (seq[:, c, -1] == prev_seq).to(f64)                     # (b,)
        S = torch.exp(cs_last[:, c])[..., None, None] * S * keep[:, None, None, None] + local[:, c]
        prev_seq = seq[:, c, -1]
    final = S
    # output: inter-chunk term (from the state entering the chunk) + intra-chunk term
    seq_prev = torch.cat([seq[:, :1, 0], seq[:, :-1, -1]], dim=1)      # (b,c)
    y = torch.empty(b, nc, q, g, r, p, dtype=f64, device=dev)
    # slices of (sequences x chunks) of at most `group_tokens` tokens at 64 heads (fewer with more
    # heads): the (q x q) matrices of a slice are tokens x q x heads large, so a batch of long
    # sequences has to be cut along the batch as well as along its chunks
    budget = max(q, group_tokens * 64 // max(h, 1))
    bstep = max(1, min(b, budget // (nc * q)))
    step = nc if bstep > 1 or nc * q <= budget else max(1, budget // q)
    tri = torch.tril(torch.ones(q, q, dtype=torch.bool, device=dev))
    for b0, c0 in ((b0, c0) for b0 in range(0, b, bstep) for c0 in range(0, nc, step)):
        bs_ = slice(b0, min(b, b0 + bstep))
        sl = slice(c0, min(nc, c0 + step))
        nb = bs_.stop - b0
        inter_scale = torch.exp(cs[bs_, sl]) * (seq[bs_, sl] == seq_prev[bs_, sl, None]).to(f64)[..., None]
        pv = prev[bs_, sl].reshape(nb, -1, g, r, p, n)
        y_off = torch.einsum("bcqgn,bcgrpn->bcqgrp", CC[bs_, sl], pv)
        y_off = y_off * inter_scale.reshape(*inter_scale.shape[:3], g, r)[..., None]
        cb = torch.einsum("bcign,bcjgn->bcgij", CC[bs_, sl], BB[bs_, sl])
        ss = seq[bs_, sl]
        mask = tri & (ss[..., :, None] == ss[..., None, :])            # (b,c,i,j)
        csl = cs[bs_, sl].reshape(nb, -1, q, g, r)
        diff = csl.permute(0, 1, 3, 4, 2)[..., :, None] - csl.permute(0, 1, 3, 4, 2)[..., None, :]
        decay = torch.exp(torch.where(mask[:, :, None, None], diff, -torch.inf))  # (b,c,g,r,i,j)
        del diff
        dtj = dtp[bs_, sl].reshape(nb, -1, q, g, r).permute(0, 1, 3, 4, 2)[..., None, :]
        lmat = cb[:, :, :, None] * decay * dtj
        del decay
        y_diag = torch.einsum("bcgrij,bcjgrp->bcigrp", lmat, xx[bs_, sl])
        y[bs_, sl] = y_off + y_diag
    y = y.reshape(b, nc * q, h, p)[:, :l]
    y = _finish(y, x.to(f64), D, z)
    varlen = None
    if cu_seqlens is not None:
        states = []
        flat_cs = cs.reshape(b, nc * q, h)
        flat_dt = dtp.reshape(b, nc * q, h)
        flat_seq = seq.reshape(b, nc * q)
        for t_end in _seq_ends(cu_seqlens):
            c = t_end // q
            t0 = c * q
            sl = slice(t0, t_end + 1)
            keep = (flat_seq[0, sl] == flat_seq[0, t_end]).to(f64)
            wts = torch.exp(flat_cs[0, t_end] - flat_cs[0, sl]) * flat_dt[0, sl] * keep[:, None]  # (t,h)
            xs = x[0, sl].to(f64)
            bs = B[0, sl].to(f64).repeat_interleave(r, dim=1)
            st = torch.einsum("th,thp,thn->hpn", wts, xs, bs)
            if flat_seq[0, t_end] == seq_prev[0, c]:
                st = st + torch.exp(flat_cs[0, t_end])[:, None, None] * prev[0, c]
            states.append(st)
        varlen = torch.stack(states)
    return y, final, varlen


def state_update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                     state_batch_indices=None, pad_slot_id=-1):
    """Float64 decode step (the contract of `selective_state_update`), one or T tokens per row:
    returns (out, new_state) in float64 and leaves the inputs as they were.

    The Mamba-2 form: state (slots, h, p, n); x (b, h, p) or (b, T, h, p); dt like x or without
    p; A (h,) or (h, p, n), which may vary over p and n; B, C (b, g, n) or (b, T, g, n); D,
    dt_bias (h,) or (h, p); z like x. The Mamba-1 form (a 3-D state): state (slots, dim, n); x
    (b, dim) or (b, T, dim); dt, z like x; A (dim, n); B, C (b, n) or (b, T, n); D, dt_bias
    (dim,): the Mamba-2 form with one head of p = dim, out and new state in the Mamba-1 form.
    Row i updates slot state_batch_indices[i] (row i without them); a row at pad_slot_id keeps
    its slot and outputs 0, a row at any other index outside the state outputs NaN."""
    if state.dim() == 3:   # Mamba-1: every tensor given its head axis of one, then the outputs' dropped
        at = 1 if x.dim() == 2 else 2   # where the Mamba-2 form's head axis is

        def head(v, dims):   # a per-channel parameter or A without its head axis gets one
            return v if v is None or v.dim() == dims else v.unsqueeze(0)

        y, s = state_update_ref(state.unsqueeze(1), x.unsqueeze(at), dt.unsqueeze(at), head(A, 3),
                                B.unsqueeze(at), C.unsqueeze(at), head(D, 2),
                                None if z is None else z.unsqueeze(at), head(dt_bias, 2), dt_softplus,
                                state_batch_indices, pad_slot_id)
        return y.squeeze(at), s.squeeze(1)
    multi = x.dim() == 4
    xx = (x if multi else x.unsqueeze(1)).to(f64)                      # (b, T, h, p)
    bsz, T, h, p = xx.shape
    n = state.shape[-1]
    dd = dt.to(f64)
    if dd.dim() == (3 if multi else 2):                                # one dt per head
        dd = dd.unsqueeze(-1)
    dd = (dd if multi else dd.unsqueeze(1)).expand(bsz, T, h, p)
    if dt_bias is not None:
        bias = dt_bias.to(f64)
        dd = dd + (bias[:, None] if bias.dim() == 1 else bias)
    if dt_softplus:
        dd = torch.where(dd <= 20.0, F.softplus(dd), dd)
    AA = A.to(f64)
    AA = AA[:, None, None].expand(h, p, n) if AA.dim() == 1 else AA
    BB, CC = ((t if multi else t.unsqueeze(1)).to(f64) for t in (B, C))
    BB, CC = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (BB, CC))   # (b, T, h, n)
    if state_batch_indices is None:
        slots = torch.arange(bsz, device=x.device)
    else:
        slots = state_batch_indices.to(torch.int64)
    live = (slots >= 0) & (slots < state.shape[0]) & (slots != pad_slot_id)
    new_state = state.to(f64).clone()
    S = new_state[slots.clamp(0, state.shape[0] - 1)]                   # (b, h, p, n)
    ys = []
    for t in range(T):
        S = S * torch.exp(dd[:, t, :, :, None] * AA) + (dd[:, t] * xx[:, t])[..., None] * BB[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", S, CC[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        DD = D.to(f64)
        y = y + xx * (DD[:, None] if DD.dim() == 1 else DD)
    if z is not None:
        zz = (z if multi else z.unsqueeze(1)).to(f64)
        y = y * zz * torch.sigmoid(zz)
    pad = (slots == pad_slot_id)[:, None, None, None]
    y = torch.where(live[:, None, None, None], y, torch.where(pad, 0.0, float("nan")))
    new_state[slots[live]] = S[live]
    return (y if multi else y[:, 0]), new_state


def varlen_ref(x, dt, A, B, C, cu_chunk_seqlens, last_chunk_indices, seq_idx, D=None, z=None, dt_bias=None,
               initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """Float64 packed prefill (the contract of `autossd.ssd_varlen`): x (T, h, p), dt (T, h),
    B, C (T, g, n), a chunk table. Returns (y (T, h, p), final_states (seqs, h, p, n),
    chunk_states (nchunks, h, p, n)), float64. Each chunk runs `ssd_chunked` from the state the
    previous chunk of its sequence ended in (its sequence's initial state, or zero, for its
    first chunk): the chunk table's cut, computed independently of the kernels' algebra."""
    bounds = [int(v) for v in cu_chunk_seqlens.tolist()]
    seqs = [int(v) for v in seq_idx.tolist()]
    h, p = x.shape[1], x.shape[2]
    n = B.shape[2]
    nseq = last_chunk_indices.shape[0]
    dev = x.device

    def start(s):
        return (initial_states[s].to(f64).clone() if initial_states is not None
                else torch.zeros(h, p, n, dtype=f64, device=dev))
    final = torch.stack([start(s) for s in range(nseq)]) if nseq else torch.zeros(0, h, p, n, dtype=f64)
    y = torch.zeros(x.shape, dtype=f64, device=dev)
    chunk_states = torch.zeros(len(seqs), h, p, n, dtype=f64, device=dev)
    for c, s in enumerate(seqs):
        a, b = bounds[c], bounds[c + 1]
        S = final[s] if c > 0 and seqs[c - 1] == s else start(s)
        yc, Sc, _ = ssd_chunked(x[None, a:b], dt[None, a:b], A, B[None, a:b], C[None, a:b], 256, D=D,
                                z=None if z is None else z[None, a:b], dt_bias=dt_bias, initial_states=S[None],
                                dt_softplus=dt_softplus, dt_limit=dt_limit)
        y[a:b] = yc[0]
        final[s] = Sc[0]
        chunk_states[c] = Sc[0]
    return y, final, chunk_states
