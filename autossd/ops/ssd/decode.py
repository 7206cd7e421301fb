"""The decode step (`ssd_decode`), declared once, and its entry `selective_state_update`: a
drop-in for mamba_ssm's function of that name, in its Mamba-2 form (state (batch, nheads,
headdim, dstate)) and its Mamba-1 form (state (batch, dim, dstate): one head of headdim = dim,
whose dt, dt_bias and D vary over the channel and whose A is dense). A dense A, in either form,
runs the kernels rendered with `a_dense` (an exp per state element).

One launch per call. Each program owns one row (batch entry), BLOCK_P headdim rows of HEADS heads
and either all of dstate ("whole") or dstate in slices ("tiled"), or ("persistent") walks such
tiles of one head in a loop, as many programs as the SMs hold; every state tile is read once,
updated in fp32 and written once in the state's dtype, so the call streams the state at close to
copy bandwidth.

The host path is built for a step that runs thousands of times with the same shapes. The first
call of a key (every tensor's dtype, shape, strides, device and 16-byte alignment, the softplus
flag and the pad slot) validates the arguments, builds the `DecodeProblem`, picks the config
(an exact record of the tuning databases, else the arch default: no timing at run time), and
launches through Triton's JIT; the launch is recorded (`ops.common.launch_cache`). Later calls of
the key only build the key, allocate `out` where the caller gave none, and replay the compiled
kernel with the new pointers.
"""
from __future__ import annotations

import functools
import numbers
import operator
import threading

import torch

from ...arch import get_arch
from ...core import select as _select
from ...core.cost import StageCost
from ...core.device import arch_of_device
from ...db import lookup as _lookup
from ...problem import DTYPES, TORCH_DTYPES, as_flag
from ...render import interpreting, load
from ..common.checks import check_no_overlap
from ..common import launch_cache as _lc
from ..registry import Op, Stage, register
from .naive import state_update_ref
from .plan import Launch
from .decode_knobs import (MAX_GRID_YZ, SPACE, DecodeConfig, DecodeProblem, caps,  # noqa: F401
                           default_config, excluded, pow2_at_least, violations)

PAD_SLOT_ID = -1   # what vLLM marks a padded row of a continuous batch with
STAGES = (Stage("decode", "warps", "stages"),)
SEQUENCES = {"whole": ("decode",), "tiled": ("decode",), "persistent": ("decode",)}
# every tensor a launch takes, by the names the plan and the launch cache use
NAMES = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "idx", "out")


def includes(cfg: DecodeConfig, backend: str) -> list[str]:
    """The template files a config's module holds: the helpers, then its layout's kernel."""
    return ["common.jinja", f"{cfg.layout}.jinja"]


def render_context(cfg: DecodeConfig, backend: str) -> dict:
    return {}


# --- strides in the kernel's (row, token, head, col) order ----------------------------------
def _s4(t, head_only: bool = False) -> tuple[int, int, int, int]:
    """(row, token, head, col) strides of x, z, out, dt, B or C: 3-D (one token) or 4-D (T
    tokens); dt may lack its last dimension (one value per head: stride 0 over headdim)."""
    s = t.stride()
    if head_only:   # dt (b, h) or (b, T, h)
        return (s[0], 0, s[1], 0) if t.dim() == 2 else (s[0], s[1], s[2], 0)
    return (s[0], 0, s[1], s[2]) if t.dim() == 3 else tuple(s)


def _s2(t) -> tuple[int, int]:
    """(head, col) strides of D or dt_bias: (h,) (tied over headdim) or (h, p); none: (0, 0)."""
    if t is None:
        return (0, 0)
    s = t.stride()
    return (s[0], 0) if t.dim() == 1 else (s[0], s[1])


def _m1_s4(t) -> tuple[int, int, int, int]:
    """The Mamba-1 form's x, dt, z, out, B or C, (batch, [tokens,] dim or dstate), as (row,
    token, head, col) strides of its one head."""
    s = t.stride()
    return (s[0], 0, 0, s[1]) if t.dim() == 2 else (s[0], s[1], 0, s[2])


def _m1_s2(t) -> tuple[int, int]:
    """The Mamba-1 form's D or dt_bias, (dim,) or (1, dim): (head, col) strides; none: (0, 0)."""
    if t is None:
        return (0, 0)
    return (0, t.stride(0)) if t.dim() == 1 else tuple(t.stride())


