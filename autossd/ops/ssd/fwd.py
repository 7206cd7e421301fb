"""The SSD forward (`ssd_fwd`), declared once: its stages, knob space, templates, plan, float64
reference, cost model, defaults and constraints. Everything else takes them from here through
`autossd.ops.registry.get_op("ssd_fwd")`."""
from __future__ import annotations

import torch

from ... import knobs, testing
from ...compile import meta_inputs
from ...testing import call_kwargs
from ...problem import Problem
from ..registry import Op, Stage, register
from . import fwd_cost, fwd_knobs, fwd_seeds, naive
from . import plan as plan_mod
from .chunk import execute
from .workspace import allocate
from .fwd_knobs import SPACE, STATE_DTYPES, Config

# Every launch, in the order of a module's LAUNCH table, and the launches of each fusion depth in
# order. Depth 5: cumsum | bmm | chunk state | state passing | chunk scan; 3: bmm | cumsum + chunk
# state + ordered state passing | chunk scan; 1: everything in one launch. The Gluon walk, its join
# and the Gluon scans take launch options of their own (one warpgroup, rings sized in their
# templates), so they are no stages of this table: plan() launches them in their stage's place.
STAGES = (
    Stage("cumsum"),
    Stage("bmm", "bmm_warps", "bmm_stages"),
    Stage("chunk_state", "state_warps", "state_stages", "state_maxnreg"),
    Stage("state_passing", "pass_warps"),
    Stage("chunk_scan", "scan_warps", "scan_stages", "scan_maxnreg"),
    Stage("state_fused", "state_warps", "state_stages", "state_maxnreg"),
    Stage("fused", "scan_warps", "scan_stages", "scan_maxnreg"),
)
SEQUENCES = {5: ("cumsum", "bmm", "chunk_state", "state_passing", "chunk_scan"),
             3: ("bmm", "state_fused", "chunk_scan"),
             1: ("fused",)}

# The Problem flags that shape no main loop of the forward (see Op.soft_flags): a record tuned
# without one of them still holds a good config for a query with it. Each was checked where the
# templates and plan() use it:
#   has_z, has_D, D_has_hdim: the chunk scan's epilogue (and the fused kernel's per output tile,
#     the Gluon scans' before the store): y = (acc + D x) * silu(z), one more load of a tile the
#     size of y; the tiles and the products that make acc are the same.
#   has_dt_bias, dt_softplus, has_dt_limit: the elementwise step on dt before its within-chunk
#     cumsum (cumsum.jinja's _dt_cumsum, wherever the cumsum runs or is folded in): per (token,
#     head), against the main loops' per (token, head, headdim x dstate) work.
#   has_initial_states, return_final_states: one state read before the chain over chunks and
#     one written after it, per (sequence, head); the chain's loop is the same.
# Hard (every other field): dtype, headdim, dstate and chunk_size set the tiles; has_seq_idx
# enters the chunk scan's and the state chain's loops (and the Gluon kernels refuse it);
# return_varlen_states comes only with packed sequences (cu_seqlens) and keeps every chunk's state.
SOFT_FLAGS = ("has_z", "has_D", "D_has_hdim", "has_dt_bias", "dt_softplus", "has_dt_limit",
              "has_initial_states", "return_final_states")


def includes(cfg: Config, backend: str) -> list[str]:
    """The template files a config's module holds, in order: its depth's kernels and the files
    of the helpers they call (cumsum.jinja and chunk_scan.jinja hold helpers of the fused
    kernels beside their own kernels). A record's freshness is the hash of this rendering, so an
    edit to a file a config does not include leaves its records fresh."""
    depth = cfg.launches
    gluon = backend == "cuda"   # the Gluon kernels are PTX-only (the knobs need tma and wgmma)
    out = ["cumsum.jinja", "local_state.jinja"]
    if depth != 1:
        out.append("bmm.jinja")
    if depth == 5:
        if cfg.fold_prep == 2:
            out.append("prep.jinja")
        if cfg.fold_prep == 1:
            out += ["fold_cumsum.jinja", "chunk_state_prep.jinja"]
        else:
            out.append("chunk_state_gluon.jinja" if cfg.smem_pad else "chunk_state.jinja")
        out.append("state_passing.jinja")
        if cfg.state_walk and gluon:
            out.append("state_walk_gluon.jinja")
    out.append("chunk_scan.jinja")
    if cfg.scan_gluon and gluon:
        out.append("chunk_scan_gluon.jinja")
    if depth != 5:
        out.append("fused_common.jinja")
    if depth == 3:
        out.append("state_fused.jinja")
    if depth == 1:
        out.append("fused.jinja")
    return out


def render_context(cfg: Config, backend: str) -> dict:
    # packed: the family's five-launch stage files (templates/ssd/) render their dense kernels
    return {"state_tl_dtype": STATE_DTYPES[cfg.state_dtype], "packed": False}


def meta_launches(problem: Problem, config: Config, backend: str) -> list:
    """The plan's launches at `problem`'s shapes with meta tensors: what the cross-compile
    report compiles, with no device."""
    return plan_mod.plan(problem, config, meta_inputs(problem), allocate(problem, config, "meta"), backend)


