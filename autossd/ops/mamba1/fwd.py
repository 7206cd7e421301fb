"""The selective scan forward (`sscan_fwd`), declared once: its stage, knob space, templates, plan,
float64 reference, cost model, defaults and constraints; and `forward`, which allocates the
outputs and launches the kernel (the drop-in `selective_scan_fn` is in scan.py)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ...core import select as _select
from ...core.cost import StageCost
from ...core.cost import cdiv as _cdiv
from ...problem import DTYPE_BYTES, TORCH_DTYPES
from ...render import interpreting, load
from ..common import launch_cache as _lc
from ..registry import Op, Stage, register
from ..ssd.chunk import run as launch_all   # through triton's JIT: the compiled kernels
from ..ssd.plan import Launch
from . import scan_knobs
from .naive import selective_scan_ref
from .problem import ScanProblem
from .scan_knobs import FWD_SPACE, FwdConfig, n2

STAGES = (Stage("fwd", "warps", "stages", "maxnreg"),)
SEQUENCES = {"assoc": ("fwd",), "serial": ("fwd",)}
CKPT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def includes(cfg, backend: str) -> list[str]:
    """The family's helpers (templates/mamba1/scan_lib.jinja, and serial_lib.jinja for the serial
    layout), then the op's kernel of that layout."""
    if cfg.scan == "serial":
        # gluon = 1: the Gluon kernel beside the tl one of the same config, which runs where
        # Gluon cannot (gluon_runs); the forward's and the backward's share gluon_lib.jinja
        gluon = ["gluon_lib.jinja", "gluon.jinja"] if cfg.get("gluon", 0) else []
        return ["scan_lib.jinja", "serial_lib.jinja", "serial.jinja"] + gluon
    return ["scan_lib.jinja", "kernel.jinja"]


def render_context(cfg, backend: str) -> dict:
    ckpt = cfg.get("ckpt_dtype")   # the backward's: the checkpoints' type it reads
    return {"template_dir": get_template_dir(cfg),
            "ckpt_tl_dtype": {"fp32": "tl.float32", "bf16": "tl.bfloat16"}[ckpt] if ckpt else None}


def get_template_dir(cfg) -> str:
    return f"mamba1_{cfg.op}"


def bc_strides(M) -> tuple[int, int, int, int]:
    """B or C's (batch, group, state, time) strides: (batch, dstate, seqlen) is one group;
    (batch, ngroups, dstate, seqlen) as it is; the time-invariant (dim, dstate) passes its dim
    stride as the group's (the kernel reads it per channel)."""
    s = M.stride()
    if M.dim() == 2:
        return (0, s[0], s[1], 0)
    if M.dim() == 3:
        return (s[0], 0, s[1], s[2])
    return tuple(s)


def common_args(problem: ScanProblem, config, t: dict) -> tuple[dict, dict, dict]:
    """What the forward and the backward kernels share, in their order: the inputs' pointers;
    sizes and strides; constexprs (flags)."""
    u, dl, A, B, C = t["u"], t["delta"], t["A"], t["B"], t["C"]
    z = t.get("z")
    ptrs = dict(u_ptr=u, dl_ptr=dl, A_ptr=A, B_ptr=B, C_ptr=C, D_ptr=t.get("D"), z_ptr=z,
                db_ptr=t.get("delta_bias"))
    args = dict(DIM=problem.dim, N=problem.dstate, L=problem.seqlen, DPG=problem.channels_per_group,
                NCHUNKS=_cdiv(problem.seqlen, config.chunk))
    args.update(zip(("s_u_b", "s_u_d", "s_u_t"), u.stride()))
    args.update(zip(("s_dl_b", "s_dl_d", "s_dl_t"), dl.stride()))
    args.update(zip(("s_A_d", "s_A_n"), A.stride()))
    args.update(zip(("s_B_b", "s_B_g", "s_B_n", "s_B_t"), bc_strides(B)))
    args.update(zip(("s_C_b", "s_C_g", "s_C_n", "s_C_t"), bc_strides(C)))
    args.update(zip(("s_z_b", "s_z_d", "s_z_t"), z.stride() if z is not None else (0, 0, 0)))
    constexprs = dict(HAS_D=problem.has_D, HAS_Z=problem.has_z, HAS_BIAS=problem.has_delta_bias,
                      SOFTPLUS=problem.delta_softplus, B_VAR=problem.B_var, C_VAR=problem.C_var, N2=n2(problem))
    return ptrs, args, constexprs