def strides(t: dict, multi: bool) -> dict[str, tuple[int, ...]]:
    """Each tensor's strides in the kernel's order: the state (slot, head, row, col), A (head,
    row, col), D and dt_bias (head, col), the others (row, token, head, col). A 3-D state is the
    Mamba-1 form: one head, whose axis no tensor has (A and the per-channel parameters may carry
    it with size 1). multi: a Mamba-2 form's x is (batch, T, nheads, headdim)."""
    st, A = t["state"], t["A"]
    z = t.get("z")
    if st.dim() == 3:
        s = st.stride()
        return dict(state=(s[0], 0, s[1], s[2]),
                    A=(0,) + tuple(A.stride()) if A.dim() == 2 else tuple(A.stride()),
                    D=_m1_s2(t.get("D")), dt_bias=_m1_s2(t.get("dt_bias")),
                    z=_m1_s4(z) if z is not None else (0, 0, 0, 0),
                    **{k: _m1_s4(t[k]) for k in ("x", "dt", "B", "C", "out")})
    dt = t["dt"]
    return dict(state=tuple(st.stride()),
                A=(A.stride(0), 0, 0) if A.dim() == 1 else tuple(A.stride()),
                D=_s2(t.get("D")), dt_bias=_s2(t.get("dt_bias")),
                z=_s4(z) if z is not None else (0, 0, 0, 0),
                dt=_s4(dt, dt.dim() == (3 if multi else 2)),
                **{k: _s4(t[k]) for k in ("x", "B", "C", "out")})


