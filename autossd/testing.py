"""Inputs, references and tolerances shared by the tests, the tuner's correctness gate and the
benchmarks: one definition of "correct"."""
from __future__ import annotations

import torch

from .ops.common.launch_cache import InterpretedKernel, StubKernel  # noqa: F401 - for the replay tests
from .problem import TORCH_DTYPES, Problem

# ‖out − ref‖ / ‖ref‖ bounds. The kernels round matmul operands (x·scale, C·B products, the
# decay-weighted CB) to the input dtype and states to the state dtype; these bounds sit ~3x above
# what the interpreter and the H100 measure, far below what a wrong index gives (~1).
_TOL = {"fp32": 1e-4, "fp16": 3e-3, "bf16": 2.5e-2}


def tolerance(dtype: str, state_dtype: str = "fp32") -> float:
    return max(_TOL[dtype], _TOL[state_dtype] if state_dtype != "fp32" else 0.0)


# ‖g − ref‖ / ‖ref‖ bounds of the backward's gradients, per input dtype (every gradient, the fp32
# parameters' too: their sums carry the input dtype's rounding). The kernels measure fp32 ~1e-6,
# fp16 ~4e-4, bf16 ~3e-3 (interpreter, H100, H200); mamba_ssm's own are fp32 1.5e-3 (TF32), fp16
# 4e-4, bf16 3e-3, worst 3e-3 / 8e-4 / 1.1e-2. A wrong index or a missing term gives 1e-1 to 1.
_GRAD_TOL = {"fp32": 1e-4, "fp16": 3e-3, "bf16": 1.5e-2}


def grad_tolerance(dtype: str) -> float:
    return _GRAD_TOL[dtype]


def make_inputs(problem: Problem, device="cpu", seed: int = 0, nseqs: int = 3) -> dict:
    """Fresh random inputs for a problem, with every optional tensor the problem's flags ask for.
    dt is positive before softplus-free calls (a negative dt makes the decay grow)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b, l, h, p, n, ng = (problem.batch, problem.seqlen, problem.nheads, problem.headdim,
                         problem.dstate, problem.ngroups)
    dt_ = TORCH_DTYPES[problem.dtype]

    def rnd(*shape, dtype=dt_, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    t = dict(
        x=rnd(b, l, h, p), B=rnd(b, l, ng, n), C=rnd(b, l, ng, n),
        A=(-torch.rand(h, generator=g) * 4 - 0.5).to(device),
        dt=((torch.rand(b, l, h, generator=g) * 4 - 4) if problem.dt_softplus
            else torch.rand(b, l, h, generator=g) * 0.2 + 0.005).to(device))
    t["D"] = (rnd(h, p, dtype=torch.float32) if problem.D_has_hdim else rnd(h, dtype=torch.float32)) \
        if problem.has_D else None
    t["z"] = rnd(b, l, h, p) if problem.has_z else None
    t["dt_bias"] = rnd(h, dtype=torch.float32, scale=0.5) if problem.has_dt_bias else None
    t["initial_states"] = rnd(b, h, p, n, dtype=torch.float32) if problem.has_initial_states else None
    t["seq_idx"] = None
    t["cu_seqlens"] = None
    if problem.has_seq_idx or problem.return_varlen_states:
        cuts = sorted(torch.randperm(l - 1, generator=g)[: max(0, min(nseqs, l) - 1)].add(1).tolist())
        bounds = [0] + cuts + [l]
        seq = torch.zeros(b, l, dtype=torch.int32)
        for i in range(len(bounds) - 1):
            seq[:, bounds[i]:bounds[i + 1]] = i
        t["seq_idx"] = seq.to(device)
        if problem.return_varlen_states:
            t["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return t


def call_kwargs(problem: Problem, t: dict) -> dict:
    """The mamba_chunk_scan_combined keyword arguments for inputs made by make_inputs."""
    kw = {k: t[k] for k in ("D", "z", "dt_bias", "initial_states", "seq_idx", "cu_seqlens")}
    kw.update(dt_softplus=problem.dt_softplus, return_final_states=problem.return_final_states,
              return_varlen_states=problem.return_varlen_states)
    if problem.has_dt_limit:
        kw["dt_limit"] = (0.001, 0.1)
    return kw


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or Inf anywhere gives inf."""
    o = out.to(torch.float64)
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - ref.to(o.device)).norm() / ref.norm().clamp_min(1e-300))


