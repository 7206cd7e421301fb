"""The correctness gate: a candidate's output is compared with the float64 reference before it is
timed, and a candidate outside the tolerance is recorded as failed — a wrong kernel never wins.

"Correct" has one definition, shared with the tests and benchmarks: `autossd.testing` (inputs,
`tolerance(dtype, state_dtype)` on the relative L2 error). The gate adds a max-element bound so a
single corrupted element cannot hide in the L2 norm of a large output:
    rel_l2  = ||y - ref||_2 / ||ref||_2        <= testing.tolerance(dtype, state_dtype)
    max_err = max|y - ref| / max|ref|          <= max(MAX_ERR of both dtypes, 10 x that tolerance)
and every output must be finite (NaN/Inf: failed).

An op's outputs are (the checked output, an optional second: the forward's and packed prefill's
final states, the decode step's updated state), or, for the backward, every gradient by name,
each held to `testing.grad_tolerance` of the input dtype (the bound the tests and the benchmark
hold the drop-in's gradients to: a candidate that buys speed with one gradient's accuracy, e.g.
dA's through the state path, fails here). The pair is held to the looser bound of the input
dtype and the state dtype the *problem* names (the decode step's and packed prefill's callers
choose the dtype their states are kept in; the forward's problems name none: fp32). A candidate
never gets a looser bound for a state dtype of its own config: tuning must not buy speed with
accuracy the caller did not give up. The second output's bound is the input dtype's, not fp32's:
states computed from half-precision inputs carry that precision (the float64 reference takes the
same rounded inputs, but the kernels round their matmul operands to the input dtype).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..knobs import BaseConfig as Config
from ..ops.registry import get_op, op_of
from ..problem import Problem
from ..testing import grad_tolerance, tolerance

MAX_ERR = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 1e-1}

Runner = Callable[[Problem, Config, dict], object]


@dataclass
class GateResult:
    ok: bool
    max_err: float
    rel_l2: float
    why: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def make_inputs(problem: Problem, device="cpu", seed: int = 0, op: str | None = None) -> dict:
    """Fresh random inputs of `op` for `problem` (the op's `tune_inputs`)."""
    return get_op(op_of(problem, op)).fn("tune_inputs")(problem, device, seed)


def input_bytes(t: dict) -> int:
    return sum(v.numel() * v.element_size() for v in t.values() if isinstance(v, torch.Tensor))


def reference(problem: Problem, t: dict, op: str | None = None):
    """The float64 outputs the gate compares with (the op's `tune_reference`)."""
    return get_op(op_of(problem, op)).fn("tune_reference")(problem, t)


def default_run(problem: Problem, config: Config, t: dict, backend: str = "cuda", poison: bool = False):
    """The generated kernels of `config` on `t` (its op's `tune_run`); poison: its outputs and
    intermediates in fresh NaN-filled buffers (what the gate runs)."""
    return get_op(config.op).fn("tune_run")(problem, config, t, backend, poison=poison)


def poisoned_run(problem: Problem, config: Config, t: dict, backend: str = "cuda"):
    """The gate's run of a candidate: an element its kernels never write is NaN, so it fails the
    finiteness check even where no reference covers it, and never passes by holding an earlier
    candidate's right answer left in reused memory."""
    return default_run(problem, config, t, backend, poison=True)


def compare(out, ref, dtype: str, state_dtype: str = "fp32", tol: float | None = None) -> GateResult:
    """Judge one output tensor against its float64 reference, at the looser bound of `dtype` and
    `state_dtype` (the problem's, never a candidate's: see the module docstring), or at `tol`."""
    tol_l2 = tolerance(dtype, state_dtype) if tol is None else tol
    tol_max = max(MAX_ERR[dtype], MAX_ERR[state_dtype] if state_dtype != "fp32" else 0.0, 10 * tol_l2)
    out64 = out.detach().to(torch.float64)
    ref = ref.to(out64.device)
    if out64.shape != ref.shape:
        return GateResult(False, float("inf"), float("inf"), f"shape {tuple(out64.shape)} != {tuple(ref.shape)}")
    if not torch.isfinite(out64).all():
        return GateResult(False, float("inf"), float("inf"), "non-finite values in the output")
    diff = out64 - ref
    max_err = float(diff.abs().max() / ref.abs().max().clamp_min(1e-300))
    rel_l2 = float(diff.norm() / ref.norm().clamp_min(1e-300))
    why = []
    if max_err > tol_max:
        why.append(f"max error {max_err:.2e} > {tol_max:.0e}")
    if rel_l2 > tol_l2:
        why.append(f"relative L2 error {rel_l2:.2e} > {tol_l2:.0e}")
    return GateResult(not why, max_err, rel_l2, "; ".join(why))


def check(problem: Problem, config: Config, t: dict, ref, run: Runner = poisoned_run) -> GateResult:
    """Run the candidate once and compare with `ref` (from `reference`). An exception in the
    candidate is a failed gate, not a crash of the tuner. A reference may cover the leading rows
    of the batch and a subset of the heads (an op's tune_reference may, for large problems:
    the forward's does): those are compared, and every element of the outputs must be finite."""
    try:
        out = run(problem, config, t)
    except Exception as e:  # a candidate's error is a verdict on the candidate
        return GateResult(False, float("inf"), float("inf"), f"{type(e).__name__}: {e}")
    if isinstance(ref, dict):
        return _check_named(problem, out, ref)
    y_ref, final_ref, heads = ref if len(ref) == 3 else (*ref, None)
    y = out[0] if isinstance(out, tuple) else out
    state_dtype = getattr(problem, "state_dtype", "fp32")
    final = out[1] if isinstance(out, tuple) and len(out) > 1 else None
    for i, v in enumerate(out if isinstance(out, tuple) else (out,)):
        if isinstance(v, torch.Tensor) and not bool(torch.isfinite(v).all()):
            name = ("output", "states")[i] if i < 2 else f"output {i}"
            return GateResult(False, float("inf"), float("inf"), f"non-finite values in the {name} (all of it checked)")
    if heads is not None:   # y (b, l, h, p), final (b, h, p, n): the heads the reference covers
        want = (y_ref.shape[1], problem.nheads, y_ref.shape[3])
        if y.dim() != 4 or (y.shape[1], y.shape[2], y.shape[3]) != want:
            return GateResult(False, float("inf"), float("inf"), f"shape {tuple(y.shape)}, expected (b, *{want})")
        hs = torch.tensor(heads, device=y.device)
        y = y.index_select(2, hs)
        final = final.index_select(1, hs) if final is not None else None
    # a reference of a large batch may cover only its leading sequences (an op's tune_reference)
    rows = y_ref.shape[0] if y.dim() == y_ref.dim() and y.shape[1:] == y_ref.shape[1:] else None
    res = compare(y[:rows], y_ref, problem.dtype, state_dtype)
    if res.ok and final_ref is not None:
        if final is None:
            return GateResult(False, float("inf"), float("inf"), "the second output (states) is missing")
        fin = compare(final[:rows], final_ref, problem.dtype, state_dtype)
        if not fin.ok:
            return GateResult(False, fin.max_err, fin.rel_l2, f"states: {fin.why}")
    return res


def _check_named(problem: Problem, out, ref: dict) -> GateResult:
    """Every named output (the backward's gradients) against its reference, each at the gradient
    bound of the problem's dtype: the first that fails, else the result of the worst."""
    if not isinstance(out, dict) or set(out) != set(ref):
        got = sorted(out) if isinstance(out, dict) else type(out).__name__
        return GateResult(False, float("inf"), float("inf"), f"outputs {got}, expected {sorted(ref)}")
    tol = grad_tolerance(problem.dtype)
    worst = None
    for name, r in ref.items():
        res = compare(out[name], r, problem.dtype, tol=tol)
        if not res.ok:
            return GateResult(False, res.max_err, res.rel_l2, f"{name}: {res.why}")
        if worst is None or res.rel_l2 > worst.rel_l2:
            worst = GateResult(True, res.max_err, res.rel_l2, f"worst: {name}")
    return worst if worst is not None else GateResult(False, float("inf"), float("inf"), "no outputs")