def grid(problem: ScanProblem, config) -> tuple[int, ...]:
    if config.get("seq_split", 1) > 1:
        return (_cdiv(problem.dim, config.block_d), problem.batch, segments(problem, config)[1])
    return (_cdiv(problem.dim, config.block_d), problem.batch)


def segments(problem: ScanProblem, config) -> tuple[int, int]:
    """(chunks per segment, segments) of a config's seq_split: whole chunks, none empty (1, 1
    without a split)."""
    nchunks = _cdiv(problem.seqlen, config.chunk)
    spc = _cdiv(nchunks, config.get("seq_split", 1))
    return spc, _cdiv(nchunks, spc)


def gluon_runs(config, x: torch.Tensor, backend: str) -> bool:
    """Whether `config`'s Gluon kernel runs a call on x's device: gluon = 1 on an NVIDIA GPU, or
    meta tensors (the cross-compile, whose arch compile_config has checked); the interpreter and
    ROCm run the serial tl kernel of the same config."""
    if not config.get("gluon", 0) or backend != "cuda" or torch.version.hip:
        return False
    return x.device.type == "meta" or (x.device.type == "cuda" and not interpreting())


def plan(problem: ScanProblem, config: FwdConfig, t: dict, buffers: dict, backend: str = "cuda") -> list:
    """The launch: t holds the inputs by name, buffers out, last (or None) and ckpt (or None), and
    with seq_split the segments' summaries (he, sd): two launches of the same kernel before the
    main one write each segment's summary but the last's (PHASE 1), then chain them into the
    states entering the segments (PHASE 2, in place)."""
    ptrs, sizes, constexprs = common_args(problem, config, t)
    out = buffers["out"]
    args = ptrs | dict(out_ptr=out, last_ptr=buffers.get("last"), ck_ptr=buffers.get("ckpt"))
    split = config.get("seq_split", 1) > 1
    if split:
        spc, nseg = segments(problem, config)
        args |= dict(he_ptr=buffers["he"], sd_ptr=buffers["sd"], SPC=spc, NSEG=nseg)
    args |= sizes
    args.update(zip(("s_o_b", "s_o_d", "s_o_t"), out.stride()))
    constexprs.update(LAST=buffers.get("last") is not None, SAVE=buffers.get("ckpt") is not None)
    if config.get("ckpt_stride", 0):   # one checkpoint each `ckpt_every` chunks (a window's first)
        every = buffers.get("ckpt_every", 1)
        rows = buffers["ckpt"].shape[1] if buffers.get("ckpt") is not None else 0
        args |= dict(cw_ptr=None, NCK=rows, NWIN=rows, EVERY=every, C0=0, NCW=sizes["NCHUNKS"])
        constexprs["RECOMP"] = False
    opts = OP.launch_options(config, backend)["fwd"]
    g = grid(problem, config)
    kernel = "sscan_fwd_gl" if gluon_runs(config, t["u"], backend) else "sscan_fwd"
    if not split:
        return [Launch("fwd", kernel, g, args, constexprs, opts)]
    main = Launch("fwd", kernel, g, args, constexprs | dict(PHASE=0), opts)
    if nseg == 1:
        return [main]
    # the summaries and their chain write neither the output nor the checkpoints
    quiet = constexprs | dict(LAST=False, SAVE=False)
    return [Launch("fwd", kernel, g[:2] + (nseg - 1,), args, quiet | dict(PHASE=1), opts),
            Launch("fwd", kernel, g[:2] + (1,), args, quiet | dict(PHASE=2), opts),
            main]


