"""Packed prefill (`ssd_varlen`), declared once, and its entries: the tokens of many sequences
packed along one axis, each sequence continuing from its own cached state, as inference engines
run a prefill (chunked prefill and prefix caching included).

The packed axis is cut into a *chunk table*: chunk c holds tokens cu_chunk_seqlens[c] to
cu_chunk_seqlens[c+1] of sequence seq_idx[c], at most chunk_size of them, and no chunk straddles
two sequences (`varlen_chunks` builds the table; an engine may pass its own, e.g. one whose first
chunk of a sequence ends where the cached prefix's last chunk would have). Five launches
(four with C·Bᵀ computed inline): the cumsum of dt'·A per chunk, C·Bᵀ per chunk and group, each
chunk's local state, the prefix over each sequence's chunks from its initial state (one program
per state block, head and sequence: sequences run side by side), and the chunk scan, which
writes y into the caller's buffer.

Nothing here reads a tensor's values on the host: shapes decide the launches, so a call can be
captured in a CUDA graph (with a chunk table of fixed length). Outputs: y, each sequence's state
at its last token, and optionally every chunk's end state.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from ...arch import get_arch
from ...core import select as _select
from ...core.cost import StageCost
from ...core.device import arch_of_device, launch_mode_of
from ...db import lookup as _lookup
from ...problem import DTYPES, TORCH_DTYPES, as_flag, parse_dt_limit
from ...render import interpreting, load
from ..common import launch_cache as _lc
from ..common.checks import check_no_overlap
from ..registry import Op, Stage, register
from .chunk import run as launch
from .chunk import warm_up
from .naive import varlen_ref
from .plan import Launch, strides
from .varlen_gluon import gluon_gaps, gluon_scan, gluon_walk
from .varlen_knobs import (SPACE, VarlenConfig, VarlenProblem, caps, chunks_for, default_config, fit,  # noqa: F401
                           lengths_for, problem_for, seed_configs, violations)

STAGES = (
    Stage("cumsum"),
    Stage("bmm", "bmm_warps", "bmm_stages"),
    Stage("chunk_state", "state_warps", "state_stages", "state_maxnreg"),
    Stage("state_passing", "pass_warps"),
    Stage("chunk_scan", "scan_warps", "scan_stages", "scan_maxnreg"),
)
SEQUENCES = {"stage": ("cumsum", "bmm", "chunk_state", "state_passing", "chunk_scan"),
             "inline": ("cumsum", "chunk_state", "state_passing", "chunk_scan")}
MAX_GRID_YZ = 65535
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INTS = (torch.int32, torch.int64)


def includes(cfg: VarlenConfig, backend: str) -> list[str]:
    """The template files a config's module holds, in launch order: the forward's stage files of
    the SSD library (templates/ssd/), which render their packed kernels here (`render_context`),
    C·Bᵀ's only where it has a launch of its own, and the forward's Gluon walk and chunk scan
    where the config takes them (CUDA only; a call they cannot take runs the tl stages, so
    those are always there)."""
    out = ["cumsum.jinja"]
    if cfg.cb == "stage":
        out.append("bmm.jinja")
    out += ["chunk_state.jinja", "state_passing.jinja"]
    if cfg.state_walk and backend == "cuda":
        out.append("state_walk_gluon.jinja")
    out.append("chunk_scan.jinja")
    if cfg.scan_gluon and backend == "cuda":
        out.append("chunk_scan_gluon.jinja")
    return out


def render_context(cfg: VarlenConfig, backend: str) -> dict:
    # the forward's five-launch stage files (templates/ssd/), each in its packed form: the chunk
    # table's indexing, per-sequence initial states, every chunk's end state kept
    return {"packed": True}


# --- the chunk table ------------------------------------------------------------------------
def varlen_chunks(cu_seqlens, chunk_size: int, computed_tokens=None, tokens: int | None = None):
    """The chunk table of a packed batch: (cu_chunk_seqlens (nchunks + 1,), last_chunk_indices
    (seqs,), seq_idx (nchunks,)), int32 on cu_seqlens's device.

    Each sequence is cut into chunks of chunk_size tokens, the last one shorter. With
    computed_tokens (seqs,) (tokens each sequence already has in the cache: prefix caching,
    chunked prefill), a sequence's first chunk ends where its logical position reaches a multiple
    of chunk_size, so every chunk end state lines up with the cache's blocks. An empty sequence
    has no chunk (its final state is its initial state). Reads cu_seqlens on the host: build the
    table once per batch, outside any CUDA graph. tokens: the packed tokens the offsets must end
    at (x's first dimension), checked when given."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens: expected a 1-D tensor (seqs + 1,) of cumulative lengths")
    cu = [int(v) for v in cu_seqlens.tolist()]
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0, got {cu[:8]}...")
    if tokens is not None and cu[-1] != tokens:
        raise ValueError(f"cu_seqlens: the last offset is {cu[-1]}, but x holds {tokens} tokens; the offsets "
                         "must end at the packed length")
    done = [0] * (len(cu) - 1)
    if computed_tokens is not None:
        done = [int(v) for v in torch.as_tensor(computed_tokens).tolist()]
        if len(done) != len(cu) - 1 or min(done, default=0) < 0:
            raise ValueError(f"computed_tokens: expected {len(cu) - 1} non-negative counts, got {done[:8]}...")
    bounds, seq, last = [0], [], []
    for s, (a, b) in enumerate(zip(cu, cu[1:])):
        t = a
        while t < b:
            room = chunk_size - (done[s] + t - a) % chunk_size
            t = min(b, t + room)
            bounds.append(t)
            seq.append(s)
        last.append(len(seq) - 1)
    dev = cu_seqlens.device

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=dev)
    return i32(bounds), i32(last), i32(seq)


