"""The SSD backward (`ssd_bwd`), declared once: its stages, knob space, templates, plan, float64
reference, cost model, defaults and constraints. The kernels are templates/ssd_bwd; the entry
(allocation, launches, the fixed-order sums of partials) is ops/ssd/backward.py."""
from __future__ import annotations

import torch

from ...compile import meta_inputs
from ...core.cost import StageCost
from ...core.cost import cdiv as _cdiv
from ...problem import DTYPE_BYTES, Problem
from ...testing import call_kwargs, make_inputs
from ..registry import Op, Stage, register
from . import backward, bwd_knobs
from .naive import ssd_chunked
from .bwd_knobs import SPACE, STATE_DTYPES, BwdConfig

# Every launch, in the order of a module's LAUNCH table. The gate runs only with z; cumsum,
# chunk_state and state_passing only where the states are recomputed (save_states = 0, or a
# call whose forward kept none); bmm only at cb = "stage".
STAGES = (
    Stage("gate"),
    Stage("cumsum"),
    Stage("chunk_state", "state_warps", "state_stages"),
    Stage("state_passing", "pass_warps"),
    Stage("bmm", "bmm_warps"),
    Stage("dstates", "state_warps", "state_stages"),
    # rev_walk_maxnreg caps the reverse Gluon walk, which runs in this stage's place (a config
    # with rev_walk = 0 and a cap is refused; a call the walk cannot take runs this tl stage under
    # the same cap); its row in the LAUNCH table names the cap, so that a capped config's module
    # differs from the uncapped one's, as dx_maxnreg's does
    Stage("state_passing_rev", "pass_warps", None, "rev_walk_maxnreg"),
    Stage("dx", "dx_warps", "dx_stages", "dx_maxnreg"),
    Stage("dcb", "dcb_warps", "dcb_stages", "dcb_maxnreg"),
    Stage("db", "dbc_warps", "dbc_stages", "db_maxnreg"),
    Stage("dc", "dbc_warps", "dbc_stages", "dc_maxnreg"),
    Stage("ddt"),
)
_ALL = tuple(s.name for s in STAGES)
SEQUENCES = {"stage": _ALL, "inline": tuple(s for s in _ALL if s != "bmm")}


def includes(cfg: BwdConfig, backend: str) -> list[str]:
    """The template files a config's module holds, in order (helpers before their callers)."""
    out = ["cumsum.jinja", "chunk_state.jinja", "state_passing.jinja"]
    if not cfg.save_states:
        out.append("recompute_states.jinja")
        if cfg.recompute_walk and backend == "cuda":   # PTX only (the knob needs tma and wgmma)
            out.append("recompute_walk.jinja")
    if cfg.cb == "stage":
        out.append("bmm.jinja")
    if cfg.rev_walk and backend == "cuda":   # PTX only (the knob needs tma and wgmma)
        out.append("state_walk_rev_gluon.jinja")
    out.append("dx.jinja")
    if cfg.dx_gluon and backend == "cuda":   # PTX only (the knob needs tma and wgmma)
        out.append("dx_gluon.jinja")
    out.append("dbc.jinja")
    if cfg.dcb_gluon and backend == "cuda":   # PTX only (the knob needs tma and wgmma)
        out.append("dcb_gluon.jinja")
    return out + ["gate.jinja"]


def render_context(cfg: BwdConfig, backend: str) -> dict:
    # walk_cfg: what the forward's walk template reads of a config, for recompute_walk = 1
    return {"state_tl_dtype": STATE_DTYPES[cfg.state_dtype],
            "walk_cfg": dict(chunk_size=cfg.chunk_size, **bwd_knobs.recompute_walk_modes(cfg))}


