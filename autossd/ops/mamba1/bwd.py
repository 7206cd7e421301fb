"""The selective scan backward (`sscan_bwd`), declared once: its stage, knob space, templates,
plan, float64 reference, cost model, defaults and constraints; and `backward`, which allocates the
gradients and the per-program partials, launches the kernel and sums the partials in a fixed order
(bitwise reproducible: no atomics)."""
from __future__ import annotations

import torch

from ...core.cost import StageCost
from ...core.cost import cdiv as _cdiv
from ...problem import DTYPE_BYTES
from ...render import load
from ..registry import Op, Stage, register
from ..ssd.plan import Launch
from . import fwd as _fwd
from . import scan_knobs
from .problem import ScanProblem
from .scan_knobs import BWD_SPACE, WINDOW_BYTES, BwdConfig, FwdConfig, fit, n2, sub_blocks

STAGES = (Stage("bwd", "warps", "stages", "maxnreg"),)
SEQUENCES = {"assoc": ("bwd",), "serial": ("bwd",)}
GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def allocate(problem: ScanProblem, config: BwdConfig, t: dict, poison: bool = False) -> dict:
    """du, ddelta, dz (contiguous, in their inputs' dtypes) and the fp32 partials: dA (batch,
    dim, dstate); a time-varying dB, dC (batch, channel blocks, dstate, seqlen), a time-invariant
    one (batch, dim, dstate); dD, ddelta_bias (batch, dim). poison: NaN-filled."""
    u = t["u"]
    dev = u.device
    b, d, n, l = problem.batch, problem.dim, problem.dstate, problem.seqlen
    nblk = programs(problem, config)
    nseg = _fwd.segments(problem, config)[1]
    rows = b * nseg   # with seq_split, each segment's per-channel sums in rows of their own
    # window: the time-varying partials cover one window; the sums (b, ngroups, dstate, seqlen)
    # fp32, a window at a time; the gradient carried from window to window
    spw, nwin = windows(problem, config)
    pl = window_row(config, spw) if config.get("window", 0) else l

    def make(*s, dtype=torch.float32):
        return torch.full(s, float("nan"), dtype=dtype, device=dev) if poison else torch.empty(s, dtype=dtype,
                                                                                                device=dev)

    return dict(du=make(b, d, l, dtype=u.dtype), ddelta=make(b, d, l, dtype=t["delta"].dtype),
                dz=make(b, d, l, dtype=t["z"].dtype) if problem.has_z else None,
                pA=make(rows, d, n),
                pB=make(b, nblk, n, pl) if problem.B_var else make(rows, d, n),
                pC=make(b, nblk, n, pl) if problem.C_var else make(rows, d, n),
                pD=make(rows, d) if problem.has_D else None,
                pdb=make(rows, d) if problem.has_delta_bias else None,
                # the gradient each channel block carries between chunks (sub > 1: through memory)
                gc=make(b, d, n) if sub_blocks(config) > 1 else None,
                # seq_split: each segment's start gradient from zero, then the one entering it; and
                # its delta' sum (every segment but one; at least one row, so the kernel has a buffer)
                **({"we": make(b, max(1, nseg - 1), d, n), "sd": make(b, max(1, nseg - 1), d)}
                   if config.get("seq_split", 1) > 1 else {}),
                **({"wc": make(b, d, n),
                    "oB": make(b, problem.ngroups, n, l) if problem.B_var else None,
                    "oC": make(b, problem.ngroups, n, l) if problem.C_var else None}
                   if config.get("window", 0) else {}),
                # window = 2: a window's chunk states, recomputed before its launch
                **({"wck": make(b, spw, d, n, dtype=_fwd.CKPT_DTYPES[config.ckpt_dtype])}
                   if config.get("window", 0) == 2 else {}))


