"""The buffers one SSD forward writes (`allocate`), and the per-stream workspace that keeps the
intermediates between eager calls, within a least-recently-used byte budget."""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch
import triton

from ... import problem as _problem
from .fwd_knobs import STATE_DTYPES, Config
from .plan import Buffers, chains, walk_programs, walk_segments  # noqa: F401 (Buffers: offered here as ever)

_TORCH_STATE = {k: getattr(torch, v) for k, v in STATE_DTYPES.items()}


SYNC_SCRATCH = 1024   # >= the lanes of a fused program (8 warps x 64 on AMD)


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
# time per tensor, ~20 us per call at 2.7b 1x2048 (H100 host). Reuse is safe because the
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
