"""Run time: `get_kernel` (lookup + a cached Kernel) and the drop-in `mamba_chunk_scan_combined`.

No timing happens at run time: the config comes from the tuning databases through the one
selector (`autossd.core.select`, by the rules of `autossd.db.lookup`: exact / nearest within a
bound / transfer / per-arch default), so the same inputs pick
the same config in every process that sees the same databases. Two picks may exist per problem: one
timed by eager calls and one by CUDA-graph replay (at a small shape the first favours fewer
launches, since the host's launch cost counts there). The drop-in asks for the graph pick while
the current CUDA stream is capturing, so a captured forward gets the config fastest on the GPU. The lookup renders (but does not
import) each candidate record's module once per process, for its freshness hash (a few ms); the
first call of a Kernel imports only its own config's module; Triton compiles at first launch.

The drop-in is a `torch.library.custom_op` ("autossd::ssd_fwd") with a fake (meta) kernel, so
torch.compile treats it as one opaque node (no graph break) and CUDA graphs capture its
launches. Its outputs are always (y, final_states, varlen_states), the parts not asked for being
empty tensors, because an op's schema has a fixed number of outputs; the Python wrapper returns
what mamba_ssm returns. Its autograd (and the eager calls' differentiable runner) is registered
by autossd/grad.py, the layer above this module and the backward.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, Optional

import torch
from triton.runtime.errors import OutOfResources

from .arch import get_arch
from .core import select as _select
from .core.autograd import any_requires_grad
from .core.autograd import forward_only as _forward_only
from .core.device import CPU_ARCH, arch_of_device, launch_mode_of  # noqa: F401 (offered here as ever)
from .db.lookup import Match, device_name, user_db_url
from .db.records import Record, device_text
from .ops.common.launch_cache import RecentCalls, start_driver
from .ops.ssd.chunk import DIFFERENTIABLE, INPUTS, execute, input_sig, remember
from .problem import Problem, as_flag, from_args, in_x_dtype, parse_dt_limit, supported_chunk
from .render import interpreting, load
from .ops.ssd.fwd_knobs import Config, default_config

log = logging.getLogger("autossd")

OP = "ssd_fwd"


def forward_only(run, tensors: dict, call: dict | None = None):
    """run(), its outputs differentiable through the forward's registered runner (autossd/grad.py)
    where `call` describes the call and an input requires grad (core.autograd.forward_only)."""
    return _forward_only(run, tensors, DIFFERENTIABLE, call, OP)


class Kernel:
    """The SSD forward for one problem on one arch, with the config the lookup chose.

    Callable with mamba_chunk_scan_combined's arguments after chunk_size (the problem fixes it);
    returns what that function returns."""

    __slots__ = ("problem", "arch", "launch_mode", "backend", "match", "_loaded", "_checked")

    def __init__(self, problem: Problem, arch: str, match: Match, launch_mode: str = "eager") -> None:
        self.problem = problem
        self.arch = arch
        self.launch_mode = launch_mode
        self.backend = get_arch(arch).backend
        self.match = match
        self._loaded: tuple | None = None   # (config, its module): one slot, so they never disagree
        self._checked: dict[tuple, Problem] = {}   # call key (_call_key) -> its validated Problem
        while (arch, problem, self.config) in _unfit:   # known not to load here: skip to what did
            nxt = _next_fallback(arch, problem, self.config)
            if nxt is None:
                break   # nothing left: the call raises, as _fall_back does
            self.match = Match("default", nxt, match.distance, _unfit[(arch, problem, self.config)])

    # --- what was chosen, and why ----------------------------------------------------
    @property
    def config(self) -> Config:
        return self.match.config

    @property
    def source(self) -> str:
        """"exact", "nearest", "transfer" or "default": which lookup tier chose the config."""
        return self.match.kind

    @property
    def distance(self) -> float:
        return self.match.distance

    @property
    def reason(self) -> str:
        return self.match.reason

    @property
    def stale(self) -> bool:
        return self.match.stale

    @property
    def record(self) -> Record | None:
        return self.match.record

    @property
    def provenance(self) -> str:
        """The chosen record's provenance ("measured" / "static" / "default"); "default" when
        no record was used."""
        return self.match.record.provenance if self.match.record is not None else "default"

    @property
    def source_path(self):
        """The rendered Triton source of this config (renders and imports it if needed)."""
        return self.module().SOURCE_PATH

    def module(self):
        return self._module_of(self.config)

    def _module_of(self, cfg: Config):
        pair = self._loaded
        if pair is None or pair[0] is not cfg:
            pair = self._loaded = (cfg, load(cfg, self.backend))
        return pair[1]

    def __repr__(self) -> str:
        return (f"Kernel({self.arch}, {self.launch_mode}, {self.source}, provenance={self.provenance}, "
                f"distance={self.distance:.2f}, config={self.config!r})")

    # --- running ---------------------------------------------------------------------
    def __call__(self, x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                 seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                 return_final_states=False, return_varlen_states=False, state_dtype=None):
        chunk = self.problem.chunk_size or self.config.chunk_size
        dt_softplus, dt_limit, return_final_states, return_varlen_states = _scalars(
            dt_softplus, dt_limit, return_final_states, return_varlen_states)
        x, z, B, C = _unit_stride(x), _unit_stride(z), _unit_stride(B), _unit_stride(C)
        tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                       seq_idx=seq_idx)
        # as the drop-in does (_forward): a call with the metadata of one checked before skips
        # the checks; the launch mode plays no part in which kernel runs here
        prob, key = _cached(self._checked, _call_key(tensors, cu_seqlens, chunk, dt_softplus, dt_limit,
                                                     return_final_states, return_varlen_states, state_dtype, ""))
        if prob is None:
            prob = from_args(x, dt, A, B, C, chunk, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                             dt_softplus, dt_limit, return_final_states, return_varlen_states, state_dtype)
            _check_new_call(x)
            if prob != self.problem.replace(chunk_size=chunk):
                raise ValueError(f"kernel: built for {self.problem}, called with {prob}; "
                                 f"use autossd.get_kernel for the new problem")
            if key is not None:
                remember(self._checked, key, prob, _CALLS_MAX)
        return forward_only(lambda: self.run(prob, tensors, cu_seqlens, dt_limit, state_dtype,
                                              sig=key[0] if key is not None else None), tensors,
                            _grad_call(chunk, dt_softplus, dt_limit, return_final_states, return_varlen_states,
                                       state_dtype, cu_seqlens))

    def run(self, prob: Problem, tensors: dict, cu_seqlens=None, dt_limit=(0.0, float("inf")),
            state_dtype=None, keep: bool = True, sig=None, capturing=None):
        """Run on validated inputs (no checks beyond the device), as the library's entry points do
        after their checks; outputs are not tied to autograd here (see grad.py). keep: reuse the kept workspace
        of intermediates (chunk.execute); False inside the custom op torch.compile runs. sig,
        capturing: what the caller already knows (chunk.execute)."""
        x = tensors["x"]
        if x.device.type == "cpu" and not interpreting():
            raise RuntimeError(
                "autossd: the inputs are on the CPU, but the SSD kernels need a CUDA or ROCm GPU. "
                "Move the tensors to the GPU, or set TRITON_INTERPRET=1 before importing triton "
                "to run Triton's (slow) CPU interpreter.")
        while True:
            # one read of the config, and its own module: a fallback in another thread swaps
            # self.match, never what this call launches
            cfg = self.config
            module = self._module_of(cfg)
            try:
                if x.device.type == "cuda" and x.device.index not in (None, torch.cuda.current_device()):
                    with torch.cuda.device(x.device):
                        return execute(prob, cfg, tensors, cu_seqlens, dt_limit, state_dtype,
                                       self.backend, module, keep=keep, sig=sig, capturing=capturing)
                return execute(prob, cfg, tensors, cu_seqlens, dt_limit, state_dtype, self.backend,
                               module, keep=keep, sig=sig, capturing=capturing)
            except OutOfResources as e:
                with _kernels_lock:   # one fallback at a time; a call that lost the race retries
                    if self.config == cfg:
                        self._fall_back(e)   # raises where no smaller config is left

    def _fall_back(self, err) -> None:
        """A config this GPU cannot load (Triton's OutOfResources at a kernel's first load: e.g. a
        record tuned on a GPU with more shared memory per block than this one, such as an H100's
        227 KB against 99 KB on sm86/sm89/sm120 parts that borrow sm80/sm90 records). Nothing
        was launched with it yet, so the call can run again with a config that fits: the arch
        default, then that default with no software pipelining. The user's program goes on,
        with a warning that says which record did not fit."""
        cand = _next_fallback(self.arch, self.problem, self.config)
        if cand is None:
            raise RuntimeError(f"autossd: no config fits this GPU for {self.problem} ({err}); the "
                               f"{self.arch} default without pipelining was the last one tried") from err
        was = self.match
        why = (f"{was.kind} config ({was.reason}) needs more {err.name} than this GPU has "
               f"({err.required} > {err.limit}); fell back to the {self.arch} default"
               + ("" if cand == fallback_configs(self.arch, self.problem)[0] else " without pipelining"))
        log.warning("autossd: %s", why)
        _unfit[(self.arch, self.problem, self.config)] = why
        self.match = Match("default", cand, was.distance, why)


def _next_fallback(arch: str, problem: Problem, config: Config) -> Config | None:
    """The fallback after `config` (the first one for a config not in the chain), or None."""
    chain = fallback_configs(arch, problem)
    left = chain[chain.index(config) + 1:] if config in chain else chain
    return left[0] if left else None


def fallback_configs(arch: str, problem: Problem) -> list[Config]:
    """What a Kernel falls back to when its config does not fit the GPU (Kernel._fall_back), in
    order: the arch default, then the same with every stage unpipelined (the least shared
    memory the default's tiles can take)."""
    base = default_config(arch, problem)
    flat = base.replace(**{k: 1 for k in ("bmm_stages", "state_stages", "scan_stages")})
    return [base] if flat == base else [base, flat]


# --- get_kernel ----------------------------------------------------------------------------
# (arch, problem, config) -> why: configs that did not load on this process's GPU (Kernel._fall_back).
# clear_cache keeps them (the GPU did not change), so a Kernel built again after it (e.g. after
# a tuning-database write) starts from the config that fit, without a failed load and a second
# warning. Keyed by arch, not by GPU: a process with two GPU models of one arch applies one's
# verdict to both (the default runs there, correct, perhaps slower).
_unfit: dict[tuple, str] = {}
_kernels: dict[Any, Kernel] = {}
KERNELS_MAX = 4096   # cached Kernels (two keys each), as the call and launch caches are bounded
_kernels_lock = threading.Lock()


@_select.on_clear
def _clear_kernels() -> None:
    with _kernels_lock:
        _kernels.clear()
        _calls.clear()
        _recent.clear()


def clear_cache() -> None:
    """Forget cached kernels, loaded records (e.g. after AUTOSSD_DB changes), the configs every
    op chose from them, and the kept workspaces of intermediates (`core.select.clear`). Configs
    this GPU could not load are remembered (_unfit)."""
    _select.clear()


@functools.lru_cache(maxsize=KERNELS_MAX)
def _problem_from_items(items: frozenset) -> Problem:
    """A dict's Problem, built once per distinct dict: get_kernel cannot key its cache on a dict,
    and building and validating a Problem costs ~20 µs of each such call."""
    return Problem(**{k: v for k, _, v in items})


def _as_problem(p: Problem | Mapping | tuple) -> Problem:
    if isinstance(p, Problem):
        return p
    if isinstance(p, Mapping):
        try:   # each value's type too: Problem refuses batch=2.0, which equals and hashes as 2
            items = frozenset((k, type(v), v) for k, v in p.items())
        except TypeError:   # an unhashable value: Problem says what is wrong with it
            return Problem(**p)
        return _problem_from_items(items)
    if isinstance(p, (tuple, list)) and len(p) == 7:
        return Problem(*p)
    raise TypeError("get_kernel: expected a Problem, a dict of Problem fields, or a tuple "
                    f"(batch, seqlen, nheads, headdim, dstate, ngroups, dtype); got {p!r}")


def get_kernel(problem_or_shape, arch: str | None = None, db=None, launch_mode: str = "eager",
               device: int | str | None = None) -> Kernel:
    """The Kernel for a problem: `problem_or_shape` is a Problem, a dict of its fields, or a
    tuple (batch, seqlen, nheads, headdim, dstate, ngroups, dtype). arch: "sm90", ... (default:
    the local GPU's). db: the user database (URL or path; default env AUTOSSD_DB, else the cache
    file). launch_mode: "eager" for calls launched one by one, "graph" for a forward captured in
    a CUDA graph (the records timed that way are preferred; see autossd.db.lookup, which
    refuses any other value). device: the GPU whose own measurements rank first among records
    of the arch (an H100 takes the H100's records before the H200's): an index, a torch.device
    or "cuda:N" (with arch None, that GPU's arch too), or a GPU's name as
    `torch.cuda.get_device_name` gives it; default: the current GPU, none without one. Cached per
    process: a warm call is one dict lookup (plus which device is current: a process with GPUs
    of two archs gets each one's kernel). After changing AUTOSSD_DB or AUTOSSD_ARCH in a running
    process, call autossd.clear_cache()."""
    if isinstance(device, str) and device.startswith("cuda"):
        device = torch.device(device)
    if isinstance(device, torch.device):   # a torch.device or "cuda:N": its index
        device = device.index if device.type == "cuda" else None
    dev = _current_device() if device is None else device
    try:
        return _kernels[(_shape_key(problem_or_shape), arch, db, launch_mode, dev)]
    except (KeyError, TypeError):  # TypeError: an unhashable shape (dict)
        return _get_kernel_cold(problem_or_shape, arch, db, launch_mode, dev)


def _shape_key(p):
    """A tuple shape with its values' types (Problem refuses seqlen=64.0, which equals and hashes
    as 64: without them a cached (1, 64, ...) would answer it)."""
    return (p, tuple(map(type, p))) if isinstance(p, tuple) else p


def _current_device() -> int | None:
    try:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    except RuntimeError:   # e.g. a process forked after its parent started CUDA: no device to ask
        return None


def _get_kernel_cold(problem_or_shape, arch, db, launch_mode, dev=None) -> Kernel:
    problem = _as_problem(problem_or_shape)
    if db is not None and not isinstance(db, (str, os.PathLike)):
        raise TypeError(f"db: expected a path or SQLAlchemy URL, got {type(db).__name__} {db!r}")
    if dev is not None and not isinstance(dev, str) and (type(dev) is not int or dev < 0):
        raise ValueError(f"device: expected a GPU index >= 0, a torch.device, 'cuda:N' or a GPU's name, "
                         f"got {dev!r}")
    if arch is not None:
        arch_name = get_arch(arch).name
    else:   # the arch of the GPU asked for (by index), else of the current one
        arch_name = arch_of_device(torch.device("cuda", dev)) if isinstance(dev, int) else arch_of_device()
    url = user_db_url(db)
    # the GPU's name, so that its own measurements rank first (None: no GPU to ask)
    device = device_text(dev) if isinstance(dev, str) else (device_name(dev) if dev is not None else None)
    norm = (problem, arch_name, url, launch_mode, device)
    with _kernels_lock:
        kernel = _kernels.get(norm)
    if kernel is None:
        match = _select.select(OP, problem, arch_name, device, launch_mode, url)
        kernel = Kernel(problem, arch_name, match, launch_mode)
        log.debug("autossd: %s (%s) -> %s", problem, launch_mode, match.reason)
    with _kernels_lock:
        if len(_kernels) >= KERNELS_MAX:   # a server seeing every (batch, length): start over
            _kernels.clear()
        kernel = _kernels.setdefault(norm, kernel)
        try:
            _kernels[(_shape_key(problem_or_shape), arch, db, launch_mode, dev)] = kernel
        except TypeError:
            pass
    return kernel


# --- the custom op and the drop-in ---------------------------------------------------------
_Tensor = torch.Tensor


# Validated calls: (input signature, the other arguments, launch mode) -> (Problem, Kernel); the
# Kernel's arch is checked against the device's on each hit (AUTOSSD_ARCH may change). from_args
# checks only what the signature holds (types, dtypes, shapes, strides, devices) and the scalars
# beside it, so an equal key is a call that validated before; the key also carries what the
# launch cache keys on, so the check and the replay share one signature. Key and lookup take
# 9.6 µs where from_args and the old launch signature took 24.4 (H100 host). Forgotten
# by clear_cache.
_calls: dict[tuple, tuple[Problem, Kernel]] = {}
_CALLS_MAX = 4096   # distinct call shapes kept (varying sequence lengths); then start over
_recent = RecentCalls(INPUTS + ("cu_seqlens",))   # the last few keys of _calls, by guard check


def _call_key(tensors: dict, cu_seqlens, chunk_size, dt_softplus, dt_limit, return_final_states,
              return_varlen_states, state_dtype, mode: str):
    """The cache key of a call, or None where it has no cheap exact key (a non-tensor input, an
    unhashable argument): such a call always takes the checked path."""
    try:
        cu = None if cu_seqlens is None else (cu_seqlens.dtype, cu_seqlens.shape, cu_seqlens.device)
        # chunk_size's type too: from_args refuses 256.0, which equals and hashes as 256; the
        # flags and dt_limit come normalized (_scalars)
        key = (input_sig(tensors), cu, type(chunk_size), chunk_size, dt_softplus, dt_limit,
               return_final_states, return_varlen_states, state_dtype, mode)
    except (AttributeError, TypeError):
        return None
    return key


def _scalars(dt_softplus, dt_limit, return_final_states, return_varlen_states):
    """The flags as bools and dt_limit as a pair of floats, as the kernels take them: converted
    before a call is keyed, so equal keys mean equal values (a 0-d tensor in dt_limit would
    otherwise key by identity, and its value could change in place)."""
    lo, hi = parse_dt_limit(dt_limit)
    return (as_flag("dt_softplus", dt_softplus), (lo, hi), as_flag("return_final_states", return_final_states),
            as_flag("return_varlen_states", return_varlen_states))


def _check_new_call(x) -> None:
    """Checks beyond from_args, made once per call signature (the validated-call caches skip
    them after): the device. A's values are not looked at (that would synchronize a GPU), nor
    its sign: mamba_ssm takes a positive A, and so does the drop-in."""
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"x: on device {x.device.type}; autossd runs on CUDA/ROCm GPUs or the CPU "
                         "interpreter (CPU tensors with TRITON_INTERPRET=1)")