# --- validation -----------------------------------------------------------------------------
def _tensor(name, v, dims, device, dtypes=_FLOATS):
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
    if v.dim() not in dims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, dims))} dimensions, got shape {tuple(v.shape)}")
    if v.dtype not in dtypes:
        raise TypeError(f"{name}: expected {' or '.join(str(d).replace('torch.', '') for d in dtypes)}, "
                        f"got {v.dtype}")
    if v.device != device:
        raise ValueError(f"{name}: on {v.device}, but x is on {device}")
    return v


def _shape(name, v, want, what):
    if tuple(v.shape) != tuple(want):
        raise ValueError(f"{name}: expected shape {tuple(want)} ({what}), got {tuple(v.shape)}")


def _packed(name, v):
    """mamba_ssm's varlen form, a leading batch of 1 ((1, T, h, p) for x, z and out, (1, T, h) for
    dt, (1, T, g, n) for B and C), as the packed form; the rank tells the two apart (a packed
    call of one token has a leading 1 too)."""
    packed_dims = {"x": 3, "z": 3, "out": 3, "dt": 2, "B": 3, "C": 3}[name]
    if isinstance(v, torch.Tensor) and v.dim() == packed_dims + 1 and v.shape[0] == 1:
        return v[0]
    return v


def problem_of(t: dict, chunk_size, dt_softplus, state_dtype) -> VarlenProblem:
    """Validate a call's tensors and return its problem; ValueError or TypeError naming the
    argument otherwise. The chunk table's values are not read (that would wait for the device)."""
    x = t["x"]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    dev = x.device
    _tensor("x", x, (3,), dev)
    T, h, p = x.shape
    if T < 1:
        raise ValueError("x: no tokens (shape[0] is 0)")
    _shape("dt", _tensor("dt", t["dt"], (2,), dev), (T, h), "tokens, nheads of x")
    _shape("A", _tensor("A", t["A"], (1,), dev, (torch.float32,)), (h,), "one value per head")
    B = _tensor("B", t["B"], (3,), dev)
    g, n = B.shape[1], B.shape[2]
    if g < 1 or h % g:
        raise ValueError(f"B: ngroups={g} must divide nheads={h}")
    _shape("B", B, (T, g, n), "tokens, ngroups, dstate")
    _shape("C", _tensor("C", t["C"], (3,), dev), (T, g, n), "like B")
    if type(chunk_size) is not int or chunk_size not in (16, 32, 64, 128, 256, 512):
        raise ValueError(f"chunk_size: expected a power of two from 16 to 512, got {chunk_size!r}")
    cu = _tensor("cu_seqlens", t["cu_seqlens"], (1,), dev, _INTS)
    seqs = cu.shape[0] - 1
    if seqs < 1:
        raise ValueError("cu_seqlens: expected (seqs + 1,) offsets, got one entry")
    cuc = _tensor("cu_chunk_seqlens", t["cu_chunk_seqlens"], (1,), dev, _INTS)
    chunks = cuc.shape[0] - 1
    if chunks < 1:
        raise ValueError("cu_chunk_seqlens: expected (nchunks + 1,) offsets, got one entry")
    if chunks < -(-T // chunk_size):
        raise ValueError(f"cu_chunk_seqlens: {chunks} chunks cannot hold {T} tokens at chunk_size {chunk_size}")
    _shape("last_chunk_indices", _tensor("last_chunk_indices", t["last_chunk_indices"], (1,), dev, _INTS),
           (seqs,), "one per sequence")
    _shape("seq_idx", _tensor("seq_idx", t["seq_idx"], (1,), dev, _INTS), (chunks,), "one per chunk")
    for name in ("D", "dt_bias"):
        v = t.get(name)
        if v is not None:
            _tensor(name, v, (1, 2) if name == "D" else (1,), dev)
            _shape(name, v, (h,) if v.dim() == 1 else (h, p), "nheads, or nheads x headdim")
    z = t.get("z")
    if z is not None:
        _shape("z", _tensor("z", z, (3,), dev), x.shape, "like x")
    init = t.get("initial_states")
    if init is not None:
        _shape("initial_states", _tensor("initial_states", init, (4,), dev), (seqs, h, p, n),
               "seqs, nheads, headdim, dstate")
    out = t.get("out")
    if out is not None:
        _shape("out", _tensor("out", out, (3,), dev), x.shape, "like x")
        if out.dtype != x.dtype:
            raise TypeError(f"out: expected x's dtype {x.dtype}, got {out.dtype}")
        check_no_overlap("out", out)
    if state_dtype is not None and state_dtype not in DTYPES:
        raise TypeError(f"state_dtype: expected torch.float32, bfloat16 or float16, got {state_dtype!r}")
    dt_softplus = as_flag("dt_softplus", dt_softplus)
    if chunks * chunk_size * h >= 2**31:   # a head's offset into dt' and dA is 32-bit
        raise ValueError(f"x: {chunks} chunks of {chunk_size} x {h} heads pass 2**31 elements of dt'")
    if seqs > MAX_GRID_YZ or h > MAX_GRID_YZ:
        raise ValueError(f"x: {chunks} chunks / {seqs} sequences / {h} heads exceed the launch grid")
    for name in ("x", "z", "out", "B", "C"):
        v = t.get(name)
        if v is not None and max((sz - 1) * st for sz, st in zip(v.shape, v.stride())) >= 2**31:
            raise ValueError(f"{name}: offsets past 2**31 elements are not supported")
    D = t.get("D")
    return VarlenProblem(tokens=T, seqs=seqs, chunks=chunks, nheads=h, headdim=p, dstate=n, ngroups=g,
                         chunk_size=chunk_size, dtype=DTYPES[x.dtype],
                         state_dtype=DTYPES[state_dtype] if state_dtype is not None else "fp32",
                         has_D=D is not None, D_has_hdim=D is not None and D.dim() == 2, has_z=z is not None,
                         has_dt_bias=t.get("dt_bias") is not None, dt_softplus=dt_softplus,
                         has_init=init is not None)


# --- buffers and launches ---------------------------------------------------------------------
def allocate(problem: VarlenProblem, config: VarlenConfig, device, poison: bool = False,
             gluon: bool = False, keep_states: bool = True) -> dict:
    """The intermediates and outputs a call writes (poison: NaN-filled, so an element a kernel
    fails to write shows up). gluon: the Gluon walk and scan run (`gluon_gaps`): the walk stores
    each chunk's entering state for the scan ("entering", in the inputs' type), and every
    chunk's end state ("states", in the state dtype) only where the caller keeps them
    (keep_states); the tl stages always write them (their scan reads them)."""
    k, q, h, p, n, g = (problem.chunks, problem.chunk_size, problem.nheads, problem.headdim, problem.dstate,
                        problem.ngroups)
    sdt = TORCH_DTYPES[problem.state_dtype]
    make = torch.full if poison else torch.empty
    kw = dict(device=device)

    def new(*shape, dtype):
        return make(shape, float("nan"), dtype=dtype, **kw) if poison else make(shape, dtype=dtype, **kw)
    ends = keep_states or not gluon
    return dict(dtp=new(h, k, q, dtype=torch.float32), dA=new(h, k, q, dtype=torch.float32),
                cb=new(k, g, q, q, dtype=TORCH_DTYPES[problem.dtype]) if config.cb == "stage" else None,
                states=new(k, h, p, n, dtype=sdt) if ends else None,
                entering=new(k, h, p, n, dtype=TORCH_DTYPES[problem.dtype]) if gluon else None,
                final=new(problem.seqs, h, p, n, dtype=sdt))


def cdiv(a: int, b: int) -> int:
    # on the host, per call: triton.cdiv is a jit function, ~8 us per Python call
    return -(-a // b)


def plan(problem: VarlenProblem, config: VarlenConfig, t: dict, buf: dict, backend: str = "cuda",
         dt_limit=(0.0, float("inf"))) -> list:
    """The launches of a call on validated tensors `t` and buffers `buf` (`allocate`)."""
    opts = OP.launch_options(config, backend)
    k, q, h, p, n, g = (problem.chunks, problem.chunk_size, problem.nheads, problem.headdim, problem.dstate,
                        problem.ngroups)
    x, dt, B, C, y = t["x"], t["dt"], t["B"], t["C"], t["out"]
    cuc, last, seq = t["cu_chunk_seqlens"], t["last_chunk_indices"], t["seq_idx"]
    D, z, bias, init = t.get("D"), t.get("z"), t.get("dt_bias"), t.get("initial_states")
    dtp, dA, cb, st, fin = buf["dtp"], buf["dA"], buf["cb"], buf["states"], buf["final"]
    lo, hi = (float(v) for v in dt_limit)
    s_x, s_B, s_C, s_st = x.stride(), B.stride(), C.stride(), strides(st, 4)
    s_init = strides(init, 4)
    launches = [Launch("cumsum", "varlen_cumsum", (k, cdiv(h, config.cumsum_block_h)),
                       dict(dt_ptr=dt, A_ptr=t["A"], bias_ptr=bias, cu_chunk_ptr=cuc, dt_out_ptr=dtp,
                            dA_out_ptr=dA, H=h, dt_lo=lo, dt_hi=hi, s_dt_t=dt.stride(0), s_dt_h=dt.stride(1),
                            s_A_h=t["A"].stride(0), s_bias_h=bias.stride(0) if bias is not None else 0,
                            s_o_h=dtp.stride(0), s_o_c=dtp.stride(1)),
                       dict(CHUNK=q, HAS_BIAS=bias is not None, SOFTPLUS=problem.dt_softplus,
                            HAS_LIMIT=(lo, hi) != (0.0, float("inf"))), opts["cumsum"])]
    if config.cb == "stage":
        tiles = cdiv(q, config.bmm_block_m) * cdiv(q, config.bmm_block_n)
        launches.append(Launch("bmm", "varlen_bmm", (g * tiles, k),
                               dict(C_ptr=C, B_ptr=B, cu_chunk_ptr=cuc, cb_ptr=cb, N=n,
                                    s_C_t=s_C[0], s_C_g=s_C[1], s_C_n=s_C[2], s_B_t=s_B[0], s_B_g=s_B[1],
                                    s_B_n=s_B[2], s_cb_c=cb.stride(0), s_cb_g=cb.stride(1),
                                    s_cb_i=cb.stride(2), s_cb_j=cb.stride(3)),
                               dict(CHUNK=q), opts["bmm"]))
    if buf["entering"] is not None:   # allocated for the Gluon path: its walk, then its scan
        return launches + [gluon_walk(problem, config, t, buf), gluon_scan(problem, config, t, buf, opts)]
    # the chunk states, then the chain over each sequence's chunks from its initial state
    tiles = cdiv(p, config.state_block_m) * cdiv(n, config.state_block_n)
    launches.append(Launch("chunk_state", "varlen_chunk_state", (h * tiles, k),
                           dict(x_ptr=x, B_ptr=B, dt_ptr=dtp, dA_ptr=dA, cu_chunk_ptr=cuc, st_ptr=st,
                                P=p, N=n, heads_per_group=h // g,
                                s_x_t=s_x[0], s_x_h=s_x[1], s_x_p=s_x[2], s_B_t=s_B[0], s_B_g=s_B[1],
                                s_B_n=s_B[2], s_dt_h=dtp.stride(0), s_dt_c=dtp.stride(1),
                                s_st_c=s_st[0], s_st_h=s_st[1], s_st_p=s_st[2], s_st_n=s_st[3]),
                           dict(CHUNK=q), opts["chunk_state"]))
    launches.append(Launch("state_passing", "varlen_state_passing",
                           (cdiv(p * n, config.pass_block), h, problem.seqs),
                           dict(st_ptr=st, dA_ptr=dA, cu_chunk_ptr=cuc, last_chunk_ptr=last, init_ptr=init,
                                final_ptr=fin, N=n, PN=p * n, s_st_c=s_st[0], s_st_h=s_st[1],
                                s_dA_h=dA.stride(0), s_dA_c=dA.stride(1),
                                s_init_s=s_init[0], s_init_h=s_init[1], s_init_p=s_init[2], s_init_n=s_init[3],
                                s_fin_s=fin.stride(0), s_fin_h=fin.stride(1)),
                           dict(HAS_INIT=init is not None), opts["state_passing"]))
    tiles = cdiv(q, config.scan_block_m) * cdiv(p, config.scan_block_n)
    s_z, s_y, s_cb, s_D = strides(z, 3), y.stride(), strides(cb, 4), strides(D, 2)
    launches.append(Launch("chunk_scan", "varlen_chunk_scan", (h * tiles, k),
                           dict(x_ptr=x, z_ptr=z, y_ptr=y, C_ptr=C, B_ptr=B, cb_ptr=cb, dt_ptr=dtp, dA_ptr=dA,
                                st_ptr=st, init_ptr=init, D_ptr=D, cu_chunk_ptr=cuc, chunk_seq_ptr=seq,
                                P=p, N=n, heads_per_group=h // g,
                                s_x_t=s_x[0], s_x_h=s_x[1], s_x_p=s_x[2], s_z_t=s_z[0], s_z_h=s_z[1],
                                s_z_p=s_z[2], s_y_t=s_y[0], s_y_h=s_y[1], s_y_p=s_y[2],
                                s_C_t=s_C[0], s_C_g=s_C[1], s_C_n=s_C[2], s_B_t=s_B[0], s_B_g=s_B[1],
                                s_B_n=s_B[2], s_cb_c=s_cb[0], s_cb_g=s_cb[1], s_cb_i=s_cb[2], s_cb_j=s_cb[3],
                                s_dt_h=dtp.stride(0), s_dt_c=dtp.stride(1),
                                s_st_c=s_st[0], s_st_h=s_st[1], s_st_p=s_st[2], s_st_n=s_st[3],
                                s_init_s=s_init[0], s_init_h=s_init[1], s_init_p=s_init[2], s_init_n=s_init[3],
                                s_D_h=s_D[0], s_D_p=s_D[1] if D is not None and D.dim() == 2 else 0),
                           dict(CHUNK=q, HAS_INIT=init is not None, HAS_D=D is not None,
                                D_HAS_HDIM=D is not None and D.dim() == 2, HAS_Z=z is not None),
                           opts["chunk_scan"]))
    return launches


# --- config choice --------------------------------------------------------------------------
def choose(problem: VarlenProblem, arch: str, db=None, device: str | None = None, launch_mode: str = "eager"):
    """(config, why): the one selector's pick (`autossd.core.select`, by the lookup's rules)
    among the packed-prefill records of the tuning databases: an exact record, else the nearest
    in log2 tokens and (at half the weight) sequences with every other field equal (packed
    batches change length every call, so an exact match on the token count would almost never
    hit), else a record's config carried over (transfer), else the arch default. device: the
    GPU's name, whose own measurements rank first. A database that cannot be read is passed
    over with a warning."""
    m = _select.select("ssd_varlen", problem, arch, device, launch_mode, db, safe=True)
    return fit(m.config, problem), m.reason


# (problem, arch, device, launch mode) -> (config, why, backend): a call's choice without the selector's key
# (its database URL and GPU name cost more host time than the kernels of a short prefill)
_choices: dict = {}
CHOICES_MAX = 4096


@_select.on_clear
def clear_cache() -> None:
    _choices.clear()
    _violations.cache_clear()


@functools.lru_cache(maxsize=CHOICES_MAX)
def _violations(config: VarlenConfig, arch: str, problem: VarlenProblem) -> tuple[str, ...]:
    # a forced config's check, once per key: the tuner times eager calls with config= given, and
    # ~25 us of checks per call would count as host time the drop-in never spends
    return tuple(violations(config, arch, problem))


def _config_for(problem: VarlenProblem, device, mode: str = "eager") -> tuple[VarlenConfig, str, str]:
    """mode: "graph" while the call is captured in a CUDA graph (`launch_mode_of`), whose replays
    take no host time: the records timed by graph replay rank first there, the eager ones (host
    time included) elsewhere, as for the forward's drop-in."""
    arch = arch_of_device(device)
    key = (problem, arch, device, mode)
    hit = _choices.get(key)
    if hit is None:
        config, why = choose(problem, arch, device=_lookup.device_name(device), launch_mode=mode)
        hit = (config, why, get_arch(arch).backend)
        if len(_choices) >= CHOICES_MAX:
            _choices.clear()
        _choices[key] = hit
    return hit


# --- the launch cache -------------------------------------------------------------------------
# A prefill of many short sequences spends more host time planning and binding its launches (the
# Gluon path's 4 TMA descriptors and Gluon launches) than its kernels take: at 2.7b, 8192 tokens
# in 16 sequences, 0.59 ms an eager call against 0.24 ms replayed in a CUDA graph (H200). So, as
# for the forward and the backward, the first call of a key (problem, config, the tensors'
# metadata) plans, launches through triton's JIT and is recorded; later calls allocate their
# buffers and replay the record on their own tensors.
INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "cu_chunk_seqlens",
          "last_chunk_indices", "seq_idx", "out")   # every tensor of t a launch may take
BUFFERS = ("dtp", "dA", "cb", "states", "entering", "final")   # and of allocate's
LAUNCH_CACHE_MAX = 4096   # recorded calls kept; then start over (a server sees every length)
_launch_cache: dict = {}


@_select.on_clear
def clear_launch_cache() -> None:
    _launch_cache.clear()


def run(problem: VarlenProblem, config: VarlenConfig, t: dict, backend: str, dt_limit=(0.0, float("inf")),
        poison: bool = False, keep_states: bool = True) -> dict:
    """Launch a call's kernels (a recorded call replayed where one is kept); returns the buffers
    (y is t["out"]). keep_states: every chunk's end state is wanted (buf["states"])."""
    dev = t["x"].device
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else _nullcontext()
    with ctx:
        stream = _lc.replay_stream(dev)
        key = None if stream is None else (problem, config, backend, tuple(float(v) for v in dt_limit), poison,
                                           keep_states, _lc.input_sig(t, INPUTS))
        hit = _launch_cache.get(key) if key is not None else None
        if hit is not None:
            gluon, rec = hit
            buf = allocate(problem, config, dev, poison, gluon, keep_states)
            _lc.replay(rec, t, SimpleNamespace(**buf), stream)
            return buf
        module = load(config, backend)
        gluon = bool(config.state_walk) and not gluon_gaps(problem, config, t, backend)
        buf = allocate(problem, config, dev, poison, gluon, keep_states)
        launches = plan(problem, config, t, buf, backend, dt_limit)
        warm_up(launches, module)
        compiled = launch(launches, module)
        if key is not None and all(c is not None for c in compiled):
            rec = _lc.record(launches, compiled, t, SimpleNamespace(**buf), module, INPUTS, BUFFERS)
            _lc.remember(_launch_cache, key, (gluon, rec), LAUNCH_CACHE_MAX)
    return buf


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def ssd_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, D=None, z=None, dt_bias=None, initial_states=None,
               dt_softplus=False, dt_limit=(0.0, float("inf")), cu_chunk_seqlens=None, last_chunk_indices=None,
               seq_idx=None, out=None, return_intermediate_states=False, state_dtype=None, *,
               config: VarlenConfig | None = None, poison: bool = False):
    """Packed prefill: the SSD over many sequences packed along the token axis, each from its own
    initial state. Returns (y, final_states), or (y, final_states, chunk_states) with
    return_intermediate_states.

    x (T, nheads, headdim) (or (1, T, nheads, headdim)), dt (T, nheads), A (nheads,), B and C
    (T, ngroups, dstate), D (nheads,) or (nheads, headdim), z like x, dt_bias (nheads,);
    cu_seqlens (seqs + 1,) int32/int64, the offsets of the sequences; initial_states (seqs,
    nheads, headdim, dstate), each sequence's state before its first token here (a cached state:
    chunked prefill, prefix caching); a sequence without one takes zeros (pass a zero row).
    The chunk table (cu_chunk_seqlens, last_chunk_indices, seq_idx; see `varlen_chunks`) is built
    from cu_seqlens when not given (which reads cu_seqlens on the host; an engine that captures
    CUDA graphs passes its own). out (T, nheads, headdim) in x's dtype receives y.
    final_states (seqs, nheads, headdim, dstate) are each sequence's state after its last token,
    chunk_states (nchunks, ...) each chunk's end state, both in state_dtype (default float32).
    config forces a config (tests, the tuner); poison fills intermediates with NaN first (tests)."""
    x, dt, B, C, z, out = (_packed(k, v) for k, v in (("x", x), ("dt", dt), ("B", B), ("C", C), ("z", z),
                                                        ("out", out)))
    callers_table = cu_chunk_seqlens is not None
    if cu_chunk_seqlens is None or last_chunk_indices is None or seq_idx is None:
        if not (cu_chunk_seqlens is None and last_chunk_indices is None and seq_idx is None):
            raise ValueError("cu_chunk_seqlens, last_chunk_indices, seq_idx: pass all three (a chunk table) or none")
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
        cu_chunk_seqlens, last_chunk_indices, seq_idx = varlen_chunks(
            cu_seqlens, chunk_size, tokens=x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 3 else None)
    t = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
             cu_seqlens=cu_seqlens, cu_chunk_seqlens=cu_chunk_seqlens, last_chunk_indices=last_chunk_indices,
             seq_idx=seq_idx, out=out)
    sdt = None if state_dtype is None else DTYPES.get(state_dtype, state_dtype)
    if sdt is not None and sdt not in ("fp32", "bf16", "fp16"):
        raise TypeError(f"state_dtype: expected torch.float32, bfloat16 or float16, got {state_dtype!r}")
    problem = problem_of(t, chunk_size, dt_softplus, TORCH_DTYPES[sdt] if sdt else None)
    dt_limit = parse_dt_limit(dt_limit)
    dev = x.device
    if dev.type == "cpu" and not interpreting():
        raise RuntimeError("autossd: the inputs are on the CPU, but the kernels need a CUDA or ROCm GPU. Move "
                           "the tensors to the GPU, or set TRITON_INTERPRET=1 before importing triton to run "
                           "Triton's (slow) CPU interpreter.")
    # x, z, B, C with a strided last dimension are copied (the tiles load along it)
    for k in ("x", "z", "B", "C"):
        if t[k] is not None and t[k].stride(-1) != 1:
            t[k] = t[k].contiguous()
    if callers_table:   # values unchecked on the host: a clamped copy keeps the kernels in bounds
        from .varlen_guard import guard_table   # its kernel is defined at import: only where used
        t["cu_chunk_seqlens"], t["last_chunk_indices"], t["seq_idx"] = guard_table(
            *(t[k].contiguous() for k in ("cu_chunk_seqlens", "last_chunk_indices", "seq_idx")),
            problem.tokens, problem.chunk_size)
    if t["out"] is None:
        t["out"] = torch.empty(x.shape, dtype=x.dtype, device=dev)
    if config is None:
        config, _, backend = _config_for(problem, dev, launch_mode_of(x))
    else:
        if not isinstance(config, VarlenConfig):
            raise TypeError(f"config: expected a VarlenConfig, got {type(config).__name__}")
        arch = arch_of_device(dev)
        bad = _violations(config, arch, problem)
        if bad:
            raise ValueError(f"config: {config!r} cannot run {problem} on {arch}: {'; '.join(bad)}")
        backend = get_arch(arch).backend
    buf = run(problem, config, t, backend, dt_limit, poison, keep_states=bool(return_intermediate_states))
    if return_intermediate_states:
        return t["out"], buf["final"], buf["states"]
    return t["out"], buf["final"]