def allocate(problem: ScanProblem, config, t: dict, last: bool, ckpt_dtype: str | None, poison: bool = False,
             ckpt_every: int = 1) -> dict:
    """The forward's outputs: out like u (contiguous), the last state (batch, dim, dstate) fp32
    where asked, the checkpoints (batch, chunks, dim, dstate) where ckpt_dtype is given; with
    ckpt_every > 1 (config ckpt_stride = 1) one every that many chunks, (batch, windows, dim,
    dstate) in fp32. poison: NaN-filled (the gate's run: an element never written fails it)."""
    u = t["u"]
    make = (lambda *s, dtype: torch.full(s, float("nan"), dtype=dtype, device=u.device)) if poison else \
        (lambda *s, dtype: torch.empty(s, dtype=dtype, device=u.device))
    b, d, n, l = problem.batch, problem.dim, problem.dstate, problem.seqlen
    nck, ck_type = _cdiv(_cdiv(l, config.chunk), ckpt_every), CKPT_DTYPES[ckpt_dtype] if ckpt_dtype else None
    if ckpt_every > 1 and not config.get("ckpt_stride", 0):
        raise ValueError(f"ckpt_every={ckpt_every} needs a forward config with ckpt_stride=1")
    if config.get("ckpt_stride", 0):
        ck_type = torch.float32   # few, and the windows' recompute starts from them unrounded
    buf = dict(out=make(b, d, l, dtype=u.dtype),
               last=make(b, d, n, dtype=torch.float32) if last else None,
               ckpt=make(b, nck, d, n, dtype=ck_type) if ckpt_dtype else None, ckpt_every=ckpt_every)
    if config.get("seq_split", 1) > 1:   # each segment's end state and delta' sum, but the last's
        k = max(1, segments(problem, config)[1] - 1)
        buf.update(he=make(b, k, d, n, dtype=torch.float32), sd=make(b, k, d, dtype=torch.float32))
    return buf


def recompute(problem: ScanProblem, config: FwdConfig, t: dict, coarse, every: int, window, c0: int,
              ncw: int, backend: str = "cuda") -> Launch:
    """The launch that walks chunks c0 .. c0 + ncw - 1 (a window of `every`, c0 a multiple of it)
    again from the window's checkpoint in `coarse` (a ckpt_every forward's), storing each chunk's
    entering state into `window` (batch, every, dim, dstate), in its type; no output."""
    ptrs, sizes, constexprs = common_args(problem, config, t)
    u = t["u"]
    args = ptrs | dict(out_ptr=u, last_ptr=None, ck_ptr=window, cw_ptr=coarse, NCK=window.shape[1],
                       NWIN=coarse.shape[1], EVERY=every, C0=c0, NCW=ncw) | sizes
    args.update(zip(("s_o_b", "s_o_d", "s_o_t"), u.stride()))   # (out is not written)
    return Launch("fwd", "sscan_fwd", grid(problem, config), args,
                  constexprs | dict(LAST=False, SAVE=True, RECOMP=True), OP.launch_options(config, backend)["fwd"])


def launch(launches: list, module, device) -> None:
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        with torch.cuda.device(device):
            launch_all(launches, module)
    else:
        launch_all(launches, module)


# The launch cache: a call's launches are recorded the first time a key is seen and replayed on
# later calls' tensors, skipping the plan and triton's per-launch binding (about as much host time
# as the kernels take at batch 1 and 2048 tokens). The key holds everything a launch depends on:
# problem, config, what the caller asked for, and the tensors' dtypes, shapes, strides, alignment
# and aliasing (`launch_cache.input_sig`).
_launch_cache: dict = {}
LAUNCH_CACHE_MAX = 1024
INPUTS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
BUFFERS = ("out", "last", "ckpt", "he", "sd")


@_select.on_clear
def clear_launch_cache() -> None:
    _launch_cache.clear()