def _unit_stride(t):
    """t, or a contiguous copy of it where its last dimension is strided (e.g. a transposed or
    channels-last-like tensor). The kernels vectorize along the last dimension of x, z, B and C,
    and mamba_ssm copies such inputs too, so the drop-in takes them; other strided layouts are
    read in place. Anything that is no tensor goes on to from_args, which names it."""
    if isinstance(t, torch.Tensor) and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
        return t.contiguous()
    return t


def _cached(cache: dict, key):
    """(cache[key] or None, key), or (None, None) for an unhashable key (no cache for that call).
    The key is hashed once, by this lookup."""
    if key is None:
        return None, None
    try:
        return cache.get(key), key
    except TypeError:
        return None, None


def _forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, dt_softplus,
             dt_limit, return_final_states, return_varlen_states, state_dtype, keep=False):
    """Validate, look up, run: y, or a tuple with what was asked (mamba_ssm's returns)."""
    x, z, B, C = _unit_stride(x), _unit_stride(z), _unit_stride(B), _unit_stride(C)
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                   seq_idx=seq_idx)
    mode = launch_mode_of(x) if isinstance(x, torch.Tensor) else "eager"   # else from_args refuses x
    capturing = mode == "graph"
    # a recent key, found by a guard check rather than by building and hashing the key
    # (launch_cache.RecentCalls); its launch signature is the one stored with it
    args = (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens)
    gen = _recent.generation   # before the lookup: a clear_cache since then voids what it finds
    extra = (type(chunk_size), chunk_size, dt_softplus, dt_limit, return_final_states, return_varlen_states,
             state_dtype, mode)
    try:
        found = _recent.find(args, extra)
    except (TypeError, ValueError, RuntimeError):   # an odd argument: the checked path names it
        found = extra = None
    if found is not None and found[0][1].arch == arch_of_device(x.device):
        prob, kernel, sig = found[0]
        return kernel.run(prob, tensors, cu_seqlens, dt_limit, state_dtype, keep, sig=sig, capturing=capturing)
    hit, key = _cached(_calls, _call_key(tensors, cu_seqlens, chunk_size, dt_softplus, dt_limit,
                                         return_final_states, return_varlen_states, state_dtype, mode))
    if hit is not None and hit[1].arch == arch_of_device(x.device):
        prob, kernel = hit
    else:
        prob = from_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                         dt_softplus, dt_limit, return_final_states, return_varlen_states, state_dtype)
        _check_new_call(x)
        if x.is_cuda:
            start_driver()   # a first call: triton's driver comes up while the lookup runs
        kernel = get_kernel(prob, arch_of_device(x.device), None, mode, x.device.index)
        if key is not None:
            remember(_calls, key, (prob, kernel), _CALLS_MAX)
    if key is not None and extra is not None:   # found: of another arch (AUTOSSD_ARCH changed)
        _recent.add(args, extra, (prob, kernel, key[0]), gen)
    return kernel.run(prob, tensors, cu_seqlens, dt_limit, state_dtype, keep,
                      sig=key[0] if key is not None else None, capturing=capturing)