def stage_costs(problem: Problem, config: BwdConfig) -> list:
    """Bytes and FLOPs of each stage, for the static model: each stage's main operands read once
    (re-reads of shared B / C tiles ignored), its matmuls' causal FLOPs."""
    b, l, h, p, n, g = (problem.batch, problem.seqlen, problem.nheads, problem.headdim,
                        problem.dstate, problem.ngroups)
    q = config.chunk_size
    nc = _cdiv(l, q)
    e = DTYPE_BYTES[problem.dtype]
    s = DTYPE_BYTES[config.state_dtype]
    x = b * l * h * p * e
    bc = b * l * g * n * e
    st = b * nc * h * p * n
    ddA = 2 * b * h * nc * q * 4
    mm = lambda m, k, nn: 2.0 * m * k * nn  # noqa: E731
    out = []
    if problem.has_z:
        out.append(StageCost("gate", _cdiv(l, 32) * h * b, 5 * x, 0.0, 0.0))
    if not config.save_states:
        out.append(StageCost("cumsum", nc * _cdiv(h, config.cumsum_block_h) * b, b * l * h * 4 + ddA, 0.0, 0.0))
        out.append(StageCost("chunk_state", nc * b * h * _cdiv(p, config.state_block_m) * _cdiv(n, config.state_block_n),
                             x + bc + st * s, 0.0, b * nc * h * mm(p, q, n),
                             (config.state_block_m, config.state_block_n, config.state_block_k), config.state_stages))
        out.append(StageCost("state_passing", b * h * _cdiv(p * n, config.pass_block), 2 * st * s, 0.0, 0.0,
                             chain=nc))
    if config.cb == "stage":
        out.append(StageCost("bmm", nc * b * g * _cdiv(q, config.bmm_block_m) * _cdiv(q, config.bmm_block_n),
                             2 * bc + b * nc * g * q * q * (4 if config.cb_dtype == "fp32" else e), 0.0,
                             b * nc * g * mm(q, n, q) / 2))
    out.append(StageCost("dstates", nc * b * h * _cdiv(p, config.state_block_m) * _cdiv(n, config.state_block_n),
                         x + bc + st * 4, 0.0, b * nc * h * mm(p, q, n),
                         (config.state_block_m, config.state_block_n, config.state_block_k), config.state_stages))
    out.append(StageCost("state_passing_rev", b * h * _cdiv(p * n, config.pass_block), 2 * st * 4 + st * s, 0.0, 0.0,
                         chain=nc))
    inline = b * nc * h * mm(q, n, q) / 2 if config.cb == "inline" else 0.0
    # the dx state product runs twice at 16-bit inputs (the state gradient split in two halves)
    split = 1 if problem.dtype == "fp32" else config.dx_g_split
    out.append(StageCost("dx", nc * b * h * _cdiv(q, config.dx_block_m) * _cdiv(p, config.dx_block_n),
                         2 * x + bc + st * 4, 0.0,
                         b * nc * h * (split * mm(q, n, p) + mm(q, q, p) / 2) + inline,
                         (config.dx_block_m, config.dx_block_n, config.dx_block_k), config.dx_stages))
    gs = config.group_split
    tiles = _cdiv(q, config.dcb_block_m) * _cdiv(q, config.dcb_block_k)
    dcb = b * nc * g * gs * q * q * e
    out.append(StageCost("dcb", nc * b * g * gs * tiles, 2 * x + 2 * bc + dcb, 0.0,
                         b * nc * (h * mm(q, p, q) / 2 + g * gs * mm(q, n, q) / 2),
                         (config.dcb_block_m, config.dcb_block_k, 64), config.dcb_stages))
    grid = nc * b * g * gs * _cdiv(q, config.dbc_block_m) * _cdiv(n, config.dbc_block_n)
    for name in ("db", "dc"):
        out.append(StageCost(name, grid, x + bc + st * 4 + dcb + b * l * g * n * 4 * gs, 0.0,
                             b * nc * (h * mm(q, p, n) + g * gs * mm(q, q, n) / 2),
                             (config.dbc_block_m, config.dbc_block_n, config.dbc_block_k), config.dbc_stages))
    out.append(StageCost("ddt", nc * _cdiv(h, config.cumsum_block_h) * b, b * l * h * 4 * 5, 0.0, 0.0))
    return out