# float64 bytes the gate's reference may hold in chunk states (its own, and each chunk's entering
# one): a grid shape of 64 x 8192 tokens of 256 heads would need 68 GB of them for every sequence
REF_STATE_BYTES = 4 << 30
# float64 multiply-adds (tokens x heads x headdim x dstate) past which the reference covers a
# subset of the heads: the reference of the whole grid shape took 20-44 s of each large study's
# first evaluation on an H200 (524288 tokens, 48-112 heads), 88% of a measured grid tune's
# evaluation time, where a candidate's own check and timing take about a second
REF_WORK = 1 << 32


def reference_heads(problem: Problem) -> list[int] | None:
    """The heads the gate's float64 reference covers: None for all of them, else the first, the
    middle and the last head of every group, in order (heads are computed independently, so the
    reference of a subset is exact for those heads; each keeps its group, three heads a group).
    Past REF_WORK only, and where a group has more than three heads."""
    work = problem.batch * problem.seqlen * problem.nheads * problem.headdim * problem.dstate
    r = problem.nheads // problem.ngroups
    if work <= REF_WORK or r <= 3:
        return None
    return [h for g in range(problem.ngroups) for h in (g * r, g * r + r // 2, g * r + r - 1)]


def reference_rows(problem: Problem) -> int:
    """How many leading sequences of the batch the gate's float64 reference covers: all, unless
    their chunk states would pass REF_STATE_BYTES (then as many as fit, at least one). A config's
    kernels treat every sequence alike, so the leading ones judge it; varlen and seq_idx calls
    (one packed row) are covered whole."""
    heads = reference_heads(problem)
    nc = -(-problem.seqlen // 256)
    per_row = 2 * nc * (len(heads) if heads else problem.nheads) * problem.headdim * problem.dstate * 8
    return max(1, min(problem.batch, REF_STATE_BYTES // per_row))


def tune_reference(problem: Problem, t: dict):
    """(float64 y, the final states when the problem returns them, the heads they cover: None for
    all) of the leading `reference_rows` sequences and the `reference_heads` heads (the gate
    compares those, and checks the whole output for values never written or not finite)."""
    rows = reference_rows(problem)
    if rows < problem.batch and t.get("cu_seqlens") is None:
        batched = ("x", "dt", "B", "C", "z", "initial_states", "seq_idx")
        t = {k: (v[:rows] if k in batched and v is not None else v) for k, v in t.items()}
    heads = reference_heads(problem)
    if heads is not None:
        # the per-head inputs of those heads; B and C keep every group (each kept head's group
        # index is unchanged: three heads a group, in group order)
        hs = torch.tensor(heads, device=t["x"].device)
        by_head = {"x": 2, "dt": 2, "z": 2, "A": 0, "D": 0, "dt_bias": 0, "initial_states": 1}
        t = {k: (v.index_select(by_head[k], hs) if k in by_head and v is not None else v) for k, v in t.items()}
    kw = call_kwargs(problem, t)
    y, final, _ = naive.ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], 256, D=kw["D"],
                              z=kw["z"], dt_bias=kw["dt_bias"], initial_states=kw["initial_states"],
                              seq_idx=kw["seq_idx"], cu_seqlens=kw["cu_seqlens"],
                              dt_softplus=problem.dt_softplus,
                              dt_limit=kw.get("dt_limit", (0.0, float("inf"))))
    return y, (final if problem.return_final_states else None), heads


def tune_run(problem: Problem, config: Config, t: dict, backend: str = "cuda", poison: bool = False):
    """The generated kernels of `config` on inputs `t`, intermediates kept (the tuner times it);
    poison: into fresh NaN-filled buffers instead (the gate's run: an element no kernel writes
    stays NaN, where a kept or reused buffer could hold an earlier candidate's right answer)."""
    kw = call_kwargs(problem, t)
    return execute(problem, config, t, cu_seqlens=kw["cu_seqlens"],
                   dt_limit=kw.get("dt_limit", (0.0, float("inf"))), backend=backend, keep=not poison,
                   poison=poison)


OP = register(Op(
    name="ssd_fwd",
    space=SPACE,
    config_type=Config,
    stages=STAGES,
    sequences=SEQUENCES,
    template_dir="ssd_fwd",
    problem_type=Problem,
    includes=includes,
    render_context=render_context,
    plan=plan_mod.plan,
    meta_launches=meta_launches,
    tune_inputs=testing.make_inputs,
    tune_reference=tune_reference,
    tune_run=tune_run,
    reference=naive.ssd_chunked,
    cost_model=fwd_cost.stage_costs,
    default_config=fwd_knobs.default_config,
    violations=fwd_knobs.violations,
    amd_options=("waves_per_eu", "matrix_instr_nonkdim", "kpack"),
    caps=fwd_seeds.search_caps,
    excluded=knobs.state_dtype_excluded,
    seeds=fwd_seeds.seed_configs,
    unvalidated=fwd_seeds.unvalidated,
    soft_flags=SOFT_FLAGS,
    doc="Mamba-2 SSD forward: y (and final / varlen states) from x, dt, A, B, C, D, z",
))