def interpret_launch_cache(monkeypatch, op_module, launch: str) -> dict:
    """Route an op's launch cache through the interpreter for a test (pytest's monkeypatch): its
    plain launches (`op_module.<launch>`) run and return InterpretedKernel stand-ins, so they are
    recorded; every replay takes the launch-hook path on stream 7; the op's cache starts empty.
    Returns the live counts {"planned": launches planned, "replays": records replayed}."""
    from .ops.common import launch_cache as lc
    seen = {"planned": 0, "replays": 0}
    real_launch, real_replay = getattr(op_module, launch), lc.replay

    def planned(launches, module):
        seen["planned"] += len(launches)
        real_launch(launches, module)
        return [InterpretedKernel(getattr(module, ln.kernel), ln.options) for ln in launches]

    def replay(*a, **k):
        seen["replays"] += 1
        return real_replay(*a, **k)

    monkeypatch.setattr(op_module, launch, planned)
    monkeypatch.setattr(lc, "replay", replay)
    monkeypatch.setattr(lc, "_hooked", lambda: True)
    monkeypatch.setattr(lc, "replay_stream", lambda device: 7)
    monkeypatch.setattr(op_module, "_launch_cache", {})
    return seen


def record_and_replay(planned, module, inputs: tuple, buffers: tuple, seeds=(2, 3)) -> tuple[list, int]:
    """Record one call's launches with stub kernels and replay the record on other calls:
    `planned(seed)` gives a call's (tensors by name, buffers, fresh plan); the record is made
    from seed 1's, then replayed on each of `seeds` on stream 7, each replay checked against that
    call's own fresh plan (`replayed_as_planned`). Returns (seed 1's launches, descriptors compared)."""
    from .ops.common import launch_cache as lc
    t1, buf1, launches1 = planned(1)
    stubs = [StubKernel() for _ in launches1]
    rec = lc.record(launches1, stubs, t1, buf1, module, inputs, buffers)
    descs = 0
    for seed in seeds:
        t, buf, launches = planned(seed)
        lc.replay(rec, t, buf, stream=7)
        descs += replayed_as_planned(launches, stubs, module)
    return launches1, descs


def replayed_as_planned(launches: list, stubs: list, module) -> int:
    """Check that the last launch each StubKernel of `stubs` replayed passed what `launches` (a
    fresh plan of the same call) would: the grid; every tensor as its address; a TMA descriptor
    on the same tensor with the same shape, strides and padding; every other value as it is.
    Returns how many descriptors were compared."""
    from .ops.common.launch_cache import TMA_DESCRIPTORS
    descs = 0
    for ln, stub in zip(launches, stubs, strict=True):
        grid, args = stub.calls.pop()
        want = [{**ln.args, **ln.constexprs}[n] for n in getattr(module, ln.kernel).arg_names]
        assert grid == tuple(ln.grid) + (1,) * (3 - len(ln.grid)) and len(args) == len(want), ln.kernel
        for a, w in zip(args, want):
            if isinstance(w, torch.Tensor):
                assert a == w.data_ptr(), ln.kernel
            elif isinstance(w, TMA_DESCRIPTORS):
                descs += 1
                assert a.base is w.base and (list(a.shape), list(a.strides), a.padding) == (
                    list(w.shape), list(w.strides), w.padding), ln.kernel
            else:
                assert a == w, ln.kernel
    return descs