def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens,
                                     last_chunk_indices, seq_idx, out, D=None, z=None, dt_bias=None,
                                     initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                     return_intermediate_states=False, state_dtype=None):
    """The packed-prefill contract inference engines call (vLLM's function of this name): y into
    `out`; returns each sequence's final state (seqs, nheads, headdim, dstate), or with
    return_intermediate_states every chunk's end state (nchunks, ...), in state_dtype."""
    if out is None:
        raise ValueError("out: expected a (tokens, nheads, headdim) tensor to receive y")
    got = ssd_varlen(x, dt, A, B, C, chunk_size, cu_seqlens, D=D, z=z, dt_bias=dt_bias,
                     initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                     cu_chunk_seqlens=cu_chunk_seqlens, last_chunk_indices=last_chunk_indices, seq_idx=seq_idx,
                     out=out, return_intermediate_states=return_intermediate_states, state_dtype=state_dtype)
    return got[2] if return_intermediate_states else got[1]


# --- the tuner's and the compile report's hooks -------------------------------------------------
def tune_inputs(problem: VarlenProblem, device="cpu", seed: int = 0) -> dict:
    """Fresh random inputs (never zeros) for a packed batch of problem.seqs sequences, with the
    chunk table `varlen_chunks` cuts (its length must be problem.chunks: the lengths are drawn
    until it is, or the problem's chunk count is taken as given by `problem_for`)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    e = TORCH_DTYPES[problem.dtype]
    T, s, h, p, n, ng = (problem.tokens, problem.seqs, problem.nheads, problem.headdim, problem.dstate,
                         problem.ngroups)
    lens = lengths_for(problem, seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    cuc, last, seq = varlen_chunks(cu, problem.chunk_size)

    def rnd(*shape, dtype=e, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    dt = (torch.rand(T, h, generator=g) * 4 - 4 if problem.dt_softplus
          else torch.rand(T, h, generator=g) * 0.2 + 0.005).to(e).to(device)
    return dict(x=rnd(T, h, p), dt=dt, A=(-torch.rand(h, generator=g) * 4 - 0.5).to(device),
                B=rnd(T, ng, n), C=rnd(T, ng, n),
                D=(rnd(h, p, dtype=torch.float32) if problem.D_has_hdim else rnd(h, dtype=torch.float32))
                if problem.has_D else None,
                z=rnd(T, h, p) if problem.has_z else None,
                dt_bias=rnd(h, dtype=torch.float32, scale=0.5) if problem.has_dt_bias else None,
                initial_states=rnd(s, h, p, n, dtype=torch.float32, scale=0.5) if problem.has_init else None,
                cu_seqlens=cu.to(device), cu_chunk_seqlens=cuc.to(device), last_chunk_indices=last.to(device),
                seq_idx=seq.to(device), out=None)


def tune_reference(problem: VarlenProblem, t: dict):
    """float64 (y, final states)."""
    y, final, _ = varlen_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], t["cu_chunk_seqlens"],
                             t["last_chunk_indices"], t["seq_idx"], D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
                             initial_states=t["initial_states"], dt_softplus=problem.dt_softplus)
    return y, final


def tune_run(problem: VarlenProblem, config: VarlenConfig, t: dict, backend: str = "cuda", poison: bool = False):
    """The generated kernels of `config` on inputs `t`: (y, final states). poison: outputs and
    intermediates NaN-filled first (the gate's run)."""
    kw = {k: v for k, v in t.items() if k not in ("x", "dt", "A", "B", "C", "cu_seqlens")}
    return ssd_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], problem.chunk_size, t["cu_seqlens"],
                      dt_softplus=problem.dt_softplus, config=config,
                      state_dtype=TORCH_DTYPES[problem.state_dtype], poison=poison, **kw)


