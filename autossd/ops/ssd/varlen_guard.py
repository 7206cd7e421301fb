"""A caller's chunk table made safe to index with, on the device.

An engine that captures CUDA graphs passes packed prefill its own chunk table (cu_chunk_seqlens,
last_chunk_indices, seq_idx), whose values cannot be checked on the host without waiting for
the device. The kernels index tokens, chunk states and initial states with those values, so a
wrong table would read and write out of bounds: a GPU fault, or another tensor's memory. One
small launch clamps a copy of the table into range first:

- chunk lengths into [0, chunk_size], the offsets rebuilt as their running sum from the first
  offset, and every offset clamped to [0, tokens];
- seq_idx into [0, seqs - 1], last_chunk_indices into [-1, nchunks - 1].

A valid table comes out unchanged (so do the results); a wrong one gives wrong numbers for the
sequences it describes wrongly, never a fault.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _guard_table(cuc_ptr, last_ptr, seq_ptr, cuc_out, last_out, seq_out,
                 tokens, chunk_size, nchunks, nseqs, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    start = tl.minimum(tl.maximum(tl.load(cuc_ptr).to(tl.int64), 0), tokens)
    tl.store(cuc_out, start.to(tl.int32))
    carry = start
    for b in range(0, nchunks, BLOCK):
        i = b + offs
        m = i < nchunks
        lo = tl.load(cuc_ptr + i, mask=m, other=0).to(tl.int64)
        hi = tl.load(cuc_ptr + i + 1, mask=m, other=0).to(tl.int64)
        length = tl.where(m, tl.minimum(tl.maximum(hi - lo, 0), chunk_size), 0)
        ends = carry + tl.cumsum(length, axis=0)
        tl.store(cuc_out + i + 1, tl.minimum(ends, tokens).to(tl.int32), mask=m)
        carry += tl.sum(length, axis=0)
        s = tl.load(seq_ptr + i, mask=m, other=0)
        tl.store(seq_out + i, tl.minimum(tl.maximum(s, 0), nseqs - 1).to(tl.int32), mask=m)
    for b in range(0, nseqs, BLOCK):
        i = b + offs
        m = i < nseqs
        v = tl.load(last_ptr + i, mask=m, other=0)
        tl.store(last_out + i, tl.minimum(tl.maximum(v, -1), nchunks - 1).to(tl.int32), mask=m)


def guard_table(cu_chunk_seqlens: torch.Tensor, last_chunk_indices: torch.Tensor, seq_idx: torch.Tensor,
                tokens: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The table clamped into range (int32 copies on the table's device; see the module's
    docstring). The shapes were checked by the caller: (nchunks + 1,), (nseqs,), (nchunks,)."""
    nchunks, nseqs = seq_idx.shape[0], last_chunk_indices.shape[0]
    out = (torch.empty(nchunks + 1, dtype=torch.int32, device=seq_idx.device),
           torch.empty(nseqs, dtype=torch.int32, device=seq_idx.device),
           torch.empty(nchunks, dtype=torch.int32, device=seq_idx.device))
    dev = seq_idx.device
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with ctx:
        _guard_table[(1,)](cu_chunk_seqlens, last_chunk_indices, seq_idx, *out, tokens, chunk_size,
                           nchunks, nseqs, BLOCK=_BLOCK)
    return out