def run_recorded(key, plan_of, config, backend: str, t: dict, buf: dict, inputs: tuple, buffers: tuple) -> None:
    """Launch what `plan_of()` plans for these tensors (t's `inputs`, buf's `buffers`), or replay
    the record kept under `key` (None: neither kept nor looked up, e.g. a poisoned gate run).
    Records are made and replayed on the current device only."""
    dev = t["u"].device
    stream = None
    if key is not None and dev.index in (None, torch.cuda.current_device() if dev.type == "cuda" else None):
        stream = _lc.replay_stream(dev)
    if stream is not None:
        key = (key, _lc.input_sig(t, inputs))
        rec = _launch_cache.get(key)
        if rec is not None:
            _lc.replay(rec, t, SimpleNamespace(**{k: buf.get(k) for k in buffers}), stream)
            return
    module = load(config, backend)
    launches = plan_of()
    if stream is None:
        launch(launches, module, dev)
        return
    compiled = launch_all(launches, module)
    if all(c is not None for c in compiled):
        ns = SimpleNamespace(**{k: buf.get(k) for k in buffers})
        _lc.remember(_launch_cache, key, _lc.record(launches, compiled, t, ns, module, inputs, buffers),
                     LAUNCH_CACHE_MAX)


def forward(problem: ScanProblem, config: FwdConfig, t: dict, backend: str = "cuda", last: bool = False,
            ckpt_dtype: str | None = None, poison: bool = False, ckpt_every: int = 1) -> dict:
    """Run the forward of `config` on validated inputs: {"out", "last", "ckpt"} (None where not
    asked); ckpt_every > 1: one checkpoint every that many chunks (ckpt_stride = 1)."""
    buf = allocate(problem, config, t, last, ckpt_dtype, poison, ckpt_every)
    tt = staged(problem, config, t)
    key = None if poison else ("fwd", problem, config, backend, last, ckpt_dtype, ckpt_every)
    run_recorded(key, lambda: plan(problem, config, tt, buf, backend), config, backend, tt, buf, INPUTS, BUFFERS)
    return buf


def staged(problem: ScanProblem, config, t: dict) -> dict:
    """The inputs as `config`'s kernel reads them: with bc_f32 = 1, a time-varying B and C in fp32
    (converted once here, where the kernel would convert each value at each thread's read)."""
    if not config.get("bc_f32", 0):
        return t
    return dict(t, **{k: t[k].float() for k, var in (("B", problem.B_var), ("C", problem.C_var)) if var})


# --- the tuner's and the compile report's hooks -------------------------------------------------
def tune_inputs(problem: ScanProblem, device="cpu", seed: int = 0) -> dict:
    """Fresh random inputs in the forms Mamba-1 passes them: u, delta, z in u's dtype, A negative
    fp32 (dim, dstate), B and C in u's dtype (time-invariant ones fp32), D and delta_bias fp32;
    delta before softplus about softplus^-1 of 0.0015..0.08 (Mamba-1's dt range), else
    0.001..0.1 itself."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, d, n, l, ng = problem.batch, problem.dim, problem.dstate, problem.seqlen, problem.ngroups
    e = TORCH_DTYPES[problem.dtype]

    def rnd(*shape, dtype=e, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    def bc():
        if not problem.B_var:
            return rnd(d, n, dtype=torch.float32)
        return rnd(b, ng, n, l) if ng > 1 else rnd(b, n, l)

    if problem.delta_softplus:
        delta = torch.rand(b, d, l, generator=g) * 4 - 6.5
    else:
        delta = torch.rand(b, d, l, generator=g) * 0.1 + 0.001
    t = dict(u=rnd(b, d, l), delta=delta.to(e).to(device),
             A=(-torch.rand(d, n, generator=g) * 4 - 0.5).to(device), B=bc(), C=None,
             D=rnd(d, dtype=torch.float32) if problem.has_D else None,
             z=rnd(b, d, l) if problem.has_z else None,
             delta_bias=None)
    if problem.has_delta_bias:   # without softplus a positive one: delta' must stay positive (a decay)
        t["delta_bias"] = ((torch.randn(d, generator=g) * 0.5) if problem.delta_softplus
                           else torch.rand(d, generator=g) * 0.05).to(device)
    t["C"] = (rnd(d, n, dtype=torch.float32) if not problem.C_var else rnd(b, ng, n, l) if ng > 1 else rnd(b, n, l))
    return t


def reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    return selective_scan_ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state)


def tune_reference(problem: ScanProblem, t: dict):
    """float64 (out, last state or None)."""
    with torch.no_grad():
        r = selective_scan_ref(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                               problem.delta_softplus, True)
    return r[0], (r[1] if problem.return_last_state else None)


def tune_run(problem: ScanProblem, config: FwdConfig, t: dict, backend: str = "cuda", poison: bool = False):
    """The generated forward of `config`: (out, last state or None); poison: into NaN-filled buffers."""
    buf = forward(problem, config, t, backend, last=problem.return_last_state, poison=poison)
    return (buf["out"], buf["last"]) if problem.return_last_state else buf["out"]


def meta_inputs(problem: ScanProblem) -> dict:
    """Meta tensors of a call's inputs (the cross-compile report)."""
    b, d, n, l, ng = problem.batch, problem.dim, problem.dstate, problem.seqlen, problem.ngroups
    e = TORCH_DTYPES[problem.dtype]

    def m(*shape, dtype=e):
        return torch.empty(*shape, dtype=dtype, device="meta")

    def bc(var):
        return m(b, ng, n, l) if var and ng > 1 else m(b, n, l) if var else m(d, n, dtype=torch.float32)

    return dict(u=m(b, d, l), delta=m(b, d, l), A=m(d, n, dtype=torch.float32), B=bc(problem.B_var),
                C=bc(problem.C_var), D=m(d, dtype=torch.float32) if problem.has_D else None,
                z=m(b, d, l) if problem.has_z else None,
                delta_bias=m(d, dtype=torch.float32) if problem.has_delta_bias else None)