def meta_launches(problem: VarlenProblem, config: VarlenConfig, backend: str) -> list:
    """The plan's launches at `problem`'s shapes on meta tensors (the cross-compile report)."""
    T, s, k, h, p, n, g = (problem.tokens, problem.seqs, problem.chunks, problem.nheads, problem.headdim,
                           problem.dstate, problem.ngroups)
    e = TORCH_DTYPES[problem.dtype]

    def m(*shape, dtype=e):
        return torch.empty(*shape, dtype=dtype, device="meta")
    i32 = torch.int32
    t = dict(x=m(T, h, p), dt=m(T, h), A=m(h, dtype=torch.float32), B=m(T, g, n), C=m(T, g, n),
             D=(m(h, p, dtype=torch.float32) if problem.D_has_hdim else m(h, dtype=torch.float32))
             if problem.has_D else None,
             z=m(T, h, p) if problem.has_z else None,
             dt_bias=m(h, dtype=torch.float32) if problem.has_dt_bias else None,
             initial_states=m(s, h, p, n, dtype=torch.float32) if problem.has_init else None,
             cu_seqlens=m(s + 1, dtype=i32), cu_chunk_seqlens=m(k + 1, dtype=i32),
             last_chunk_indices=m(s, dtype=i32), seq_idx=m(k, dtype=i32), out=m(T, h, p))
    gluon = bool(config.state_walk) and not gluon_gaps(problem, config, t, backend)
    return plan(problem, config, t, allocate(problem, config, "meta", gluon=gluon), backend)