def tune_inputs(problem: Problem, device="cpu", seed: int = 0) -> dict:
    """The forward's inputs (testing.make_inputs), the incoming gradients dout (like y) and
    dfinal (where final states are returned), and the ungated output y' where z is given."""
    t = make_inputs(problem, device, seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 7919)
    t["dout"] = torch.randn(t["x"].shape, generator=g).to(t["x"].dtype).to(device)
    t["dfinal"] = (torch.randn(problem.batch, problem.nheads, problem.headdim, problem.dstate, generator=g).to(device)
                   if problem.return_final_states else None)
    if t["z"] is not None:
        kw = call_kwargs(problem, t)
        t["y_pre"] = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"], dt_bias=t["dt_bias"],
                                 initial_states=t["initial_states"], seq_idx=t["seq_idx"],
                                 dt_softplus=problem.dt_softplus,
                                 dt_limit=kw.get("dt_limit", (0.0, float("inf"))))[0].to(t["x"].dtype)
    return t


# what the gate's float64 reference may hold at once (more: a slice of heads at a time)
REF_BYTES = 8 << 30


def tune_reference(problem: Problem, t: dict):
    """The float64 reference's gradients, by name, of every input the call differentiates: the
    tuner's gate checks each (a stage's rounding may show in one only: dA and dt_bias sum every
    token's)."""
    kw = call_kwargs(problem, t)
    ref = backward.reference(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=t["D"], z=t["z"], dt_bias=t["dt_bias"],
                    initial_states=t["initial_states"], seq_idx=t["seq_idx"], dt_softplus=problem.dt_softplus,
                    dt_limit=kw.get("dt_limit", (0.0, float("inf"))), dout=t["dout"], dfinal=t["dfinal"],
                    max_bytes=REF_BYTES)
    # kept in float32 for the session's gates: half the memory of float64 (dx and dz alone are
    # 4.3 GB each at codestral 1 x 65536), and its rounding (6e-8) is far below every bound (1e-4)
    return {k: v.float() for k, v in ref.items() if t.get(k) is not None}


def tune_run(problem: Problem, config: BwdConfig, t: dict, backend: str = "cuda", poison: bool = False):
    """The generated backward of `config` on `t`: every gradient tune_reference holds, by name
    (what a training step asks for; the timed call too). poison: the buffers the kernels write
    whole start NaN-filled (the gate's run)."""
    kw = call_kwargs(problem, t)
    return backward.execute(problem, config, t, t["dout"], t["dfinal"],
                            need={k for k in backward.GRAD_NAMES if t.get(k) is not None},
                            dt_limit=kw.get("dt_limit", (0.0, float("inf"))), backend=backend, poison=poison)


def meta_launches(problem: Problem, config: BwdConfig, backend: str) -> list:
    """The plan's launches at `problem`'s shapes on meta tensors (the cross-compile report)."""
    t = meta_inputs(problem)
    dout = torch.empty_like(t["x"])
    dfinal = (torch.empty(problem.batch, problem.nheads, problem.headdim, problem.dstate, device="meta")
              if problem.return_final_states else None)
    if t["z"] is not None:
        t["y_pre"] = torch.empty_like(t["x"])
    buf = backward.allocate(problem, config, t, dout, dfinal, set(backward.GRAD_NAMES), None, backend=backend)
    return backward.plan(problem, config, t, buf, backend,
                (0.001, 0.1) if problem.has_dt_limit else (0.0, float("inf")), dout, dfinal, False)


OP = register(Op(
    name="ssd_bwd",
    space=SPACE,
    config_type=BwdConfig,
    stages=STAGES,
    sequences=SEQUENCES,
    template_dir="ssd_bwd",
    problem_type=Problem,
    includes=includes,
    render_context=render_context,
    plan=backward.plan,
    meta_launches=meta_launches,
    tune_inputs=tune_inputs,
    tune_reference=tune_reference,
    tune_run=tune_run,
    reference=backward.reference,
    cost_model=stage_costs,
    default_config=bwd_knobs.default_config,
    excluded=bwd_knobs.excluded,
    caps=bwd_knobs.caps,
    violations=bwd_knobs.violations,
    doc="Mamba-2 SSD backward: gradients of x, dt, A, B, C, D, z, dt_bias, initial_states",
))
