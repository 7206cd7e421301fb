"""The state at each packed sequence's last token (`return_varlen_states` of the batch-form call
with `cu_seqlens`), from the forward's kept intermediates, as one small kernel.

The state at token e of sequence s, in chunk k, is the state entering chunk k decayed to e (when s
began before the chunk), plus the chunk's tokens of s up to e: sum over t of exp(dA[e] - dA[t]) ·
dt[t] · x[t] ⊗ B[t]. One program per (sequence, head, headdim block) reads at most one chunk's
tokens, so the cost follows the sequences' count, not the chunk length times it. A fixed epilogue:
it is not tuned, and nothing of it depends on the forward's config but the chunk length.

cu_seqlens's values stay on the GPU (reading them would cost a synchronization per call), so they
are not checked on the host: every index is clamped into the sequence, so a malformed cu_seqlens
never reads out of bounds; then every state is NaN (malformed: an entry below 0 or past seqlen, or
decreasing). Padding before the first or after the last sequence is allowed, as in mamba_ssm. An
empty sequence's state is 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.direct import ready

BLOCK_T = 32      # tokens a step of the chunk loop
BLOCK_CU = 1024   # cu_seqlens entries a step of the malformed check


@triton.jit
def _end_states(x_ptr, B_ptr, seq_ptr, cu_ptr, dA_ptr, dt_ptr, st_ptr, out_ptr,
                L, S, P, N, Q, HPG,
                s_x_l, s_x_h, s_x_p, s_B_l, s_B_g, s_B_n, s_seq_l,
                s_c_h, s_c_c, s_st_c, s_st_h, s_st_p, s_st_n,
                BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_CU: tl.constexpr, IEEE: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    # malformed anywhere poisons every state: each program checks the whole table (S + 1 entries,
    # a few KB read from L2), so no second launch and no host read
    bad = tl.zeros((BLOCK_CU,), dtype=tl.int32)
    for j0 in range(0, S + 1, BLOCK_CU):
        j = j0 + tl.arange(0, BLOCK_CU)
        inside = j < S + 1
        cur = tl.load(cu_ptr + j, mask=inside, other=0).to(tl.int64)
        prev = tl.load(cu_ptr + j - 1, mask=inside & (j > 0), other=0).to(tl.int64)
        bad |= (inside & (j > 0) & (cur < prev)).to(tl.int32)
    first = tl.load(cu_ptr).to(tl.int64)
    last = tl.load(cu_ptr + S).to(tl.int64)
    malformed = (tl.max(bad, axis=0) > 0) | (first < 0) | (last > L)

    start = tl.load(cu_ptr + s).to(tl.int64)
    stop = tl.load(cu_ptr + s + 1).to(tl.int64)
    e = tl.minimum(tl.maximum(stop - 1, 0), L - 1)
    k = e // Q
    c0 = k * Q
    seq_e = tl.load(seq_ptr + e * s_seq_l)
    row = h * s_c_h + k * s_c_c           # this head's chunk k in the (batch 0) dA and dt buffers
    dA_end = tl.load(dA_ptr + row + (e - c0))
    g = h // HPG
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for t0 in range(c0, e + 1, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T)
        valid = tok <= e
        same = tl.load(seq_ptr + tok * s_seq_l, mask=valid, other=0) == seq_e
        valid = valid & same
        dA = tl.load(dA_ptr + row + (tok - c0), mask=valid, other=0.0)
        dt = tl.load(dt_ptr + row + (tok - c0), mask=valid, other=0.0)
        w = tl.where(valid, tl.exp(dA_end - dA) * dt, 0.0)
        xb = tl.load(x_ptr + tok[:, None] * s_x_l + h * s_x_h + offs_p[None, :] * s_x_p,
                     mask=valid[:, None] & mask_p[None, :], other=0.0)
        bb = tl.load(B_ptr + tok[:, None] * s_B_l + g * s_B_g + offs_n[None, :] * s_B_n,
                     mask=valid[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        bw = bb * w[:, None]
        if IEEE:   # fp32 inputs: fp32 products, as the float64 bounds of fp32 expect
            acc += tl.dot(tl.trans(xb.to(tl.float32)), bw, input_precision="ieee")
        else:      # 16-bit inputs: the weighted B rounded to the input's type, as the chunk state does
            acc += tl.dot(tl.trans(xb), bw.to(xb.dtype))
    # the state entering chunk k, decayed to e, when the sequence runs on from before the chunk
    carry = tl.load(seq_ptr + tl.maximum(c0 - 1, 0) * s_seq_l) == seq_e
    m2 = mask_p[:, None] & mask_n[None, :]
    prev = tl.load(st_ptr + k * s_st_c + h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :] * s_st_n,
                   mask=m2 & carry, other=0.0).to(tl.float32)
    out = acc + tl.exp(dA_end) * prev
    out = tl.where(stop <= start, 0.0, out)
    out = tl.where(malformed, float("nan"), out)
    H = tl.num_programs(1)
    tl.store(out_ptr + ((s * H + h) * P + offs_p[:, None]) * N + offs_n[None, :], out, mask=m2)


def end_states(x, B, seq_idx, cu_seqlens, dA, dt, states, chunk_size: int) -> torch.Tensor:
    """(sequences, nheads, headdim, dstate) float32: the state at each sequence's last token.
    x (1, seqlen, nheads, headdim), B (1, seqlen, ngroups, dstate), seq_idx (1, seqlen), cu_seqlens
    (sequences + 1,); dA and dt the forward's per-chunk cumsum and processed dt, (1, nheads,
    nchunks, chunk_size); states the state entering each chunk, (1, nchunks, nheads, headdim,
    dstate)."""
    _, L, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    S = cu_seqlens.shape[0] - 1
    out = torch.empty(S, H, P, N, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    ready(x, "x")
    block_n = max(16, triton.next_power_of_2(N))
    block_p = max(16, min(64 if block_n <= 128 else 32, triton.next_power_of_2(P)))
    _end_states[(S, H, triton.cdiv(P, block_p))](
        x, B, seq_idx, cu_seqlens, dA, dt, states, out, L, S, P, N, chunk_size, H // G,
        x.stride(1), x.stride(2), x.stride(3), B.stride(1), B.stride(2), B.stride(3), seq_idx.stride(1),
        dA.stride(1), dA.stride(2), states.stride(1), states.stride(2), states.stride(3), states.stride(4),
        BLOCK_T=BLOCK_T, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_CU=BLOCK_CU,
        IEEE=x.dtype == torch.float32, num_warps=4)
    return out