def stage_costs(problem: VarlenProblem, config: VarlenConfig) -> list:
    """Each launch's bytes, FLOPs, grid and tile for the static model (`autossd.tuner.model`): the
    forward's stages at the chunk table's size (every chunk taken as full)."""
    k, q, T, h, p, n, g = (problem.chunks, problem.chunk_size, problem.tokens, problem.nheads, problem.headdim,
                           problem.dstate, problem.ngroups)
    e = 4 if problem.dtype == "fp32" else 2
    s = 4 if problem.state_dtype == "fp32" else 2
    ddA = 2 * h * k * q * 4
    xb, bc, states = T * h * p * e, T * g * n * e, k * h * p * n * s
    c = config
    tri = q * (q + 1) / 2
    out = [StageCost("cumsum", k * cdiv(h, c.cumsum_block_h), T * h * e + ddA, 0.0, 0.0)]
    if c.cb == "stage":
        tiles = cdiv(q, c.bmm_block_m) * cdiv(q, c.bmm_block_n)
        out.append(StageCost("bmm", g * tiles * k, 2 * bc + k * g * q * q * e, 0.0, 2.0 * k * g * tri * n,
                             (c.bmm_block_m, c.bmm_block_n, c.bmm_block_k), c.bmm_stages))
    tiles = cdiv(p, c.state_block_m) * cdiv(n, c.state_block_n)
    out.append(StageCost("chunk_state", h * tiles * k, xb + bc + ddA + states,
                         (cdiv(p, c.state_block_m) - 1) * bc + (cdiv(n, c.state_block_n) - 1) * xb,
                         2.0 * T * h * p * n, (c.state_block_m, c.state_block_n, c.state_block_k), c.state_stages))
    out.append(StageCost("state_passing", cdiv(p * n, c.pass_block) * h * problem.seqs, 2 * states, 0.0,
                         2.0 * k * h * p * n, (c.pass_block, 1, 1), 1, chain=max(1, k // problem.seqs)))
    tiles = cdiv(q, c.scan_block_m) * cdiv(p, c.scan_block_n)
    cbf = 2.0 * k * g * tri * n * (h // g) if c.cb == "inline" else 0.0
    cbb = 0.0 if c.cb == "inline" else k * g * q * q * e
    out.append(StageCost("chunk_scan", h * tiles * k, xb * (3 if problem.has_z else 2) + bc + states + cbb + ddA,
                         (cdiv(p, c.scan_block_n) - 1) * (bc + cbb), 2.0 * k * h * tri * p + 2.0 * T * h * p * n + cbf,
                         (c.scan_block_m, c.scan_block_n, c.scan_block_k), c.scan_stages))
    return out


OP = register(Op(
    name="ssd_varlen",
    space=SPACE,
    config_type=VarlenConfig,
    stages=STAGES,
    sequences=SEQUENCES,
    template_dir="ssd_varlen",
    problem_type=VarlenProblem,
    includes=includes,
    render_context=render_context,
    plan=plan,
    meta_launches=meta_launches,
    tune_inputs=tune_inputs,
    tune_reference=tune_reference,
    tune_run=tune_run,
    reference=varlen_ref,
    cost_model=stage_costs,
    default_config=default_config,
    violations=violations,
    seeds=seed_configs,
    amd_options=(),
    caps=caps,
    static_caveat="against an H200 sweep of packed prefill (sm90, 66 configs) the model's top-1 ran 1.15x "
                  "the best and the arch default 1.05x: a static record may be slower than the default it "
                  "replaces",
    doc="Mamba-2 packed prefill: sequences packed along the token axis, each from its own state, "
        "with a chunk table whose chunks never straddle two sequences",
))