def _ssd_fwd_eager(x: _Tensor, dt: _Tensor, A: _Tensor, B: _Tensor, C: _Tensor, chunk_size: int,
            D: Optional[_Tensor], z: Optional[_Tensor], dt_bias: Optional[_Tensor],
            initial_states: Optional[_Tensor], seq_idx: Optional[_Tensor],
            cu_seqlens: Optional[_Tensor], dt_softplus: bool, dt_lo: float, dt_hi: float,
            return_final_states: bool, return_varlen_states: bool,
            state_dtype: Optional[torch.dtype]) -> tuple[_Tensor, _Tensor, _Tensor]:
    """(y, final_states or empty, varlen_states or empty)."""
    out = _forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                   dt_softplus, (dt_lo, dt_hi), return_final_states, return_varlen_states, state_dtype)
    if not isinstance(out, tuple):
        out = (out,)
    y = out[0]
    rest = list(out[1:])
    final = rest.pop(0) if return_final_states else x.new_empty(0, dtype=torch.float32)
    varlen = rest.pop(0) if return_varlen_states else x.new_empty(0, dtype=torch.float32)
    return y, final, varlen


ssd_fwd = torch.library.custom_op("autossd::ssd_fwd", mutates_args=())(_ssd_fwd_eager)


def _grad_call(chunk_size, dt_softplus, dt_limit, return_final_states, return_varlen_states, state_dtype,
               cu_seqlens, drop_in: bool = False) -> dict:
    """What the backward needs of a call beyond its tensors (`forward_only`'s `call`).
    drop_in: the call is the drop-in's, whose forward is the lookup's pick, so the forward may
    run the ungated problem instead and gate apart (a Kernel's call runs its own config)."""
    return dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                return_final_states=return_final_states, return_varlen_states=return_varlen_states,
                state_dtype=state_dtype, cu_seqlens=cu_seqlens, drop_in=drop_in)


