"""The correctness gate: a candidate's output is compared with the float64 reference before it is
timed, and a candidate outside the tolerance is recorded as failed — a wrong kernel never wins.

Tolerance is set by the caller's input dtype (what the caller can expect from that dtype), not by
the candidate: lowering `state_dtype` to fp16/bf16 passes for fp16/bf16 inputs (~1e-3 error, the
same order as rounding y) but fails for fp32 inputs. Two measures, both normalized by max|ref|
so they do not depend on the data's scale:
    max_err = max|y - ref| / max|ref|          (one corrupted element fails it)
    rel_l2  = ||y - ref||_2 / ||ref||_2       (a small systematic bias fails it)
and every output must be finite.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..problem import TORCH_DTYPES, Problem
from ..space import Config

# (max_err, rel_l2) per input dtype; fp16 eps 9.8e-4, bf16 eps 7.8e-3 (y is rounded to them)
TOLERANCE: dict[str, tuple[float, float]] = {
    "fp32": (2e-4, 5e-5),
    "fp16": (1e-2, 4e-3),
    "bf16": (6e-2, 2e-2),
}

Runner = Callable[[Problem, Config, dict], object]


@dataclass
class GateResult:
    ok: bool
    max_err: float
    rel_l2: float
    why: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def make_inputs(problem: Problem, device="cpu", seed: int = 0) -> dict:
    """Random inputs in Mamba-2's ranges: dt' around 0.01–0.1, A in [-16, -1] (decays that
    span a few to a few hundred tokens), unit-variance x, B, C."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, l, h, p, n, g = (problem.batch, problem.seqlen, problem.nheads, problem.headdim,
                        problem.dstate, problem.ngroups)
    dt_ = TORCH_DTYPES[problem.dtype]
    f32 = torch.float32

    def rnd(*shape, dtype=dt_, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    t = dict(x=rnd(b, l, h, p), B=rnd(b, l, g, n), C=rnd(b, l, g, n),
             A=(-(1.0 + 15.0 * torch.rand(h, generator=gen))).to(device))
    if problem.dt_softplus:   # raw dt; softplus(dt + bias) lands near 0.01–0.1
        t["dt"] = rnd(b, l, h, dtype=f32, scale=0.5) - 3.0
    else:
        t["dt"] = (0.01 + 0.09 * torch.rand(b, l, h, generator=gen)).to(device)
    t["dt_bias"] = rnd(h, dtype=f32, scale=0.1) if problem.has_dt_bias else None
    t["D"] = (rnd(h, p, dtype=f32) if problem.D_has_hdim else rnd(h, dtype=f32)) if problem.has_D else None
    t["z"] = rnd(b, l, h, p) if problem.has_z else None
    t["initial_states"] = rnd(b, h, p, n, dtype=f32) if problem.has_initial_states else None
    t["seq_idx"] = None
    if problem.has_seq_idx:   # two sequences per row, split in the middle
        t["seq_idx"] = (torch.arange(l) >= l // 2).to(torch.int32).expand(b, l).contiguous().to(device)
    return t


def input_bytes(t: dict) -> int:
    return sum(v.numel() * v.element_size() for v in t.values() if isinstance(v, torch.Tensor))


def reference(problem: Problem, t: dict, chunk_size: int = 256):
    """float64 y (and final states when the problem returns them)."""
    from ..ops.ssd.naive import ssd_chunked
    y, final, _ = ssd_chunked(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size, D=t["D"],
                              z=t["z"], dt_bias=t["dt_bias"], initial_states=t["initial_states"],
                              seq_idx=t["seq_idx"], dt_softplus=problem.dt_softplus)
    return y, (final if problem.return_final_states else None)


def default_run(problem: Problem, config: Config, t: dict, backend: str = "cuda"):
    from ..ops.ssd.chunk import execute
    return execute(problem, config, t, backend=backend)


def compare(out, ref, dtype: str) -> GateResult:
    """Judge one output tensor against its float64 reference."""
    tol_max, tol_l2 = TOLERANCE[dtype]
    out64 = out.detach().to(torch.float64)
    if out64.shape != ref.shape:
        return GateResult(False, float("inf"), float("inf"), f"shape {tuple(out64.shape)} != {tuple(ref.shape)}")
    if not torch.isfinite(out64).all():
        return GateResult(False, float("inf"), float("inf"), "non-finite values in the output")
    diff = out64 - ref
    scale = ref.abs().max().clamp_min(1e-30)
    max_err = float(diff.abs().max() / scale)
    rel_l2 = float(diff.norm() / ref.norm().clamp_min(1e-30))
    why = []
    if max_err > tol_max:
        why.append(f"max error {max_err:.2e} > {tol_max:.0e}")
    if rel_l2 > tol_l2:
        why.append(f"relative L2 error {rel_l2:.2e} > {tol_l2:.0e}")
    return GateResult(not why, max_err, rel_l2, "; ".join(why))


def check(problem: Problem, config: Config, t: dict, ref, run: Runner = default_run) -> GateResult:
    """Run the candidate once and compare with `ref` (from `reference`). An exception in the
    candidate is a failed gate, not a crash of the tuner."""
    y_ref, final_ref = ref
    try:
        out = run(problem, config, t)
    except Exception as e:  # a candidate's error is a verdict on the candidate
        return GateResult(False, float("inf"), float("inf"), f"{type(e).__name__}: {e}")
    y = out[0] if isinstance(out, tuple) else out
    res = compare(y, y_ref, problem.dtype)
    if res.ok and final_ref is not None and isinstance(out, tuple):
        fin = compare(out[1], final_ref, "fp32" if config.state_dtype == "fp32" else problem.dtype)
        if not fin.ok:
            return GateResult(False, fin.max_err, fin.rel_l2, f"final states: {fin.why}")
    return res