def windows(problem: ScanProblem, config: BwdConfig) -> tuple[int, int]:
    """(chunks per window, windows) of a config with window = 1: as many chunks as keep each
    time-varying partial within WINDOW_BYTES, at least one; with seq_split, as many whole
    segments, at least one; (all chunks, 1) otherwise."""
    nchunks = _cdiv(problem.seqlen, config.chunk)
    if not config.get("window", 0):
        return nchunks, 1
    if config.get("seq_split", 1) > 1:
        spc, nseg = _fwd.segments(problem, config)
        k = max(1, min(nseg, WINDOW_BYTES // _partial_bytes(problem, config, spc * config.chunk)))
        return k * spc, _cdiv(nseg, k)
    spw = max(1, min(nchunks, WINDOW_BYTES // _partial_bytes(problem, config, config.chunk)))
    return spw, _cdiv(nchunks, spw)


def ckpt_every(problem: ScanProblem, config: BwdConfig) -> int:
    """Chunks between the training forward's checkpoints for this backward config: a window's
    (window = 2, which recomputes the rest), else 1."""
    config = bounded(problem, config)
    return windows(problem, config)[0] if config.get("window", 0) == 2 else 1


def ckpt_shape(problem: ScanProblem, config: BwdConfig) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and type of the checkpoints this backward config reads from the training forward:
    (batch, chunks, dim, dstate) in ckpt_dtype, or with window = 2 (batch, windows, dim, dstate)
    fp32."""
    every = ckpt_every(problem, config)
    rows = _cdiv(_cdiv(problem.seqlen, config.chunk), every)
    dtype = torch.float32 if config.get("window", 0) == 2 else _fwd.CKPT_DTYPES[config.ckpt_dtype]
    return (problem.batch, rows, problem.dim, problem.dstate), dtype


def window_row(config: BwdConfig, spw: int) -> int:
    """A windowed partial's row length: the window's steps rounded up to 16. Triton marks an int
    argument divisible by 16 or not at all, and an unmarked row length makes every partial store a
    scalar one: at 409 chunks of 8 (the 256 MiB bound at Mamba-1 2.8b 1x65536) the 21 windows' launches
    took 42.2 ms of GPU time where one launch over the whole sequence took 23.2 (H200)."""
    return _cdiv(spw * config.chunk, 16) * 16


def bounded(problem: ScanProblem, config: BwdConfig) -> BwdConfig:
    """`config` with window = 1 where its time-varying partials over the whole sequence would pass
    WINDOW_BYTES (serial layout, no seq_split): a bound on the backward's memory whatever a record
    holds. A split config is left as it is (in windows its launches have fewer programs each:
    its record says whether it takes them)."""
    if config.get("window", 0) or config.scan != "serial" or config.get("seq_split", 1) > 1 \
            or not (problem.B_var or problem.C_var):
        return config
    full = _partial_bytes(problem, config, problem.seqlen)
    return config.replace(window=1) if full > WINDOW_BYTES else config


def _partial_bytes(problem: ScanProblem, config: BwdConfig, steps: int) -> int:
    """Bytes of one time-varying dB or dC partial (fp32, one row per channel block) over `steps`."""
    return problem.batch * programs(problem, config) * problem.dstate * steps * 4


def programs(problem: ScanProblem, config: BwdConfig) -> int:
    """Programs along the channels: each runs sub blocks of block_d channels."""
    return _cdiv(problem.dim, config.block_d * sub_blocks(config))


def plan(problem: ScanProblem, config: BwdConfig, t: dict, buffers: dict, backend: str = "cuda") -> list:
    """The one launch: t holds the inputs by name and dout, dlast (or None), ckpt (the forward's
    checkpoints at this config's chunk); buffers from `allocate`."""
    ptrs, sizes, constexprs = _fwd.common_args(problem, config, t)
    du = buffers["du"]
    args = ptrs | dict(dout_ptr=t["dout"], dlast_ptr=t.get("dlast"), ck_ptr=t["ckpt"],
                       du_ptr=du, ddl_ptr=buffers["ddelta"], dz_ptr=buffers.get("dz"),
                       pA_ptr=buffers["pA"], pB_ptr=buffers["pB"], pC_ptr=buffers["pC"], pD_ptr=buffers.get("pD"),
                       pdb_ptr=buffers.get("pdb"), gc_ptr=buffers.get("gc")) | sizes
    args.update(zip(("s_g_b", "s_g_d", "s_g_t"), du.stride()))
    constexprs["HAS_DLAST"] = t.get("dlast") is not None
    opts = OP.launch_options(config, backend)["bwd"]
    kernel = "sscan_bwd_gl" if _fwd.gluon_runs(config, du, backend) else "sscan_bwd"
    g = (programs(problem, config), problem.batch)
    if config.get("window", 0) == 2:
        args |= dict(ck_ptr=buffers["wck"], SPW=windows(problem, config)[0])
    split = config.get("seq_split", 1) > 1
    if config.get("window", 0) and not split:
        return _windowed(problem, config, kernel, args, constexprs, opts, buffers, g)
    if not split:
        return [Launch("bwd", kernel, g, args, constexprs, opts)]
    # seq_split: each segment's start gradient (PHASE 1), their chain from the sequence's end
    # (PHASE 2), then the walk of every segment (PHASE 0; with windows, a launch per window of
    # segments from the last); see the kernel
    spc, nseg = _fwd.segments(problem, config)
    args = {**args, "we_ptr": buffers["we"], "sd_ptr": buffers["sd"], "SPC": spc, "NSEG": nseg}
    if config.get("window", 0):
        spw, nwin = windows(problem, config)
        k, nchunks = spw // spc, _cdiv(problem.seqlen, config.chunk)
        args |= dict(wc_ptr=buffers["wc"], C0=0, NCW=0, WL=window_row(config, spw), ACC_IN=0)
        mains = [Launch("bwd", kernel, g + (min(k, nseg - win * k),),
                        args | dict(C0=win * spw, NCW=min(spw, nchunks - win * spw)), constexprs | dict(PHASE=0), opts)
                 for win in reversed(range(nwin))]
    else:
        mains = [Launch("bwd", kernel, g + (nseg,), args, constexprs | dict(PHASE=0), opts)]
    if nseg == 1:
        return mains
    return [Launch("bwd", kernel, g + (nseg - 1,), args, constexprs | dict(PHASE=1), opts),
            Launch("bwd", kernel, g + (1,), args, constexprs | dict(PHASE=2), opts)] + mains


def _windowed(problem: ScanProblem, config: BwdConfig, kernel: str, args: dict, constexprs: dict, opts: dict,
              buffers: dict, g: tuple) -> list:
    """window = 1: a launch per window, from the sequence's last (`backward` sums each one's
    time-varying dB / dC partials before the next overwrites them)."""
    spw, nwin = windows(problem, config)
    nchunks = _cdiv(problem.seqlen, config.chunk)
    return [Launch("bwd", kernel, g, args | dict(wc_ptr=buffers["wc"], C0=win * spw, NCW=min(spw, nchunks - win * spw),
                                                      WL=window_row(config, spw), ACC_IN=int(k > 0)), constexprs, opts)
            for k, win in enumerate(reversed(range(nwin)))]


# what the backward's launches read (the forward's inputs, dout, dlast, the checkpoints) and write
INPUTS = _fwd.INPUTS + ("dout", "dlast", "ckpt")
BUFFERS = ("du", "ddelta", "dz", "pA", "pB", "pC", "pD", "pdb", "gc", "we", "sd")


def _run_windows(problem: ScanProblem, config: BwdConfig, launches: list, module, buf: dict, device,
                 before=None) -> None:
    """A windowed backward's launches (window = 1 or 2), one a window (a split sequence's two
    start-gradient launches first, which write no partials); after each window's, its
    time-varying partials summed over each group's channel blocks (torch's fixed order, as
    without windows) into that window's steps of oB / oC. before(launch): run first for each
    window's launch (window = 2: that window's chunk states recomputed)."""
    b, n, l, ng = problem.batch, problem.dstate, problem.seqlen, problem.ngroups
    nbg = programs(problem, config) // ng   # a group's channel blocks: contiguous, they divide its channels
    for ln in launches:
        if before is not None:
            before(ln)
        _fwd.launch([ln], module, device)
        if ln.constexprs.get("PHASE", 0):   # a split sequence's start gradients: no partials
            continue
        t0, wl = ln.args["C0"] * config.chunk, ln.args["WL"]
        steps = min(ln.args["NCW"] * config.chunk, l - t0)   # a row holds the window's steps, then padding
        for name, var in (("B", problem.B_var), ("C", problem.C_var)):
            if var:
                part = buf[f"p{name}"].view(b, ng, nbg, n, wl)[..., :steps]
                buf[f"o{name}"][..., t0:t0 + steps] = part.sum(2)


def forward_config(problem: ScanProblem, config: BwdConfig, fwd_config: FwdConfig | None, arch: str) -> FwdConfig:
    """The forward config a training forward (or the backward's own recompute) runs: the given
    one (default: the arch's) with the backward's chunk, its channel block fitted to that; for
    window = 2 in the serial layout, unsplit, with one checkpoint a window (ckpt_stride)."""
    fcfg = fwd_config if fwd_config is not None else scan_knobs.fwd_default_config(arch, problem)
    if config.get("window", 0) == 2:
        if fcfg.scan != "serial":
            fcfg = scan_knobs.fwd_default_config(arch, problem, scan="serial")
        # unsplit: state_in (a split segment's entering state) goes with seq_split
        return fit(fcfg.replace(chunk=config.chunk, seq_split=1, state_in=0, gluon=0), arch,
                   problem).replace(ckpt_stride=1)
    return fit(fcfg.replace(chunk=config.chunk), arch, problem)


def _recompute_windows(problem: ScanProblem, config: BwdConfig, fcfg: FwdConfig, t: dict, coarse, buf: dict,
                       backend: str):
    """window = 2: what runs before each window's launch, the forward's kernel walking that window
    again from its checkpoint in `coarse`, each chunk's entering state into buf["wck"]."""
    every, nchunks = ckpt_every(problem, config), _cdiv(problem.seqlen, config.chunk)
    ft, module, device = _fwd.staged(problem, fcfg, t), load(fcfg, backend), t["u"].device

    def before(ln):
        c0 = ln.args["C0"]
        _fwd.launch([_fwd.recompute(problem, fcfg, ft, coarse, every, buf["wck"], c0, min(every, nchunks - c0),
                                    backend)], module, device)
    return before


def _sum_partials(problem: ScanProblem, config: BwdConfig, buf: dict, t: dict, need) -> dict:
    """The gradients summed from the partials over channel blocks and batch rows, in torch's fixed
    order, each in its input's dtype."""
    b, n, l, ng = problem.batch, problem.dstate, problem.seqlen, problem.ngroups
    nblk = programs(problem, config)
    out = {}

    def bc(name, part, var):
        M = t[name]
        if var:   # programs of a group: contiguous along the program axis (their channels divide a group's)
            # (window = 1: summed a window at a time into o{name} by _run)
            s = buf[f"o{name}"] if config.get("window", 0) else part.view(b, ng, nblk // ng, n, l).sum(2)
            return (s if M.dim() == 4 else s.view(b, n, l)).to(M.dtype)
        return part.sum(0).to(M.dtype)

    if "u" in need:
        out["u"] = buf["du"]
    if "delta" in need:
        out["delta"] = buf["ddelta"]
    if "z" in need and problem.has_z:
        out["z"] = buf["dz"]
    if "A" in need:
        out["A"] = buf["pA"].sum(0).to(t["A"].dtype)
    if "B" in need:
        out["B"] = bc("B", buf["pB"], problem.B_var)
    if "C" in need:
        out["C"] = bc("C", buf["pC"], problem.C_var)
    if "D" in need and problem.has_D:
        out["D"] = buf["pD"].sum(0).to(t["D"].dtype)
    if "delta_bias" in need and problem.has_delta_bias:
        out["delta_bias"] = buf["pdb"].sum(0).to(t["delta_bias"].dtype)
    return out


def backward(problem: ScanProblem, config: BwdConfig, t: dict, dout, dlast=None, ckpt=None, need=GRAD_NAMES,
             backend: str = "cuda", arch: str = "sm90", fwd_config: FwdConfig | None = None,
             poison: bool = False) -> dict:
    """Gradients (name -> tensor) of the inputs named in `need`, from dout (like out) and dlast
    (the last state's gradient, or None). ckpt: the forward's checkpoints at `config`'s chunk and
    checkpoint type; None (or another spacing or type) runs the forward again to store them."""
    config = bounded(problem, config)
    want, want_type = ckpt_shape(problem, config)
    every = ckpt_every(problem, config)
    fresh = ckpt is None or tuple(ckpt.shape) != want or ckpt.dtype != want_type
    fcfg = forward_config(problem, config, fwd_config, arch) if fresh or config.get("window", 0) == 2 else None
    if fresh:
        ckpt = _fwd.forward(problem, fcfg, t, backend, ckpt_dtype=config.ckpt_dtype, ckpt_every=every)["ckpt"]
    tt = dict(_fwd.staged(problem, config, t), dout=dout.contiguous(),
              dlast=dlast.float().contiguous() if dlast is not None else None, ckpt=ckpt)
    buf = allocate(problem, config, t, poison)
    if not config.get("window", 0):   # one set of launches: recorded once, replayed (fwd.run_recorded)
        key = None if poison else ("bwd", problem, config, backend)
        _fwd.run_recorded(key, lambda: plan(problem, config, tt, buf, backend), config, backend, tt, buf,
                          INPUTS, BUFFERS)
    else:   # launches interleaved with torch's sums of each window's partials: not recorded
        before = _recompute_windows(problem, config, fcfg, t, ckpt, buf, backend) if config.window == 2 else None
        _run_windows(problem, config, plan(problem, config, tt, buf, backend), load(config, backend), buf,
                     t["u"].device, before)
    return _sum_partials(problem, config, buf, t, set(need))


# --- the tuner's and the compile report's hooks -------------------------------------------------
def tune_inputs(problem: ScanProblem, device="cpu", seed: int = 0) -> dict:
    """The forward's inputs, dout (like u) and, where the last state is returned, dlast (fp32)."""
    t = _fwd.tune_inputs(problem, device, seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 7919)
    t["dout"] = torch.randn(t["u"].shape, generator=g).to(t["u"].dtype).to(device)
    t["dlast"] = (torch.randn(problem.batch, problem.dim, problem.dstate, generator=g).to(device)
                  if problem.return_last_state else None)
    return t


def reference(t: dict, delta_softplus: bool, dout, dlast=None) -> dict:
    """float64 gradients of every tensor input of t, through autograd of the float64 recurrence."""
    from .naive import selective_scan_ref
    x = {k: t[k].detach().double().requires_grad_() for k in GRAD_NAMES if t.get(k) is not None}
    out, last = selective_scan_ref(x["u"], x["delta"], x["A"], x["B"], x["C"], x.get("D"), x.get("z"),
                                   x.get("delta_bias"), delta_softplus, True)
    loss = (out * dout.double()).sum()
    if dlast is not None:
        loss = loss + (last * dlast.double()).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    return dict(zip(x, grads))


def tune_reference(problem: ScanProblem, t: dict) -> dict:
    """The float64 reference's gradients, by name, of every input the call has."""
    return reference(t, problem.delta_softplus, t["dout"], t.get("dlast"))


def tune_run(problem: ScanProblem, config: BwdConfig, t: dict, backend: str = "cuda", poison: bool = False) -> dict:
    """A training step's scan: the forward storing its checkpoints (the arch default's forward at
    this config's chunk and checkpoint type), then the backward of `config`: every gradient, by
    name. poison: the backward's outputs and partials start NaN-filled."""
    inputs = {k: t.get(k) for k in GRAD_NAMES}
    arch = "sm90" if backend == "cuda" else "gfx942"
    fcfg = forward_config(problem, bounded(problem, config), None, arch)
    ckpt = _fwd.forward(problem, fcfg, inputs, backend, ckpt_dtype=config.ckpt_dtype, poison=poison,
                        ckpt_every=ckpt_every(problem, config))["ckpt"]
    return backward(problem, config, inputs, t["dout"], t.get("dlast"), ckpt,
                    {k for k in GRAD_NAMES if t.get(k) is not None}, backend, arch, fcfg, poison=poison)


def meta_launches(problem: ScanProblem, config: BwdConfig, backend: str) -> list:
    t = _fwd.meta_inputs(problem)
    t["dout"] = torch.empty_like(t["u"])
    t["dlast"] = (torch.empty(problem.batch, problem.dim, problem.dstate, device="meta")
                  if problem.return_last_state else None)
    t["ckpt"] = torch.empty(problem.batch, _cdiv(problem.seqlen, config.chunk), problem.dim, problem.dstate,
                            dtype=_fwd.CKPT_DTYPES[config.ckpt_dtype], device="meta")
    return plan(problem, config, _fwd.staged(problem, config, t), allocate(problem, config, t), backend)


def stage_costs(problem: ScanProblem, config: BwdConfig) -> list:
    """The main launch: u, delta (twice: one step ahead, from the cache), z, dout read, du, ddelta,
    dz written, the checkpoints read, the dB / dC partials written; about three times the
    forward's FLOPs (the states again, the reversed scan, the gradients' products)."""
    e = DTYPE_BYTES[problem.dtype]
    b, d, n, l = problem.batch, problem.dim, problem.dstate, problem.seqlen
    nblk = programs(problem, config)
    act = b * d * l * e * (7 if problem.has_z else 5)
    ck = b * _cdiv(l, config.chunk) * d * n * (4 if config.ckpt_dtype == "fp32" else 2)
    parts = sum(b * nblk * n * l * 4 for var in (problem.B_var, problem.C_var) if var)
    bc = sum(b * problem.ngroups * n * l * e for var in (problem.B_var, problem.C_var) if var)
    # seq_split: all but one segment's gradient walked once more (delta, dout, z and C read again,
    # about a third of the arithmetic)
    spc, nseg = _fwd.segments(problem, config)
    again = (nseg - 1) / nseg
    act += again * b * d * l * e * (3 if problem.has_z else 2)
    return [StageCost("bwd", nblk * b * nseg, float(act + ck + parts + bc),
                      float(bc * max(0, nblk // problem.ngroups - 1)), (3.0 + again) * problem.flops(),
                      (config.block_d, n2(problem), config.chunk), config.stages, chain=spc)]


def excluded(problem: ScanProblem, static: bool = False) -> dict:
    """A static tune (no gate) never offers bf16 checkpoints: their rounding is shown only by the
    gate's gradients check."""
    return {"ckpt_dtype": ("bf16",)} if static else {}


OP = register(Op(
    name="sscan_bwd",
    space=BWD_SPACE,
    config_type=BwdConfig,
    stages=STAGES,
    sequences=SEQUENCES,
    template_dir="mamba1_sscan_bwd",
    problem_type=ScanProblem,
    includes=_fwd.includes,
    render_context=_fwd.render_context,
    plan=plan,
    meta_launches=meta_launches,
    tune_inputs=tune_inputs,
    tune_reference=tune_reference,
    tune_run=tune_run,
    reference=reference,
    cost_model=stage_costs,
    default_config=scan_knobs.bwd_default_config,
    seeds=scan_knobs.seed_configs,
    violations=scan_knobs.violations,
    caps=scan_knobs.caps,
    excluded=excluded,
    doc="Mamba-1 selective scan backward: gradients of u, delta, A, B, C, D, z, delta_bias",
))