def meta_launches(problem: ScanProblem, config: FwdConfig, backend: str) -> list:
    t = meta_inputs(problem)
    return plan(problem, config, staged(problem, config, t), allocate(problem, config, t, problem.return_last_state,
                                                                      None), backend)


def stage_costs(problem: ScanProblem, config: FwdConfig) -> list:
    """The one launch: every operand once (ScanProblem.min_bytes); B and C tiles are read by
    each channel block of a group again, from the cache (reread); its tile is (BLOCK_D, N2, CHUNK)."""
    e = DTYPE_BYTES[problem.dtype]
    blocks = _cdiv(problem.dim, config.block_d)
    bc = 2 * problem.batch * problem.ngroups * problem.dstate * problem.seqlen * e
    spc, nseg = segments(problem, config)
    # seq_split: all but the last segment walked twice (u, delta and B read again)
    again = (nseg - 1) / nseg
    bytes_again = again * (2 * problem.batch * problem.dim * problem.seqlen * e + bc / 2)
    return [StageCost("fwd", blocks * problem.batch * nseg, float(problem.min_bytes() + bytes_again),
                      float(bc * max(0, blocks // problem.ngroups - 1)),
                      float(problem.flops() * (1 + again)), (config.block_d, n2(problem), config.chunk), config.stages,
                      chain=spc)]


def excluded(problem: ScanProblem, static: bool = False) -> dict:
    """The forward's tune times inference, which stores no checkpoints: ckpt_stride (the training
    forward's, set by the backward's window = 2) is never offered."""
    return {"ckpt_stride": (1,)}


OP = register(Op(
    name="sscan_fwd",
    space=FWD_SPACE,
    config_type=FwdConfig,
    stages=STAGES,
    sequences=SEQUENCES,
    template_dir="mamba1_sscan_fwd",
    problem_type=ScanProblem,
    includes=includes,
    render_context=render_context,
    plan=plan,
    meta_launches=meta_launches,
    tune_inputs=tune_inputs,
    tune_reference=tune_reference,
    tune_run=tune_run,
    reference=reference,
    cost_model=stage_costs,
    default_config=scan_knobs.fwd_default_config,
    seeds=scan_knobs.seed_configs,
    violations=scan_knobs.violations,
    caps=scan_knobs.caps,
    excluded=excluded,
    doc="Mamba-1 selective scan forward: out (and the last state) of selective_scan_fn",
))