def plan(problem: DecodeProblem, config: DecodeConfig, t: dict, buffers=None, backend: str = "cuda",
         dt_softplus: bool | None = None, pad_slot_id: int = PAD_SLOT_ID) -> list:
    """The one launch of a call on validated tensors `t` (names of NAMES; x, dt, B, C, z and out
    as the caller passed them, in the Mamba-2 form or the Mamba-1 form)."""
    st, x = t["state"], t["x"]
    heads = config.heads
    h, p, n = problem.nheads, problem.headdim, problem.dstate
    grid = (problem.batch, -(-p // config.block_p), -(-h // heads))
    if config.layout == "persistent":
        grid = (programs(problem, config, st.device), 1, 1)
    args = dict(
        state_ptr=st, x_ptr=x, dt_ptr=t["dt"], A_ptr=t["A"], B_ptr=t["B"], C_ptr=t["C"], D_ptr=t.get("D"),
        z_ptr=t.get("z"), dtb_ptr=t.get("dt_bias"), idx_ptr=t.get("idx"), out_ptr=t["out"],
        nslots=st.shape[0], T=problem.tokens, H=h, P=p, N=n, HPG=h // problem.ngroups,
        pad_slot=int(pad_slot_id))
    s = strides(t, problem.tokens > 1 or x.dim() == 4)
    names4 = ("b", "t", "h", "p")
    for pre, key, axes in (("s_st", "state", ("b", "h", "p", "n")), ("s_x", "x", names4), ("s_dt", "dt", names4)):
        args.update({f"{pre}_{k}": v for k, v in zip(axes, s[key])})
    args["s_A_h"] = s["A"][0]
    if config.a_dense:   # the dense kernel reads A over headdim and dstate too
        args["s_A_p"], args["s_A_n"] = s["A"][1], s["A"][2]
    for pre, key in (("s_B", "B"), ("s_C", "C")):
        args.update({f"{pre}_{k}": v for k, v in zip(("b", "t", "g", "n"), s[key])})
    args.update(zip(("s_D_h", "s_D_p"), s["D"]))
    args.update({f"s_z_{k}": v for k, v in zip(names4, s["z"])})
    args.update(zip(("s_dtb_h", "s_dtb_p"), s["dt_bias"]))
    args.update({f"s_o_{k}": v for k, v in zip(names4, s["out"])})
    idx = t.get("idx")
    args["s_idx"] = idx.stride(0) if idx is not None else 0
    if config.layout == "persistent":
        args["ROWS"] = problem.batch
    softplus = problem.dt_softplus if dt_softplus is None else bool(dt_softplus)
    constexprs = dict(HAS_D=problem.has_D, HAS_Z=problem.has_z, HAS_DT_BIAS=problem.has_dt_bias,
                      SOFTPLUS=softplus, HAS_IDX=idx is not None, N2=max(16, pow2_at_least(n)))
    options = OP.launch_options(config, backend)["decode"]
    return [Launch("decode", f"ssd_decode_{config.layout}", grid, args, constexprs, options)]


# State bytes a persistent walk keeps loading per SM: about what the memory's bandwidth times its
# latency under load spreads over the SMs (H100: 3.35 TB/s x ~2.5 us / 132 SMs is ~63 KB).
IN_FLIGHT_PER_SM = 64 << 10


def programs(problem: DecodeProblem, config: DecodeConfig, device) -> int:
    """The persistent layout's program count: per SM, enough programs that their pipelined tiles
    (stages of them each) keep IN_FLIGHT_PER_SM loading, no more than an SM runs at once (its
    threads over a program's, at most 32), and no more programs than tiles. Elsewhere (the
    interpreter, the meta tensors of a cross-compile report) three, so that the walk loops."""
    tiles = problem.batch * problem.nheads * -(-problem.headdim // config.block_p)
    if getattr(device, "type", None) != "cuda":
        return min(tiles, 3)
    sms, threads, warp = _device_limits(device.index if device.index is not None else torch.cuda.current_device())
    tile = config.block_p * problem.dstate * (4 if problem.state_dtype == "fp32" else 2)
    per_sm = -(-IN_FLIGHT_PER_SM // (config.stages * tile))
    return min(tiles, sms * max(1, min(per_sm, 32, threads // (config.warps * warp))))


@functools.lru_cache(maxsize=None)
def _device_limits(index: int) -> tuple[int, int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.max_threads_per_multi_processor, getattr(props, "warp_size", 32)


# --- validation (once per call key) ---------------------------------------------------------
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _tensor(name: str, v, dims: tuple[int, ...], device) -> torch.Tensor:
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
    if v.dim() not in dims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, dims))} dimensions, got shape {tuple(v.shape)}")
    if v.dtype not in _FLOATS and name != "state_batch_indices":
        raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {v.dtype}")
    if device is not None and v.device != device:
        raise ValueError(f"{name}: on {v.device}, but state is on {device}")
    return v


def _shape(name: str, v, want: tuple, what: str) -> None:
    if tuple(v.shape) != tuple(want):
        raise ValueError(f"{name}: expected shape {tuple(want)} ({what}), got {tuple(v.shape)}")


def _dense(A) -> bool:
    """Whether A varies over headdim or dstate (its last two axes): a stride other than 0 over an
    axis longer than one. A (nheads,), or expanded over both with stride 0, is one value a head."""
    return A.dim() > 1 and any(A.stride(i) != 0 and A.shape[i] > 1 for i in (-2, -1))


def _mamba2_form(t: dict, st, dev) -> tuple:
    """The Mamba-2 form's tensors checked: (batch, tokens, nheads, headdim, dstate, ngroups)."""
    nslots, h, p, n = st.shape
    x = _tensor("x", t["x"], (3, 4), dev)
    multi = x.dim() == 4
    b = x.shape[0]
    T = x.shape[1] if multi else 1
    lead = (b, T) if multi else (b,)
    _shape("x", x, lead + (h, p), "batch, [tokens,] nheads, headdim of state")
    if T < 1 or b < 1:
        raise ValueError(f"x: an empty batch or token axis, shape {tuple(x.shape)}")
    dt = _tensor("dt", t["dt"], (x.dim() - 1, x.dim()), dev)
    if dt.dim() == x.dim():
        _shape("dt", dt, lead + (h, p), "like x, e.g. one value per head expanded over headdim")
    else:
        _shape("dt", dt, lead + (h,), "one value per head")
    A = _tensor("A", t["A"], (1, 3), dev)
    if A.dim() == 3:
        _shape("A", A, (h, p, n), "nheads, headdim, dstate")
    else:
        _shape("A", A, (h,), "one value per head")
    B = _tensor("B", t["B"], (x.dim(),), dev)
    g = B.shape[-2]
    if g < 1 or h % g:
        raise ValueError(f"B: ngroups={g} must divide nheads={h}")
    _shape("B", B, lead + (g, n), "batch, [tokens,] ngroups, dstate")
    C = _tensor("C", t["C"], (x.dim(),), dev)
    _shape("C", C, lead + (g, n), "like B")
    for name in ("D", "dt_bias"):
        v = t.get(name)
        if v is not None:
            _tensor(name, v, (1, 2), dev)
            _shape(name, v, (h,) if v.dim() == 1 else (h, p), "nheads, or nheads x headdim")
    return b, T, h, p, n, g


def _mamba1_form(t: dict, st, dev) -> tuple:
    """The Mamba-1 form's tensors checked (a 3-D state: one head of headdim = dim, no head axis):
    state (batch or cache slots, dim, dstate); x (batch, dim), or (batch, T, dim) for T tokens;
    dt, z, out like x; B, C (batch, [T,] dstate); A (dim, dstate); D, dt_bias (dim,). A, D and
    dt_bias may carry the head axis of one, as in the Mamba-2 form."""
    nslots, p, n = st.shape
    x = _tensor("x", t["x"], (2, 3), dev)
    multi = x.dim() == 3
    b = x.shape[0]
    T = x.shape[1] if multi else 1
    lead = (b, T) if multi else (b,)
    _shape("x", x, lead + (p,), "batch, [tokens,] dim of state: the Mamba-1 form, as a 3-D state is")
    if T < 1 or b < 1:
        raise ValueError(f"x: an empty batch or token axis, shape {tuple(x.shape)}")
    _shape("dt", _tensor("dt", t["dt"], (x.dim(),), dev), x.shape, "like x: the Mamba-1 form, as a 3-D state is")
    A = _tensor("A", t["A"], (2, 3), dev)
    _shape("A", A, (p, n) if A.dim() == 2 else (1, p, n), "dim, dstate: the Mamba-1 form, as a 3-D state is")
    for name in ("B", "C"):
        _shape(name, _tensor(name, t[name], (x.dim(),), dev), lead + (n,),
               "batch, [tokens,] dstate: the Mamba-1 form, as a 3-D state is")
    for name in ("D", "dt_bias"):
        v = t.get(name)
        if v is not None:
            _tensor(name, v, (1, 2), dev)
            _shape(name, v, (p,) if v.dim() == 1 else (1, p), "dim: the Mamba-1 form, as a 3-D state is")
    return b, T, 1, p, n, 1


def problem_of(t: dict, dt_softplus, pad_slot_id) -> DecodeProblem:
    """Validate a call's tensors (names of NAMES) and return its problem; ValueError or TypeError
    naming the argument otherwise. Index values are not read (that would wait for the device):
    the kernel skips an index outside the state (see the entry's docstring)."""
    st = t["state"]
    if not isinstance(st, torch.Tensor):
        raise TypeError(f"state: expected a torch.Tensor, got {type(st).__name__}")
    if st.dim() not in (3, 4):
        raise ValueError(f"state: expected (batch or cache slots, nheads, headdim, dstate) (the Mamba-2 form) "
                         f"or (batch or cache slots, dim, dstate) (the Mamba-1 form), got shape {tuple(st.shape)}")
    if st.dtype not in _FLOATS:
        raise TypeError(f"state: expected float32, bfloat16 or float16, got {st.dtype}")
    dev = st.device
    b, T, h, p, n, g = (_mamba1_form if st.dim() == 3 else _mamba2_form)(t, st, dev)
    x = t["x"]
    z = t.get("z")
    if z is not None:
        _shape("z", _tensor("z", z, (x.dim(),), dev), x.shape, "like x")
    idx = t.get("idx")
    if idx is None:
        if st.shape[0] != b:
            raise ValueError(f"state: {st.shape[0]} rows for a batch of {b}; pass state_batch_indices to "
                             "update chosen cache slots")
    else:
        _tensor("state_batch_indices", idx, (1,), dev)
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"state_batch_indices: expected int32 or int64, got {idx.dtype}")
        _shape("state_batch_indices", idx, (b,), "one cache slot per row")
    out = t.get("out")
    if out is not None:
        _shape("out", _tensor("out", out, (x.dim(),), dev), x.shape, "like x")
        check_no_overlap("out", out)
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, numbers.Integral):   # not a tensor: no host read
        raise TypeError(f"pad_slot_id: expected an int, got {type(pad_slot_id).__name__}")
    dt_softplus = as_flag("dt_softplus", dt_softplus)
    if dev.type == "cuda" and b > 2**31 - 1:
        raise ValueError(f"x: batch {b} exceeds the grid")
    if h > MAX_GRID_YZ:
        raise ValueError(f"state: nheads={h} exceeds the launch grid's limit {MAX_GRID_YZ}")
    return DecodeProblem(batch=b, nheads=h, headdim=p, dstate=n, ngroups=g, dtype=DTYPES[x.dtype],
                         state_dtype=DTYPES[st.dtype], has_D=t.get("D") is not None, has_z=z is not None,
                         has_dt_bias=t.get("dt_bias") is not None, dt_softplus=dt_softplus, tokens=T,
                         A_dense=_dense(t["A"]))


# --- config choice --------------------------------------------------------------------------
def choose(problem: DecodeProblem, arch: str, db=None, device: str | None = None):
    """(config, why): the one selector's pick (`autossd.core.select`, by `autossd.db.lookup`'s
    rules; a database that cannot be read is passed over with a warning) among the decode records
    of the tuning databases (user first, then shipped): an exact record, else the nearest in
    batch, heads and groups (a batch of 32 takes the record of 16 or 64), else a record's config
    carried over (transfer), else the arch default. device: the GPU's name, whose own
    measurements rank first.

    The records timed by graph replay rank first, whether the call is captured or not: the step
    is one launch, so an eager timing adds the host's launch cost (about 13 us on an H200, where
    the step's GPU time is 3-90 us) whatever the config, and ranks configs by host noise; the
    graph timing is the GPU time either way of launching has to pay."""
    m = _select.select("ssd_decode", problem, arch, device, "graph", db, safe=True)
    return m.config, m.reason


# --- the entry ------------------------------------------------------------------------------
class _Call:
    """What the calls of one key share: the problem, the config, its module, the launch record."""
    __slots__ = ("problem", "config", "why", "module", "backend", "device", "record", "softplus", "pad")

    def __init__(self, problem, config, why, module, backend, device, softplus, pad):
        self.problem, self.config, self.why, self.module = problem, config, why, module
        self.backend, self.device, self.softplus, self.pad = backend, device, softplus, pad
        self.record = None


_calls: dict = {}
_calls_lock = threading.Lock()
CALLS_MAX = 4096


_recent = _lc.RecentCalls(NAMES)


@_select.on_clear
def clear_cache() -> None:
    """Forget every call key's config and launch record (e.g. after a tuning-database write)."""
    with _calls_lock:
        _calls.clear()
        _recent.clear()


def _prepare(t: dict, dt_softplus, pad_slot_id, config: DecodeConfig | None) -> _Call:
    prob = problem_of(t, dt_softplus, pad_slot_id)
    dev = t["state"].device
    if dev.type == "cpu" and not interpreting():
        raise RuntimeError("autossd: the inputs are on the CPU, but the decode kernel needs a CUDA or ROCm "
                           "GPU. Move the tensors to the GPU, or set TRITON_INTERPRET=1 before importing "
                           "triton to run Triton's (slow) CPU interpreter.")
    arch = arch_of_device(dev)
    if config is None:
        config, why = choose(prob, arch, device=_lookup.device_name(dev))
    else:
        if not isinstance(config, DecodeConfig):
            raise TypeError(f"config: expected a DecodeConfig, got {type(config).__name__}")
        bad = violations(config, arch, prob)
        if bad:
            raise ValueError(f"config: {config!r} cannot run {prob} on {arch}: {'; '.join(bad)}")
        why = "given"
    backend = get_arch(arch).backend
    return _Call(prob, config, why, load(config, backend), backend, dev, prob.dt_softplus, operator.index(pad_slot_id))


def _launch(call: _Call, t: dict) -> None:
    if call.record is not None and call.device.index in (None, torch.cuda.current_device()):
        _lc.replay(call.record, t, None)
        return
    launches = plan(call.problem, call.config, t, None, call.backend, call.softplus, call.pad)
    ln = launches[0]
    kernel = getattr(call.module, ln.kernel)
    if call.device.type == "cuda" and call.device.index not in (None, torch.cuda.current_device()):
        with torch.cuda.device(call.device):
            kernel[ln.grid](**ln.args, **ln.constexprs, **ln.options)
        return
    ck = kernel[ln.grid](**ln.args, **ln.constexprs, **ln.options)
    if call.device.type != "cpu" and ck is not None and _lc.enabled():
        call.record = _lc.record(launches, [ck], t, None, call.module, NAMES, ())


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, pad_slot_id=PAD_SLOT_ID, out=None, *,
                           config: DecodeConfig | None = None):
    """One decode step of the Mamba-2 (or Mamba-1) recurrence, state updated in place.

    state (batch or cache slots, nheads, headdim, dstate) in fp32, bf16 or fp16 (read, updated in
    fp32, written back in its dtype); x (batch, nheads, headdim), or (batch, T, nheads, headdim)
    for T tokens per row in one step (e.g. verifying speculated tokens: the state stays in fp32
    registers between them, one read and one write); dt like x, or without headdim (batch,
    [T,] nheads); Mamba-2 passes it expanded over headdim with stride 0, as A (nheads, headdim,
    dstate) with strides 0 over headdim and dstate, and D and dt_bias (nheads, headdim) with
    stride 0 over headdim; (nheads,) forms are taken as well, and D, dt_bias and dt may also vary
    over headdim. B, C (batch, [T,] ngroups, dstate); z like x. A (nheads, headdim, dstate) may
    also hold a value per channel and state (a dense A: an exp per state element).
    The Mamba-1 form: state (batch or cache slots, dim, dstate); x (batch, dim), or (batch, T,
    dim); dt and z like x; A (dim, dstate); B, C (batch, [T,] dstate); D, dt_bias (dim,). It is
    the Mamba-2 form with one head of headdim = dim; out is (batch, [T,] dim).
    Per row and head: dt' = softplus?(dt + dt_bias); state = state exp(dt' A) + dt' x ⊗ B[group];
    out = state · C[group] + D x, times z sigmoid(z).
    state_batch_indices (batch,) int32/int64: the cache slot each row updates (continuous
    batching); a row at pad_slot_id leaves the state as it is and gets a zero output. An index
    outside the state is not checked on the host (that would wait for the device): such a row is
    skipped like a pad row and its output is NaN. Returns out (batch, [T,] nheads, headdim) in
    x's dtype, or writes the caller's `out`, which must not share memory with the state (an
    expanded `out` is refused; one aliasing the state is not looked for, as that would cost a
    check on every call). `config` forces a config (tests, the tuner)."""
    args = (state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices, out)
    gen = _recent.generation   # before the lookup: a clear_cache since then voids what it finds
    try:
        # as given, with their types: "False", 1.0 or -1.0 must not key as True, 1 or -1 (equal and
        # hashing alike), or a call refused on its own would be accepted after a good one
        extra = (type(dt_softplus), dt_softplus, type(pad_slot_id), pad_slot_id, config)
        hit = _recent.find(args, extra)
    except (TypeError, ValueError, RuntimeError):   # an odd argument: the checked path names it
        extra = hit = None
    if hit is not None:   # a kept key: replay with no key built (see launch_cache.RecentCalls)
        call, names, ptrs = hit
        y = out
        if out is None:   # out was absent from the key: its pointer goes last
            y = torch.empty_like(x)
            names = names + ("out",)
            ptrs.append(y.data_ptr())
        if _lc.replay_ptrs(call.record, names, ptrs, call.device.index):
            return y
    t = dict(zip(NAMES, args))
    try:
        key = (_lc.input_sig(t, NAMES), type(dt_softplus), dt_softplus, type(pad_slot_id), pad_slot_id, config)
        call = _calls.get(key)
    except (AttributeError, TypeError):   # a non-tensor or an unhashable argument: validation says which
        key, call = None, None
    if call is None:
        call = _prepare(t, dt_softplus, pad_slot_id, config)
        if key is not None:
            with _calls_lock:
                _lc.remember(_calls, key, call, CALLS_MAX)
    if out is None:   # x's layout, as mamba_ssm's (a record keeps out's strides: x's key fixes them)
        out = t["out"] = torch.empty_like(x)
    _launch(call, t)
    if hit is None and extra is not None and key is not None and call.record is not None \
            and _lc.pointers_only(call.record):
        _recent.add(args, extra, call, gen)
    return out


def kernel_for(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
               state_batch_indices=None, pad_slot_id=PAD_SLOT_ID) -> tuple:
    """(problem, config, why) a call with these arguments runs with (no launch)."""
    t = {"state": state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
         "idx": state_batch_indices, "out": None}
    c = _prepare(t, dt_softplus, pad_slot_id, None)
    return c.problem, c.config, c.why


# --- the tuner's and the compile report's hooks -------------------------------------------------
def tune_inputs(problem: DecodeProblem, device="cpu", seed: int = 0) -> dict:
    """Fresh random inputs (never zeros) in the forms Mamba-2 passes them: dt, A, D and dt_bias
    expanded over headdim (and dstate) with stride 0; for a dense A (A_dense), the forms of a
    Mamba-1 layer: A (nheads, headdim, dstate) and dt, D and dt_bias varying over headdim."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, T, h, p, n, ng = (problem.batch, problem.tokens, problem.nheads, problem.headdim, problem.dstate,
                         problem.ngroups)
    lead = (b, T) if T > 1 else (b,)
    e = TORCH_DTYPES[problem.dtype]

    def rnd(*shape, dtype=e, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    dt = (torch.rand(*lead, h, generator=g) * 4 - 4 if problem.dt_softplus
          else torch.rand(*lead, h, generator=g) * 0.2 + 0.005).to(e).to(device)
    if problem.A_dense:
        dt = (torch.rand(*lead, h, p, generator=g) * 4 - 4 if problem.dt_softplus
              else torch.rand(*lead, h, p, generator=g) * 0.2 + 0.005).to(e).to(device)
        return dict(state=rnd(b, h, p, n, dtype=TORCH_DTYPES[problem.state_dtype]), x=rnd(*lead, h, p), dt=dt,
                    A=(-torch.rand(h, p, n, generator=g) * 4 - 0.5).to(device),
                    B=rnd(*lead, ng, n), C=rnd(*lead, ng, n),
                    D=rnd(h, p, dtype=torch.float32) if problem.has_D else None,
                    z=rnd(*lead, h, p) if problem.has_z else None,
                    dt_bias=rnd(h, p, dtype=torch.float32, scale=0.5) if problem.has_dt_bias else None)
    t = dict(state=rnd(b, h, p, n, dtype=TORCH_DTYPES[problem.state_dtype]), x=rnd(*lead, h, p),
             dt=dt.unsqueeze(-1).expand(*lead, h, p),
             A=(-torch.rand(h, generator=g) * 4 - 0.5).to(device)[:, None, None].expand(h, p, n),
             B=rnd(*lead, ng, n), C=rnd(*lead, ng, n),
             D=rnd(h, dtype=torch.float32)[:, None].expand(h, p) if problem.has_D else None,
             z=rnd(*lead, h, p) if problem.has_z else None,
             dt_bias=rnd(h, dtype=torch.float32, scale=0.5)[:, None].expand(h, p) if problem.has_dt_bias else None)
    return t


def tune_reference(problem: DecodeProblem, t: dict):
    """float64 (out, new state)."""
    return state_update_ref(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"],
                            problem.dt_softplus)


def tune_run(problem: DecodeProblem, config: DecodeConfig, t: dict, backend: str = "cuda", poison: bool = False):
    """The generated kernel of `config` on a copy of the state: (out, new state). poison: the
    output written into a NaN-filled buffer (the gate's run)."""
    import torch
    state = t["state"].clone()
    out = torch.full_like(t["x"], float("nan")) if poison else None
    out = selective_state_update(state, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"],
                                 problem.dt_softplus, config=config, out=out)
    return out, state


def tune_time(problem: DecodeProblem, config: DecodeConfig, t: dict, backend: str = "cuda"):
    """What a measured tune times: the step on the inputs' own state, updated in place as a model
    updates its cache (tune_run's copy of the state would double the bytes timed). The state stays
    finite over repeated steps: each decays by exp(dt A) < 1 before its update."""
    return selective_state_update(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                  t["dt_bias"], problem.dt_softplus, config=config)


def meta_launches(problem: DecodeProblem, config: DecodeConfig, backend: str) -> list:
    """The launch at `problem`'s shapes on meta tensors (the cross-compile report)."""
    return plan(problem, config, _meta_inputs(problem), None, backend)


def _meta_inputs(problem: DecodeProblem) -> dict:
    b, T, h, p, n, g = (problem.batch, problem.tokens, problem.nheads, problem.headdim, problem.dstate,
                        problem.ngroups)
    lead = (b, T) if T > 1 else (b,)
    e = TORCH_DTYPES[problem.dtype]

    def m(*shape, dtype=e):
        return torch.empty(*shape, dtype=dtype, device="meta")

    dense = problem.A_dense
    return dict(state=m(b, h, p, n, dtype=TORCH_DTYPES[problem.state_dtype]), x=m(*lead, h, p),
                dt=m(*lead, h, p) if dense else m(*lead, h, 1).expand(*lead, h, p),
                A=m(h, p, n, dtype=torch.float32) if dense else m(h, 1, 1, dtype=torch.float32).expand(h, p, n),
                B=m(*lead, g, n), C=m(*lead, g, n),
                D=(m(h, p, dtype=torch.float32) if dense else m(h, 1, dtype=torch.float32).expand(h, p))
                if problem.has_D else None,
                z=m(*lead, h, p) if problem.has_z else None,
                dt_bias=(m(h, p, dtype=torch.float32) if dense else m(h, 1, dtype=torch.float32).expand(h, p))
                if problem.has_dt_bias else None,
                idx=None, out=m(*lead, h, p))


def stage_costs(problem: DecodeProblem, config: DecodeConfig) -> list:
    """The one launch's bytes (every operand once: `DecodeProblem.min_bytes`) and FLOPs, and the
    state bytes each program has loading at once (StageCost.inflight): the step streams its state
    and is bound by how many bytes each SM keeps in flight (tuner/model.py, _stream_time).

    - whole: one (BLOCK_P, dstate) tile per head. The heads of a program run one after another:
      a head's state load cannot move above the previous head's stores (the compiler cannot tell
      they do not alias), so a program has one head's tile loading at once; more heads per
      program only mean fewer, longer programs. On the H200, 2 heads per program ran 1.13-1.27x
      faster than 1 where a program's loads were few (4 or 8 rows on 4 or 8 warps), not the 2x
      of two tiles in flight.
      With T tokens, the x, B, C loads of each later token are another round trip with no state
      load in flight, so the tile counts 1/T (an assumption; multi-token steps were not swept).
    - tiled: one (BLOCK_P, BLOCK_N) slice at a time; the slices of a head are a loop of loads.
    - persistent: each program keeps `stages` tiles loading (its software-pipelined walk), and the
      launch holds programs to about IN_FLIGHT_PER_SM bytes per SM (`programs`)."""
    heads = 1 if config.layout == "persistent" else config.heads   # the walk: one head a tile
    grid = problem.batch * -(-problem.headdim // config.block_p) * -(-problem.nheads // heads)
    width = config.block_n if config.layout == "tiled" else max(16, pow2_at_least(problem.dstate))
    tile = config.block_p * min(width, problem.dstate) * (4 if problem.state_dtype == "fp32" else 2)
    cap = 0
    if config.layout == "persistent":
        inflight = config.stages * tile
        cap = -(-IN_FLIGHT_PER_SM // inflight)
    elif config.layout == "tiled":
        inflight = tile
    else:
        inflight = tile / problem.tokens
    return [StageCost("decode", grid, float(problem.min_bytes()), 0.0, float(problem.flops()),
                      (config.block_p, width, 1), config.stages, inflight=float(inflight), resident_cap=cap)]


OP = register(Op(
    name="ssd_decode",
    space=SPACE,
    config_type=DecodeConfig,
    stages=STAGES,
    sequences=SEQUENCES,
    template_dir="ssd_decode",
    problem_type=DecodeProblem,
    includes=includes,
    render_context=render_context,
    plan=plan,
    meta_launches=meta_launches,
    tune_inputs=tune_inputs,
    tune_reference=tune_reference,
    tune_run=tune_run,
    tune_time=tune_time,
    reference=state_update_ref,
    cost_model=stage_costs,
    default_config=default_config,
    violations=violations,
    caps=caps,
    excluded=excluded,
    static_caveat="against the H200 sweeps of the decode step (sm90, whole-dstate tiles, batch 1 to 64) the "
                  "model ranked configs at Spearman 0.68 to 0.87, but its top-1 ran up to 1.04x the best at "
                  "batch 64 where the default was within 0.1%: a searched static record may be slower than "
                  "the default, so a static tune keeps the default unless the model predicts 2% better "
                  "(there: in none of 12 cases)",
    doc="Mamba-2 and Mamba-1 decode step: the state updated in place by one (or T) tokens, and the output",
))
