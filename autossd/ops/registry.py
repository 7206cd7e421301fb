"""The op registry: each op declares, in one place, everything the pipeline needs of it.

template -> render -> compile -> measure -> store -> load: the renderer takes an op's template
folder and the templates a config includes, the cross-compile report and the measured runner
take its launch plan, the tuner its knob space, defaults, constraints, cost model and float64
reference, the store validates records against its space and problem type, and the runtime
looks records up by op. None of them names an op; they ask `get_op(config.op)` or take the op's
name as a parameter.

An op's declaration lives beside its kernels (`autossd/ops/<family>/<op>.py`) and registers
itself when imported, with the functions themselves (an editor follows them; a wrong name fails
at import); `_BUILTIN` says which module declares each shipped op, so `get_op` can import it on
first use (nothing here imports torch or triton).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..knobs import BaseConfig, KnobSpace


@dataclass(frozen=True)
class Stage:
    """One kernel launch of an op: the name its plan, compile report and cost model use, and
    the knobs that give its launch options."""
    name: str
    warps: str | None = None     # knob giving num_warps (None: 4)
    stages: str | None = None    # knob giving num_stages (None: 1: a stage with no matmul loop)
    maxnreg: str | None = None   # knob giving a register cap (offered where Arch.maxnreg)

    def launch_options(self, config: BaseConfig, backend: str, amd_options: tuple = ()) -> dict[str, Any]:
        opts = {"num_warps": config[self.warps] if self.warps else 4,
                "num_stages": config[self.stages] if self.stages else 1}
        if backend == "hip":
            opts.update({k: config[k] for k in amd_options})
        elif self.maxnreg and config[self.maxnreg]:  # a CUDA option only; 0 leaves ptxas its choice
            opts["maxnreg"] = config[self.maxnreg]
        return opts


@dataclass(frozen=True)
class Op:
    """An op's declaration: its knob space, stages and templates, and the functions the pipeline
    calls (the declaring module is imported on the op's first use: see `get_op`)."""
    name: str
    space: KnobSpace
    config_type: type[BaseConfig]
    stages: tuple[Stage, ...]    # every launch of the op (the order of a module's LAUNCH table)
    sequences: dict              # value of the mode knob -> the names of the stages it launches, in order
    template_dir: str            # folder under templates/ holding module.py.jinja and its includes
    problem_type: type           # its key() is the record's problem; type(**key) validates it back
    # (config, backend) -> the template files the config's module includes, in order: the
    # kernels of its mode and the helpers they call (a record's freshness hashes this rendering)
    includes: Callable
    # (config, backend) -> extra template variables beyond cfg, backend and launch
    render_context: Callable
    plan: Callable               # (problem, config, tensors, buffers, backend) -> launches
    meta_launches: Callable      # (problem, config, backend) -> launches on meta tensors (cross-compile report)
    # the tuner's correctness gate and timing: (problem, device, seed) -> inputs; (problem,
    # inputs) -> float64 outputs (first the checked output, then an optional second, or None);
    # (problem, config, inputs, backend) -> outputs of the generated kernels
    tune_inputs: Callable
    tune_reference: Callable
    tune_run: Callable
    reference: Callable          # float64 reference of the op's outputs
    cost_model: Callable         # (problem, config) -> [core.cost.StageCost]: the static model's inputs
    default_config: Callable     # (arch, problem=None) -> config: used where no record applies
    violations: Callable         # (config, arch, problem=None) -> reasons it cannot run
    amd_options: tuple = ()      # knobs passed to the AMD compiler as launch options
    # the tuner's hooks (optional): (problem) -> {knob: largest useful value}; (problem) ->
    # {knob: values never offered}; (arch, problem, search space) -> seed configs, default first
    caps: Callable | None = None
    excluded: Callable | None = None
    seeds: Callable | None = None
    # (arch) -> {knob: values whose correctness has never been shown on that arch's hardware}:
    # a tune for an arch not `hardware_validated` leaves them out unless the user opts in
    unvalidated: Callable | None = None
    # (problem, config, inputs, backend) -> outputs: what the measured runner times, where it
    # differs from tune_run (None: tune_run). An op that updates an input in place has tune_run
    # work on a copy so the gate sees fresh inputs; the copy is no part of the op's time, so its
    # timed call updates the inputs themselves (the runner gates on a copy of its own)
    tune_time: Callable | None = None
    # problem fields (flags) that only change the kernels' prologue or epilogue, never a main
    # loop's tiles or math: the lookup's nearest tier lets a record that differs from the query in
    # them serve it, at a distance penalty per differing flag (autossd.db.lookup). Every other
    # field must match. Empty (the safe choice) until each flag's use in the op's kernels is read.
    soft_flags: tuple[str, ...] = ()
    # what is known of the static model's ranking of this op's configs against measurements,
    # where it does not beat the op's default: a static tune says it before it starts
    static_caveat: str = ""
    doc: str = ""

    def fn(self, role: str) -> Callable:
        """The callable declared for `role` ("plan", "reference", "cost_model", ...)."""
        f = getattr(self, role)
        if not callable(f):
            raise ValueError(f"op {self.name!r}: declares no {role}")
        return f

    @property
    def mode_knob(self) -> str:
        return self.space.mode_knob

    def stages_at(self, mode: Any) -> tuple[Stage, ...]:
        """The launches a mode runs, in order."""
        by_name = {s.name: s for s in self.stages}
        return tuple(by_name[n] for n in self.sequences[mode])

    def launch_options(self, config: BaseConfig, backend: str) -> dict[str, dict[str, Any]]:
        """num_warps / num_stages (and the CUDA register cap or the AMD compiler knobs) per stage,
        for every stage of the op (a module's LAUNCH table)."""
        out = {s.name: s.launch_options(config, backend, self.amd_options) for s in self.stages}
        if config.get("pdl"):   # programmatic dependent launch: every launch of the op may overlap
            for opts in out.values():   # its predecessor (only then: the table is in every module)
                opts["launch_pdl"] = True
        return out

    def config(self, values=None, **kw) -> BaseConfig:
        return self.config_type(values, **kw)


_OPS: dict[str, Op] = {}
# records and trial logs written before ops were named are the forward's (autossd.tuner.sinks)
LEGACY_OP = "ssd_fwd"
# which module declares each shipped op (imported by get_op on first use)
_BUILTIN = {"ssd_fwd": "autossd.ops.ssd.fwd", "ssd_bwd": "autossd.ops.ssd.bwd", "ssd_varlen": "autossd.ops.ssd.varlen",
            "ssd_decode": "autossd.ops.ssd.decode", "sscan_fwd": "autossd.ops.mamba1.fwd",
            "sscan_bwd": "autossd.ops.mamba1.bwd"}


def register(op: Op) -> Op:
    if op.space.op != op.name:
        raise ValueError(f"op {op.name!r}: its knob space is declared for {op.space.op!r}")
    if op.config_type.space is not op.space:
        raise ValueError(f"op {op.name!r}: its config type validates against another space")
    unknown = sorted(set(op.soft_flags) - set(op.problem_type.field_names()))
    if unknown:
        raise ValueError(f"op {op.name!r}: soft flags {unknown} are no fields of {op.problem_type.__name__}")
    names = {s.name for s in op.stages}
    for mode, seq in op.sequences.items():
        if mode not in op.space.modes or not set(seq) <= names:
            raise ValueError(f"op {op.name!r}: sequence {mode!r} -> {seq} names an unknown mode or stage")
    _OPS[op.name] = op
    return op


def get_op(name: str) -> Op:
    op = _OPS.get(name)
    if op is None and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
        op = _OPS.get(name)
    if op is None:
        raise ValueError(f"op: unknown op {name!r}; known: {sorted(set(_OPS) | set(_BUILTIN))}")
    return op


def op_of(problem, op: str | None = None) -> str:
    """`op`, else the op a problem of its type keys records for (`ProblemFields.default_op`)."""
    if op is not None:
        return op
    named = getattr(type(problem), "default_op", None)
    if named is None:
        raise ValueError(f"op: a {type(problem).__name__} names no op of its own; pass op")
    return named


def op_names() -> tuple[str, ...]:
    """Every op the registry knows (declared or shipped)."""
    return tuple(sorted(set(_OPS) | set(_BUILTIN)))