@ssd_fwd.register_fake
def _ssd_fwd_fake(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                  dt_softplus, dt_lo, dt_hi, return_final_states, return_varlen_states, state_dtype):
    # the same validation as the real kernel, so a bad call fails at trace time too; with
    # dynamic (symbolic) sizes the real kernel validates at run time instead
    if all(type(s) is int for s in (*x.shape, *B.shape)):
        x, z, B, C = _unit_stride(x), _unit_stride(z), _unit_stride(B), _unit_stride(C)   # as _forward
        from_args(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                  dt_softplus, (dt_lo, dt_hi), return_final_states, return_varlen_states, state_dtype)
    b, _, h, p = x.shape
    n = B.shape[-1]
    f32 = torch.float32
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    final = x.new_empty((b, h, p, n), dtype=f32) if return_final_states else x.new_empty(0, dtype=f32)
    varlen = (x.new_empty((cu_seqlens.shape[0] - 1, h, p, n), dtype=f32) if return_varlen_states
              else x.new_empty(0, dtype=f32))
    return y, final, varlen


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False, state_dtype=None):
    """Drop-in for mamba_ssm's mamba_chunk_scan_combined (forward): same arguments, same
    returns: y; or (y, final_states); or (y, varlen_states); or (y, final_states, varlen_states).

    Takes the layouts mamba_ssm takes: an x, z, B or C whose last dimension is strided (e.g.
    `torch.randn(b, l, p, h).transpose(-1, -2)`) is copied to a contiguous tensor first, as
    mamba_ssm copies it (the kernels vectorize along that dimension); every other strided layout,
    and dt, D, dt_bias, initial_states and seq_idx in any layout, are read in place. B, C and z
    in another float dtype than x are cast to x's, as mamba_ssm's kernels take them.

    Inputs must be finite (zero any padding): a NaN or Inf at token t can make y non-finite at
    the tokens of t's chunk before t as well; tokens of earlier chunks are never affected."""
    B, C, z = in_x_dtype(x, B, C, z)
    chunk_size = supported_chunk(chunk_size)
    dt_softplus, (lo, hi), return_final_states, return_varlen_states = _scalars(
        dt_softplus, dt_limit, return_final_states, return_varlen_states)
    # Eager calls skip torch's custom-op dispatcher (~250 us per call measured on the H100 host,
    # BENCHMARKS.md) and its fixed three outputs (two empty placeholders to allocate); torch.compile
    # traces the registered op, so it still sees no graph break.
    if not torch.compiler.is_compiling():
        run = lambda: _forward(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,  # noqa: E731
                               cu_seqlens, dt_softplus, (lo, hi), return_final_states,
                               return_varlen_states, state_dtype, keep=True)
        if not (torch.is_grad_enabled() and any_requires_grad(x, dt, A, B, C, D, z, dt_bias, initial_states)):
            return run()   # inference: nothing for autograd to record (no dict built per call)
        # the backward reads the tensors autograd saved: copy a strided last dimension here, where
        # the copy is itself recorded (its gradient flows back to the caller's layout)
        x, z, B, C = (_unit_stride(v) for v in (x, z, B, C))
        return forward_only(run, dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                                       initial_states=initial_states, seq_idx=seq_idx),
                            _grad_call(chunk_size, dt_softplus, (lo, hi), return_final_states,
                                       return_varlen_states, state_dtype, cu_seqlens, drop_in=True))
    x, z, B, C = (_unit_stride(v) for v in (x, z, B, C))
    y, final, varlen = torch.ops.autossd.ssd_fwd(
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
        dt_softplus, lo, hi, return_final_states, return_varlen_states, state_dtype)
    if not return_varlen_states:
        return (y, final) if return_final_states else y
    return (y, final, varlen) if return_final_states else (y, varlen)
