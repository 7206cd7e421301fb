"""The SSD forward's entry: `ssd_forward` and `execute` run a call's planned launches (`plan`) on
its buffers (`workspace`), through the launch cache where it is on (`ops.common.launch_cache`).

The names other modules import from here (plan, allocate, the workspace, the launch cache's
pieces) stay importable from here.
"""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import torch

from ... import problem as _problem
from ...core import select as _select
from ...core.autograd import forward_only
from ...render import interpreting, load
from ..common import launch_cache as _lc
from ..common.launch_cache import DescArg as _DescArg  # noqa: F401
from ..common.launch_cache import DirectLaunch as _DirectLaunch  # noqa: F401
from ..common.launch_cache import TMA_DESCRIPTORS as _TMA_DESCRIPTORS  # noqa: F401
from ..common.launch_cache import remember
from ..common.launch_cache import replay as _replay
from . import workspace as _ws
from .end_states import end_states
from .fwd_knobs import Config, default_config
from .plan import (Launch, _gluon_scan, _gluon_walk, _walk_join, chains,  # noqa: F401
                   gluon_scan_gaps, plan, walk_gaps, walk_programs, walk_segments)
from .workspace import (_TORCH_STATE, SYNC_SCRATCH, WORKSPACE_BYTES, WORKSPACE_MAX_ONE,  # noqa: F401
                        Buffers, _budget_from_env, _workspaces, allocate, clear_workspaces)


def run(launches: list[Launch], module) -> list:
    """Launch through triton's JIT; returns what it returns (the compiled kernels)."""
    return [getattr(module, ln.kernel)[ln.grid](**ln.args, **ln.constexprs, **ln.options)
            for ln in launches]


def warm_up(launches: list[Launch], module) -> int:
    """Compile a call's kernels side by side when this process has compiled none of them yet.
    Left to triton's JIT, the first call compiles them one after another at their launches, each
    kernel and then its C launcher (a gcc run); side by side, a cold first call at 2.7b 1x2048
    took 3.5 s instead of 5.4 s on a slow H100 host: the compilers' subprocesses
    (ptxas, gcc) overlap, the Python front end does not. Nothing is
    launched here; each thread compiles (JITFunction.warmup) and loads
    (launch_cache.load_handles) one kernel, and the launches that follow find them compiled.
    Returns how many were compiled."""
    if interpreting() or len(launches) < 2 or torch.cuda.is_current_stream_capturing():
        return 0
    device = torch.cuda.current_device()   # what triton's driver reports (CUDA and ROCm)
    cold = [ln for ln in launches if _lc.never_compiled(getattr(module, ln.kernel), device)]
    if len(cold) < 2:
        return 0

    def one(ln):
        with torch.cuda.device(device):   # a new thread starts on device 0
            ck = getattr(module, ln.kernel).warmup(**ln.args, **ln.constexprs, **ln.options, grid=ln.grid)
            _lc.load_handles(ck)

    with ThreadPoolExecutor(len(cold), thread_name_prefix="autossd-compile") as ex:
        list(ex.map(one, cold))   # re-raises a compile error here, as the launch would
    return len(cold)


def varlen_states(prob, config, t, buf, cu_seqlens) -> torch.Tensor:
    """States at the last token of each packed sequence (batch 1), from the kept intermediates
    (end_states: one small kernel; malformed or empty entries of cu_seqlens as it says)."""
    return end_states(t["x"], t["B"], t["seq_idx"], cu_seqlens, buf.dA, buf.dt, buf.states, config.chunk_size)


def ssd_forward(x, dt, A, B, C, chunk_size=256, D=None, z=None, dt_bias=None, initial_states=None,
                seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                return_final_states=False, return_varlen_states=False, state_dtype=None,
                config: Config | None = None, backend: str = "cuda", poison: bool = False):
    """Validate, pick the config (the given one, else the arch default), and run the five
    stages. Returns y, or a tuple with final_states / varlen_states as mamba_ssm does."""
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
                                        keep=True), t, DIFFERENTIABLE)


# --- launch cache -------------------------------------------------------------------------
# A call's launches depend only on the problem, the config and the inputs' dtypes, strides and
# 16-byte alignment (what triton specializes on); buffers (fresh or kept) are whole allocations of
# the same shapes, always aligned.
# The first call of such a key goes through triton's JIT (which compiles and returns the compiled
# kernels) and records, per launch, the compiled kernel and where each argument comes from; later
# calls fill in the tensors and launch the compiled kernels directly, skipping the plan (~50 us)
# and triton's per-launch binding (~30 us of ~40 arguments each), measured on the H100 host.
# The recording and replay live in ops.common.launch_cache, which turns itself off (and every call
# takes run()'s path) where this triton lacks an internal they use.
INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")
DIFFERENTIABLE = INPUTS[:-1]   # the inputs with a gradient (seq_idx is an index)
_BUFFERS = ("y", "dt", "dA", "cb", "states", "final", "sync", "w", "gam", "gseg", "seg", "sen")
_launch_cache: dict[tuple, list] = {}
LAUNCH_CACHE_MAX = 4096   # recorded calls kept (one per sequence length and config); then start over


@_select.on_clear
def clear_launch_cache() -> None:
    """Forget the recorded calls."""
    _launch_cache.clear()


_select.on_clear(clear_workspaces)


def input_sig(t: dict) -> tuple:
    """What a launch specializes on, per input: dtype, shape, strides, device, 16-byte alignment,
    and the aliasing pattern (a record made when B is C must not serve a call where they
    differ). A few µs: the drop-in also keys its cache of validated calls on it
    (runtime._forward). Raises AttributeError for a non-tensor input."""
    return _lc.input_sig(t, INPUTS)


def _record(launches: list[Launch], compiled: list, t: dict, buf: Buffers, module) -> list:
    """A call's launches recorded for replay, each argument found among the inputs or buffers."""
    return _lc.record(launches, compiled, t, buf, module, INPUTS, _BUFFERS)


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
    stream = None if cpu else _lc.current_stream()
    ws = None
    if capturing is None and keep and not cpu:
        capturing = torch.cuda.is_current_stream_capturing()
    if keep and not poison and (cpu or not capturing):
        ws = _ws._workspace(prob, config, device, state_dtype, stream)
    if ws is None:
        return _execute(prob, config, t, _ws.allocate(aprob, config, device, state_dtype, poison), cu_seqlens,
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
            _ws._forget_workspace((prob, config, device, state_dtype, stream))
            raise


def _execute(prob, config, t, buf, cu_seqlens, dt_limit, state_dtype, backend, module, stream, sig=None):
    # enabled() first: where the launch cache is off for a missing internal, the first call
    # warns, on a GPU or not
    fast = _lc.enabled() and stream is not None
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
