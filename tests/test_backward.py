"""The SSD backward (`ssd_bwd`) through the public drop-in: the gradient of every input against
float64 autograd through the references (naive.ssd_chunked / ssd_recurrent), as relative L2 errors
per input, at small shapes in Triton's CPU interpreter (or on a GPU where there is one)."""
from __future__ import annotations

import pytest
import torch

import autossd
from autossd import render
from autossd.ops.registry import get_op
from autossd.ops.ssd import backward as bw
from autossd.ops.ssd.bwd_knobs import KNOBS, BwdConfig, default_config, violations
from autossd.problem import Problem
from autossd.testing import (call_kwargs, grad_tolerance, interpret_launch_cache, make_inputs, rel_err,
                             record_and_replay)
from autossd.tuner import build_space

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
# ‖g − ref‖ / ‖ref‖ bounds per input dtype: the one definition the tuner's gate and the benchmark
# use too (testing.grad_tolerance). The interpreter computes in the input dtype's rounding as a GPU
# does (matmul operands in the input dtype, fp32 accumulation).
TOL = {d: grad_tolerance(d) for d in ("fp32", "fp16", "bf16")}


def _prob(dtype="fp32", l=100, h=2, p=16, n=16, g=1, chunk=64, **flags):
    return Problem(1 if "b" not in flags else flags.pop("b"), l, h, p, n, g, dtype, chunk_size=chunk, **flags)


FULL = dict(g=2, h=4, has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True, dt_softplus=True,
            has_dt_limit=True, has_initial_states=True, has_seq_idx=True, return_final_states=True)


def _grads(prob, seed=0, compiled=False):
    """(autossd's gradients, float64 reference gradients) of <dout, y> + <dfinal, final_states>."""
    t = make_inputs(prob, DEV, seed=seed)
    kw = call_kwargs(prob, t)
    leaves = {k: t[k].clone().requires_grad_() for k in NAMES if t.get(k) is not None}
    for k in ("D", "z", "dt_bias", "initial_states"):
        if k in leaves:
            kw[k] = leaves[k]
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    dout = torch.randn(t["x"].shape, generator=gen).to(t["x"].dtype).to(DEV)
    dfinal = (torch.randn(prob.batch, prob.nheads, prob.headdim, prob.dstate, generator=gen).to(DEV)
              if prob.return_final_states else None)

    def f(x, dt, A, B, C):
        out = autossd.mamba_chunk_scan_combined(x, dt, A, B, C, prob.chunk_size, **kw)
        y, final = out if prob.return_final_states else (out, None)
        loss = (y.float() * dout.float()).sum()
        return loss + (final * dfinal).sum() if final is not None else loss
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, backend="aot_eager", fullgraph=True)
    f(*(leaves[k] for k in ("x", "dt", "A", "B", "C"))).backward()
    ref = bw.reference(t["x"], t["dt"], t["A"], t["B"], t["C"], prob.chunk_size, t["D"], t["z"], t["dt_bias"],
                       t["initial_states"], t["seq_idx"], prob.dt_softplus, kw.get("dt_limit", (0.0, float("inf"))),
                       dout, dfinal)
    for k, v in leaves.items():
        assert v.grad is not None and v.grad.dtype == v.dtype, k   # each input's gradient in its dtype
    return {k: v.grad for k, v in leaves.items()}, ref


def _check(prob, seed=0, tol=None, **kw):
    got, ref = _grads(prob, seed, **kw)
    assert set(got) == set(ref)
    errs = {k: rel_err(got[k], ref[k]) for k in ref}
    for k, g in got.items():
        assert g is not None and g.shape == ref[k].shape, k
        assert float(ref[k].norm()) > 0, f"{k}: reference gradient is zero, the check would be empty"
    bound = tol or TOL[prob.dtype]
    bad = {k: e for k, e in errs.items() if not e < bound}
    assert not bad, f"{prob}: gradients off (bound {bound}): {errs}"
    return errs


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_every_input_with_every_feature(dtype):
    """ngroups 2, ragged length, D per (head, headdim), z, dt_bias + softplus + dt_limit (some
    values clamped), initial and final states, seq_idx."""
    prob = _prob(dtype, l=150, p=16, n=32, **FULL)
    errs = _check(prob, seed=1)
    print(dtype, {k: f"{e:.1e}" for k, e in errs.items()})


@pytest.mark.parametrize("dtype,state_dtype", [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp16")])
def test_chunk_states_kept_in_16_bits(monkeypatch, dtype, state_dtype):
    """state_dtype: the chunk states the backward recomputes (or the forward keeps) stored in 16
    bits, as the static databases' backward records for sm80 and gfx942 choose (the model counts
    their halved bytes): every gradient within the input dtype's bound, over several chunks with
    initial and final states."""
    cfg = bw.config_for
    monkeypatch.setattr(bw, "config_for", lambda p, a, d=None: cfg(p, a, d).replace(state_dtype=state_dtype))
    prob = _prob(dtype, l=200, h=4, p=16, n=32, g=2, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                 has_initial_states=True, return_final_states=True)
    errs = _check(prob, seed=2)
    print(dtype, state_dtype, {k: f"{e:.1e}" for k, e in errs.items()})


@pytest.mark.parametrize("chunk,l,states", [(128, 384, False), (64, 256, True)])
def test_bf16_dA_and_dt_bias_over_several_chunks(chunk, l, states):
    """A's and dt_bias's gradients add up every token's gradient wrt its dA_t, in which a chunk's
    state terms nearly cancel. Taken from the state leaving the chunk (its local part built from
    B·dt'·decay rounded to bf16) against the tokens' own fp32 terms, they kept that rounding in
    every token's sum: here A 1.0e-2 / 1.2e-2 and dt_bias 8e-3 / 6e-3 (up to 4e-2 at 2048
    tokens). With the entering state's part and the tokens' terms summed apart (the ddt stage):
    A 7e-5 / 8e-4, dt_bias 1.4e-5 / 2.7e-4. Several chunks at headdim 32, dstate 64 (the first
    case without an initial state, the second with initial and final states)."""
    flags = dict(has_initial_states=True, return_final_states=True) if states else {}
    prob = _prob("bf16", l=l, h=2, p=32, n=64, chunk=chunk, has_D=True, D_has_hdim=True, has_dt_bias=True,
                 dt_softplus=True, **flags)
    errs = _check(prob, seed=1)
    assert errs["A"] < 3e-3 and errs["dt_bias"] < 3e-3, errs


def test_the_clamp_holds_somewhere_and_passes_no_gradient_there():
    prob = _prob("fp32", l=64, has_dt_bias=True, dt_softplus=True, has_dt_limit=True)
    t = make_inputs(prob, DEV, seed=2)
    v = torch.nn.functional.softplus(t["dt"] + t["dt_bias"])
    held = (v < 0.001) | (v > 0.1)
    assert held.any() and (~held).any()
    got, ref = _grads(prob, seed=2)
    assert torch.all(got["dt"][held] == 0) and rel_err(got["dt"], ref["dt"]) < TOL["fp32"]


@pytest.mark.parametrize("chunk,l", [(128, 200), (64, 64)])
def test_chunk_sizes_and_D_per_head(chunk, l):
    prob = _prob("fp32", l=l, chunk=chunk, h=2, p=32, n=16, has_D=True, has_initial_states=True,
                 return_final_states=True)
    _check(prob, seed=3)


def test_single_token():
    prob = _prob("fp32", l=1, has_D=True, has_z=True, has_initial_states=True, return_final_states=True)
    _check(prob, seed=4)


def test_batch_and_groups_against_the_recurrence():
    """The chunked reference is itself checked against the recurrence elsewhere; here the
    gradients are checked against autograd through the recurrence directly, at batch 2."""
    prob = _prob("fp32", b=2, l=40, h=4, g=2, has_seq_idx=True, has_initial_states=True, return_final_states=True)
    t = make_inputs(prob, DEV, seed=5)
    leaves = {k: t[k].clone().requires_grad_() for k in ("x", "dt", "A", "B", "C", "initial_states")}
    y, final = autossd.mamba_chunk_scan_combined(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"],
                                                 64, initial_states=leaves["initial_states"], seq_idx=t["seq_idx"],
                                                 return_final_states=True)
    gen = torch.Generator(device="cpu").manual_seed(6)
    dout, dfinal = torch.randn(y.shape, generator=gen).to(DEV), torch.randn(final.shape, generator=gen).to(DEV)
    ((y * dout).sum() + (final * dfinal).sum()).backward()
    ref = bw.reference(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, initial_states=t["initial_states"],
                       seq_idx=t["seq_idx"], dout=dout, dfinal=dfinal, recurrent=True)
    errs = {k: rel_err(leaves[k].grad, ref[k]) for k in ref}
    assert all(e < TOL["fp32"] for e in errs.values()), errs


def test_no_gradient_crosses_a_sequence_reset():
    """With seq_idx, the loss on the second sequence's outputs gives the first sequence's tokens
    (and the initial state) exactly zero gradient."""
    prob = _prob("fp32", l=96, has_seq_idx=True, has_initial_states=True)
    t = make_inputs(prob, DEV, seed=7)
    seq = torch.zeros(1, 96, dtype=torch.int32, device=DEV)
    seq[:, 50:] = 1
    x = t["x"].clone().requires_grad_()
    init = t["initial_states"].clone().requires_grad_()
    y = autossd.mamba_chunk_scan_combined(x, t["dt"], t["A"], t["B"], t["C"], 64, initial_states=init, seq_idx=seq)
    y[:, 50:].sum().backward()
    assert torch.all(x.grad[:, :50] == 0) and torch.all(init.grad == 0)
    assert x.grad[:, 50:].abs().sum() > 0


def test_finite_differences_in_fp32():
    """Each input's fp32 gradient against the directional derivative of the loss along a random
    direction in that input, taken by central differences of the float64 recurrence (the
    definition, no autograd involved) at the same inputs.

    Differencing the fp32 forward instead puts its rounding (a few 1e-6 of the loss) divided by
    eps into the quotient: at eps 1e-3 that is the size of any useful bound, and whether the
    check passed depended on the CPU. In float64 at eps 1e-6 the quotient's rounding
    (~1e-16 / 1e-6 of the loss) and its truncation (~eps^2) stay below 1e-8 of the loss, so the
    bound is the gradients' own: a gradient g within grad_tolerance of the exact one gives, by
    Cauchy-Schwarz, |<g - exact, v>| <= tol / (1 - tol) * |g| |v| on any machine. A random
    direction sees a wrong gradient through <g, v>, of size |g| |v| / sqrt(numel): for these
    inputs 35 to 1400 times the bound."""
    from autossd.ops.ssd.naive import ssd_recurrent
    prob = _prob("fp32", l=40, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                 has_initial_states=True, return_final_states=True)
    t = make_inputs(prob, DEV, seed=8)
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
    gen = torch.Generator(device="cpu").manual_seed(9)
    v = {k: torch.randn(t[k].shape, generator=gen, dtype=torch.float64).to(DEV) for k in names}
    w = torch.randn(1, 40, 2, 16, generator=gen, dtype=torch.float64).to(DEV)

    leaves = {k: t[k].clone().requires_grad_() for k in names}
    y, final = autossd.mamba_chunk_scan_combined(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], 64, D=leaves["D"], z=leaves["z"],
        dt_bias=leaves["dt_bias"], initial_states=leaves["initial_states"], dt_softplus=True,
        return_final_states=True)
    ((y * w.float()).sum() + final.sum() * 0.1).backward()

    def loss64(args):
        y, final, _ = ssd_recurrent(args["x"], args["dt"], args["A"], args["B"], args["C"], D=args["D"],
                                    z=args["z"], dt_bias=args["dt_bias"], initial_states=args["initial_states"],
                                    dt_softplus=True)
        return float((y * w).sum() + final.sum() * 0.1)
    eps, tol = 1e-6, TOL["fp32"]
    base = {k: t[k].double() for k in names}
    slack = 1e-6 * max(1.0, abs(loss64(base)))           # the float64 quotient's own error, 100x over
    bad = {}
    for k in names:
        g = leaves[k].grad.double()
        analytic = float((g * v[k]).sum())
        numeric = (loss64({**base, k: base[k] + eps * v[k]}) - loss64({**base, k: base[k] - eps * v[k]})) / (2 * eps)
        bound = tol / (1 - tol) * float(g.norm() * v[k].norm()) + slack
        assert abs(numeric) > 10 * bound, f"{k}: the direction sees too little of the gradient to check it"
        if not abs(numeric - analytic) <= bound:
            bad[k] = (numeric, analytic, bound)
    assert not bad, bad


def test_deterministic_bitwise():
    """No atomics anywhere: every cross-program sum is written as partials and added in a fixed
    order, so two backward passes give the same bits."""
    prob = _prob("bf16", l=70, h=2, g=1, has_D=True, has_dt_bias=True, dt_softplus=True)
    a, _ = _grads(prob, seed=10)
    b, _ = _grads(prob, seed=10)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_torch_compile_fullgraph_forward_and_backward():
    prob = _prob("fp32", l=70, has_D=True, has_initial_states=True, return_final_states=True)
    _check(prob, seed=11, compiled=True)


def test_accumulates_into_grad_and_skips_inputs_not_requiring_grad():
    prob = _prob("fp32", l=64, has_D=True)
    t = make_inputs(prob, DEV, seed=12)
    x = t["x"].clone().requires_grad_()
    D = t["D"].clone()                                          # no grad
    for _ in range(2):
        autossd.mamba_chunk_scan_combined(x, t["dt"], t["A"], t["B"], t["C"], 64, D=D).sum().backward()
    once = x.grad.clone() / 2
    x.grad = None
    autossd.mamba_chunk_scan_combined(x, t["dt"], t["A"], t["B"], t["C"], 64, D=D).sum().backward()
    assert torch.allclose(x.grad, once, rtol=1e-6, atol=1e-7) and D.grad is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a GPU")
def test_a_training_step_captures_in_a_cuda_graph():
    """Forward and backward captured in one CUDA graph (what a captured training step does): a
    replay's gradients, accumulated into the inputs' static .grad, are the eager step's."""
    prob = _prob("bf16", l=300, h=4, p=32, n=32, g=2, chunk=64, has_D=True, has_z=True, has_dt_bias=True,
                 dt_softplus=True)
    t = make_inputs(prob, DEV, seed=14)
    kw = call_kwargs(prob, t)
    leaves = {k: t[k].clone().requires_grad_() for k in ("x", "dt", "B", "C", "z", "dt_bias")}
    kw.update(z=leaves["z"], dt_bias=leaves["dt_bias"])
    dout = torch.randn(t["x"].shape, generator=torch.Generator().manual_seed(15)).to(t["x"].dtype).to(DEV)

    def step():
        y = autossd.mamba_chunk_scan_combined(leaves["x"], leaves["dt"], t["A"], leaves["B"], leaves["C"],
                                              prob.chunk_size, **kw)
        y.backward(dout)
    step()   # eager: compiles, and .grad allocated
    eager = {k: v.grad.clone() for k, v in leaves.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up on a side stream, as capture asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for v in leaves.values():
        v.grad.zero_()
    with torch.cuda.graph(graph):
        step()
    for v in leaves.values():
        v.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for k, v in leaves.items():
        # the capture's forward may run the graph pick of the lookup (another config), so the
        # bits may differ; the values must not
        assert rel_err(v.grad, eager[k]) < 1e-2, k


def test_saved_states_give_the_recomputed_gradients(monkeypatch):
    """save_states = 1: the forward keeps its chunk states, dt' and dA; the backward skips its
    recompute stages and gives the recompute path's gradients."""
    prob = _prob("fp32", l=150, h=2, has_initial_states=True, return_final_states=True, has_dt_bias=True)
    recomputed, ref = _grads(prob, seed=13)
    cfg = bw.config_for
    monkeypatch.setattr(bw, "config_for", lambda p, a, d=None: cfg(p, a, d).replace(save_states=1))
    launched = []
    real = bw.run
    monkeypatch.setattr(bw, "run", lambda lns, m: (launched.extend(ln.stage for ln in lns), real(lns, m)))
    saved, _ = _grads(prob, seed=13)
    assert "chunk_state" not in launched and "state_passing" not in launched and "dx" in launched
    for k in ref:
        assert rel_err(saved[k], ref[k]) < TOL["fp32"], k
        assert torch.allclose(saved[k], recomputed[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_kept_ungated_output_gives_the_recomputed_gradients(dtype, monkeypatch):
    """With z requiring grad the forward keeps y' (the ungated output) and the backward runs no
    forward; with autossd.grad.KEEP_UNGATED_OUTPUT off it runs the forward again. Both give the
    reference's gradients, and the kept path's output is the fused gate's within a rounding of
    the output dtype."""
    from autossd import grad, runtime
    prob = _prob(dtype, l=100, h=4, p=16, n=32, g=2, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                 has_initial_states=True, return_final_states=True)
    forwards = []
    real = runtime._forward

    def counting(*a, **k):
        forwards.append(a[7] is not None)   # whether this forward applied z itself
        return real(*a, **k)
    monkeypatch.setattr(runtime, "_forward", counting)
    kept, ref = _grads(prob, seed=21)
    assert forwards == [False], forwards   # one forward, ungated; none in the backward
    monkeypatch.setattr(grad, "KEEP_UNGATED_OUTPUT", False)
    forwards.clear()
    recomputed, _ = _grads(prob, seed=21)
    assert forwards == [True, False], forwards   # the gated forward, then the backward's ungated one
    for k in ref:
        assert rel_err(kept[k], ref[k]) < TOL[dtype], k
        assert rel_err(kept[k], recomputed[k]) < TOL[dtype] / 10, k
    t = make_inputs(prob, DEV, seed=22)
    kw = call_kwargs(prob, t)
    fused = autossd.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, **kw)[0]
    kw["z"] = t["z"].clone().requires_grad_()
    gated = autossd.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, **kw)[0]
    assert gated.grad_fn is not None
    ulp = {"fp32": 1e-6, "bf16": 8e-3}[dtype]
    assert rel_err(gated.detach(), fused) < ulp


def test_a_kernels_own_call_with_z_runs_its_config_and_recomputes_the_ungated_output(monkeypatch):
    """autossd.get_kernel(problem)(...) runs that kernel's config: its forward applies z itself
    (no ungated forward by lookup), the backward runs the forward again for z's gradient, and the
    gradients are the reference's."""
    from autossd import runtime
    prob = _prob("fp32", l=100, h=2, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    t = make_inputs(prob, DEV, seed=25)
    leaves = {k: t[k].clone().requires_grad_() for k in ("x", "z")}
    kern = autossd.get_kernel(prob)
    forwards = []
    real = runtime._forward
    monkeypatch.setattr(runtime, "_forward", lambda *a, **k: (forwards.append(a[7] is not None), real(*a, **k))[1])
    kw = call_kwargs(prob, t)
    kw["z"] = leaves["z"]
    y = kern(leaves["x"], t["dt"], t["A"], t["B"], t["C"], **kw)
    assert forwards == []   # the kernel's own launch, gated
    dout = torch.randn_like(y)
    y.backward(dout)
    assert forwards == [False]   # the backward's ungated forward
    ref = bw.reference(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, t["D"], t["z"], t["dt_bias"], None, None, True,
                       (0.0, float("inf")), dout, None)
    for k, v in leaves.items():
        assert rel_err(v.grad, ref[k]) < TOL["fp32"], k


def test_a_second_backward_through_a_retained_graph_recomputes_the_ungated_output():
    """The kept ungated output goes to the first backward (which frees it); a second backward
    through the same graph (retain_graph=True) runs the forward again and gives the same
    gradients."""
    prob = _prob("fp32", l=100, h=2, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    t = make_inputs(prob, DEV, seed=24)
    z = t["z"].clone().requires_grad_()
    x = t["x"].clone().requires_grad_()
    kw = call_kwargs(prob, t)
    kw["z"] = z
    y = autossd.mamba_chunk_scan_combined(x, t["dt"], t["A"], t["B"], t["C"], 64, **kw)
    dout = torch.randn_like(y)
    y.backward(dout, retain_graph=True)
    first = (x.grad.clone(), z.grad.clone())
    x.grad, z.grad = None, None
    y.backward(dout)
    assert torch.allclose(x.grad, first[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(z.grad, first[1], rtol=1e-5, atol=1e-7)


def test_a_config_keeping_states_whose_forward_kept_none_recomputes_them(monkeypatch):
    """save_states = 1 where the forward could not keep its states (its config keeps them
    elsewhere, or the tuner runs the backward alone): the backward renders the recomputing
    module rather than launching kernels the saving one lacks, and gives the same gradients."""
    prob = _prob("fp32", l=150, h=2, has_initial_states=True, return_final_states=True, has_dt_bias=True)
    recomputed, ref = _grads(prob, seed=13)
    cfg = bw.config_for
    monkeypatch.setattr(bw, "config_for", lambda p, a, d=None: cfg(p, a, d).replace(save_states=1))
    from autossd import grad
    monkeypatch.setattr(grad, "forward_saving", lambda t, call, prob=None: None)
    got, _ = _grads(prob, seed=13)
    for k in ref:
        assert torch.allclose(got[k], recomputed[k], rtol=1e-5, atol=1e-7), k
    space = build_space("sm90", prob, op="ssd_bwd")
    assert space.pinned.get("save_states") == 0   # a tune never offers keeping them


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_the_reference_taken_a_slice_of_heads_at_a_time_is_the_whole_one(heads):
    """reference(max_bytes=...) over slices of 1 or 2 heads (inside a group of 2) or of whole
    groups (4 heads: two groups) gives the gradients of every input the whole reference gives,
    B's and C's summed over the group's heads."""
    prob = _prob("fp32", l=70, h=8, p=8, n=16, g=4, has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True,
                 dt_softplus=True, has_initial_states=True, return_final_states=True)
    t = make_inputs(prob, DEV, seed=23)
    dout, dfinal = torch.randn_like(t["x"]), torch.randn(1, 8, 8, 16, device=DEV)
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], 64, t["D"], t["z"], t["dt_bias"], t["initial_states"], None,
            True, (0.0, float("inf")), dout, dfinal)
    whole = bw.reference(*args)
    per_head = bw.reference_bytes(1, 70, 1, 8, 16, 64)
    sliced = bw.reference(*args, max_bytes=per_head * heads)
    assert set(sliced) == set(whole)
    for k in whole:
        assert sliced[k].shape == whole[k].shape, k
        assert torch.allclose(sliced[k], whole[k], rtol=1e-10, atol=1e-12), k


@pytest.mark.parametrize("cb", ["inline"])
def test_the_inline_mode(cb, monkeypatch):
    """cb = "inline": the dx kernel recomputes C·Bᵀ (no bmm launch)."""
    cfg = bw.config_for
    monkeypatch.setattr(bw, "config_for", lambda p, a, d=None: cfg(p, a, d).replace(cb=cb, group_split=2))
    prob = _prob("fp32", l=100, h=4, g=1, has_seq_idx=True, return_final_states=True)
    _check(prob, seed=14)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_staged_cb_in_the_inputs_type(dtype, monkeypatch):
    """cb = "stage" with cb_dtype = "input": the bmm stage stores C·Bᵀ rounded to the inputs'
    16-bit type and dx reads that; every gradient within the dtype's bound (a ragged chunk,
    seq_idx, z)."""
    cfg = bw.config_for
    seen = []

    def pick(p, a, d=None):
        c = cfg(p, a, d).replace(cb="stage", cb_dtype="input")
        seen.append(c)
        return c
    monkeypatch.setattr(bw, "config_for", pick)
    prob = _prob(dtype, l=100, h=4, p=16, n=32, g=2, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                 has_seq_idx=True, return_final_states=True)
    errs = _check(prob, seed=16)
    assert seen and all(c.cb_dtype == "input" for c in seen)
    print(dtype, {k: f"{e:.1e}" for k, e in errs.items()})


# variants of the dB / dC stages, each with the knobs it needs: db_fold = 1, dB's row weights
# folded into x before its product (rounded to x's type); dc_cs_dot = 1, dC's part of the dA
# gradient from the entering state as dy·(C Sᵀ) with C loaded once, over two dstate tiles (2: and
# dy's rows scaled by the decay before the state product)
_DBC_VARIANTS = {"db_fold": (dict(db_fold=1), 33), "dc_cs_dot": (dict(dc_cs_dot=1, dbc_block_n=16), 35),
                 "dc_cs_dot_folded": (dict(dc_cs_dot=2, dbc_block_n=16), 36)}


@pytest.mark.parametrize("variant", _DBC_VARIANTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_db_and_dc_variants_keep_every_gradient(dtype, variant, monkeypatch):
    """Every gradient within the dtype's bound with each dB / dC variant forced, over two chunks
    (the second ragged, entering with the first's state) with initial states and seq_idx."""
    knobs, seed = _DBC_VARIANTS[variant]
    cfg = bw.config_for
    seen = []

    def pick(p, a, d=None):
        c = cfg(p, a, d).replace(**knobs)
        seen.append(c)
        return c
    monkeypatch.setattr(bw, "config_for", pick)
    prob = _prob(dtype, l=100, h=4, p=16, n=32, g=2, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                 has_seq_idx=True, has_initial_states=True, return_final_states=True)
    _check(prob, seed=seed)
    assert seen and all(c[k] == v for c in seen for k, v in knobs.items())


@pytest.mark.parametrize("dtype,heads,split", [("fp32", 4, 1), ("bf16", 2, 2), ("fp16", 4, 2)])
def test_the_dcb_stage_a_batch_of_heads_at_a_time(dtype, heads, split, monkeypatch):
    """dcb_heads > 1: the dCB stage takes its heads a batch at a time, the last batch cut short
    (six heads in one group: 4 + 2, or 3 per split: 2 + 1, 4 with one left empty); every gradient
    within the dtype's bound at a ragged chunk with seq_idx, z and dt_limit."""
    cfg = bw.config_for
    seen = []

    def pick(p, a, d=None):
        c = cfg(p, a, d).replace(dcb_heads=heads, group_split=split, dcb_block_m=32, dcb_block_k=16)
        assert not violations(c, a, p), violations(c, a, p)
        seen.append(c)
        return c
    monkeypatch.setattr(bw, "config_for", pick)
    prob = _prob(dtype, l=100, h=6, p=16, n=16, g=1, has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                 has_dt_limit=True, has_seq_idx=True, has_initial_states=True, return_final_states=True)
    _check(prob, seed=31)
    assert seen


def test_varlen_states_are_returned_without_gradient():
    prob = _prob("fp32", l=64, has_seq_idx=True, return_varlen_states=True)
    t = make_inputs(prob, DEV, seed=15)
    x = t["x"].clone().requires_grad_()
    y, varlen = autossd.mamba_chunk_scan_combined(x, t["dt"], t["A"], t["B"], t["C"], 64, seq_idx=t["seq_idx"],
                                                  cu_seqlens=t["cu_seqlens"], return_varlen_states=True)
    assert not varlen.requires_grad
    y.sum().backward()
    assert x.grad is not None


# --- the op's declaration: knobs, rendering, constraints -------------------------------------
def test_every_knob_changes_the_compiled_code():
    base = BwdConfig()
    h0 = render.kernel_hash(base, "cuda")
    for knob in KNOBS:
        other = next(v for v in knob.values if v != base[knob.name])
        cfg = base.replace(**{knob.name: other})
        assert cfg[knob.name] == other, knob.name
        assert render.kernel_hash(cfg, "cuda") != h0, f"{knob.name}={other} renders the same code"


def test_declaration_and_defaults():
    op = get_op("ssd_bwd")
    assert op.config_type is BwdConfig and set(op.sequences) == {"stage", "inline"}
    prob = Problem(8, 2048, 80, 64, 128, 1, "bf16", chunk_size=256)
    cfg = default_config("sm90", prob)
    assert cfg.chunk_size == 256 and not violations(cfg, "sm90", prob)
    assert violations(cfg.replace(dx_block_n=128), "sm90", prob)          # past headdim 64
    assert violations(BwdConfig(chunk_size=64, dx_block_m=128), "sm90")
    costs = op.fn("cost_model")(prob, cfg)
    assert {c.stage for c in costs} >= {"dx", "db", "dc", "ddt", "state_passing_rev"}
    src = render.render(cfg.replace(cb="inline"), "cuda")
    assert "def ssd_bwd_bmm" not in src and "def ssd_bwd_dx" in src
    assert "def ssd_bwd_chunk_state" not in render.render(cfg.replace(save_states=1), "cuda")
    # a tune offers no tile past the problem's padded headdim (64) and dstate (128)
    dims = {d.name: d.values for d in build_space("sm90", prob, op="ssd_bwd").dims}
    assert max(dims["dx_block_n"]) == 64 and max(dims["state_block_m"]) == 64 and max(dims["dbc_block_n"]) == 128


def test_gluon_dx_is_the_sm90_default_where_the_problem_fits():
    """dx_gluon = 1 (the forward's chunk-walking scan run in reverse time) is sm90's default at
    16-bit inputs with headdim in 64s and dstate 64 or 128, with the staged C·Bᵀ in 16 bits it
    reads; elsewhere (fp32, dstate 256, seq_idx, another arch) the default keeps the tl dx, and a
    config asking for it without its C·Bᵀ is refused with the reason."""
    prob = Problem(8, 2048, 80, 64, 128, 1, "bf16", chunk_size=256, has_D=True)
    cfg = default_config("sm90", prob)
    assert (cfg.dx_gluon, cfg.cb, cfg.cb_dtype) == (1, "stage", "input") and not violations(cfg, "sm90", prob)
    for other in (prob.replace(dtype="fp32"), prob.replace(dstate=256), prob.replace(has_seq_idx=True),
                  prob.replace(headdim=32)):
        c = default_config("sm90", other)
        assert c.dx_gluon == 0 and not violations(c, "sm90", other), other
    for arch in ("sm80", "gfx942"):
        assert default_config(arch, prob).dx_gluon == 0
        assert violations(cfg, arch, prob)                # not offered there (no TMA, no wgmma)
    why = " ".join(violations(cfg.replace(cb="inline"), "sm90", prob))
    assert "dx_gluon=1" in why and "cb=stage" in why
    assert violations(cfg.replace(dx_block_k=32), "sm90", prob)   # one config per Gluon dx
    assert default_config("sm90", prob, cb="inline").dx_gluon == 0


@pytest.mark.parametrize("features", [{}, {"seqlen": 1000, "batch": 2, "has_z": True, "D_has_hdim": True,
                                           "has_initial_states": True, "return_final_states": True, "ngroups": 2},
                                      {"dstate": 64, "headdim": 128, "dtype": "fp16"}, {"chunk_size": 128},
                                      {"chunk_size": 64, "has_D": False}])
def test_gluon_dx_cross_compiles_in_two_ctas_per_sm_without_spills(features):
    """The Gluon dx for sm90 (its CI coverage; scripts/bench_bwd.py --check runs it on a GPU, with
    profile_kernels.py --set for configs other than the default): one program per (headdim tile,
    head, chunk), at most 91 KB of shared memory and no spills, so two CTAs per SM (three at
    64-token chunks), and code other than the tl dx's."""
    from autossd.compile import compile_config
    from autossd.render import _interpret
    prob = Problem(1, 4096, 8, 64, 128, 1, "bf16", chunk_size=256, has_D=True).replace(**features)
    cfg = default_config("sm90", prob)
    with _interpret(False):
        (dx,) = [ln for ln in get_op("ssd_bwd").fn("meta_launches")(prob, cfg, "cuda") if ln.stage == "dx"]
    nc = -(-prob.seqlen // prob.chunk_size)
    assert dx.kernel == "ssd_bwd_dx_gluon" and dx.grid == ((prob.headdim // 64) * prob.nheads, nc, prob.batch)
    rep = compile_config(cfg, "sm90", prob, stages=("dx",))
    assert rep.ok, rep.why()
    (st,) = rep.stages
    assert st.spill_bytes == 0 and st.shared_bytes <= 91 * 1024 + 1024
    assert st.occupancy >= (3 if prob.chunk_size == 64 else 2)
    tl = compile_config(cfg.replace(dx_gluon=0), "sm90", prob, stages=("dx",))
    assert tl.ok and tl.stages[0].artifact_sha != st.artifact_sha


@pytest.mark.parametrize("features", [{}, {"chunk_size": 128}, {"chunk_size": 64},
                                      {"dstate": 64, "headdim": 128, "dtype": "fp16"},
                                      {"nheads": 16, "ngroups": 2}])
def test_gluon_dcb_cross_compiles_on_causal_tile_pairs_without_spills(features):
    """The Gluon dCB for sm90 (dcb_gluon = 1; its CI coverage, tests/test_runtime_gpu.py runs it):
    one program per causal pair of 64-token tiles, heads split and group (10 pairs at 256-token
    chunks, 3 at 128, 1 at 64), 64 KB of shared memory at headdim 64 (80 KB at 128) and no
    spills, two CTAs per SM, code other than the tl dCB's; the tl stage's tiles, warps, stages or
    heads a step at other values, or inputs in fp32, are refused naming dcb_gluon=1."""
    from autossd.compile import compile_config
    from autossd.ops.ssd.bwd_knobs import DCB_GLUON_FIXED
    from autossd.render import _interpret
    prob = Problem(1, 4096, 8, 64, 128, 1, "bf16", chunk_size=256, has_D=True).replace(**features)
    cfg = default_config("sm90", prob).replace(dcb_gluon=1, **DCB_GLUON_FIXED)
    assert not violations(cfg, "sm90", prob)
    with _interpret(False):
        (ln,) = [ln for ln in get_op("ssd_bwd").fn("meta_launches")(prob, cfg, "cuda") if ln.stage == "dcb"]
    nc, tiles = -(-prob.seqlen // prob.chunk_size), prob.chunk_size // 64
    assert ln.kernel == "ssd_bwd_dcb_gluon"
    assert ln.grid == (tiles * (tiles + 1) // 2 * cfg.group_split * prob.ngroups, nc, prob.batch)
    rep = compile_config(cfg, "sm90", prob, stages=("dcb",))
    assert rep.ok, rep.why()
    (st,) = rep.stages
    assert st.spill_bytes == 0 and st.shared_bytes <= (80 if prob.headdim == 128 else 64) * 1024 + 1024
    assert st.occupancy >= 2
    tl = compile_config(cfg.replace(dcb_gluon=0), "sm90", prob, stages=("dcb",))
    assert tl.ok and tl.stages[0].artifact_sha != st.artifact_sha
    for bad in (dict(dcb_block_m=32), dict(dcb_heads=4), dict(dcb_stages=3)):
        assert any("dcb_gluon=1" in w for w in violations(cfg.replace(**bad), "sm90", prob)), bad
    assert any("dcb_gluon=1" in w for w in violations(cfg, "sm90", prob.replace(dtype="fp32")))
    assert any("headdim <= 384" in w for w in violations(cfg, "sm90", prob.replace(headdim=448)))


@pytest.mark.parametrize("heads,flags", [(1, dict(l=150)), (4, dict(l=150)),
                                         (4, dict(l=170, has_seq_idx=True)), (1, dict(l=130, b=2))])
def test_the_dcb_decay_split_off_the_diagonal_gives_the_same_gradients(heads, flags, monkeypatch):
    """dcb_decay = 1 (off the diagonal, dCB's decay as a row factor times a column factor): every
    gradient within its bound against float64 and within 1e-5 of dcb_decay = 0's, at 64-token
    chunks in 16 x 16 tiles (six of the ten causal tiles off the diagonal), one head a step or
    four, a ragged last chunk, sequences packed by seq_idx (their boundary inside off-diagonal
    tiles), two batch rows."""
    prob = _prob("fp32", h=4, p=16, n=16, chunk=64, has_D=True, has_dt_bias=True, dt_softplus=True, **flags)
    real = bw.config_for
    got, seen = {}, []
    for decay in (0, 1):
        def pick(p, a, d=None, decay=decay):
            c = real(p, a, d).replace(dcb_block_m=16, dcb_block_k=16, dcb_heads=heads, dcb_decay=decay,
                                      group_split=1)
            seen.append(c)
            return c
        monkeypatch.setattr(bw, "config_for", pick)
        bw.clear_launch_cache()
        got[decay] = _grads(prob, seed=23)
        assert seen and seen[-1].dcb_decay == decay
    bw.clear_launch_cache()
    ref = got[0][1]
    for k in ref:
        assert rel_err(got[1][0][k], ref[k]) < TOL["fp32"], k
        assert rel_err(got[1][0][k], got[0][0][k]) < 1e-5, (k, rel_err(got[1][0][k], got[0][0][k]))
    assert render.kernel_hash(pick(prob, "sm90").replace(dcb_decay=1), "cuda") != \
        render.kernel_hash(pick(prob, "sm90").replace(dcb_decay=0), "cuda")


def test_the_gluon_dcb_falls_back_to_the_tl_stage_where_the_call_cannot_take_it(monkeypatch):
    """dcb_gluon = 1 where a call cannot run it (here: no GPU, or a GPU with seq_idx): the backward
    runs the tl dCB of the same config, every gradient within the dtype's bound; the reason is
    named."""
    from autossd.ops.ssd import bwd_gluon
    from autossd.ops.ssd.bwd_knobs import DCB_GLUON_FIXED

    def pick(p, a, d=None):
        return default_config("sm90", p.replace(has_seq_idx=False)).replace(dcb_gluon=1, **DCB_GLUON_FIXED)
    monkeypatch.setattr(bw, "config_for", pick)
    prob = _prob("bf16", l=200, h=2, p=64, n=64, chunk=64, has_D=True, has_seq_idx=DEV != "cpu")
    cfg = pick(prob, "sm90")
    t = make_inputs(prob, DEV, seed=5)
    buf = bw.allocate(prob, cfg, t, torch.randn_like(t["x"]), None, set(bw.GRAD_NAMES), None)
    assert bwd_gluon.dcb_gluon_gaps(prob, cfg, t, buf, "cuda")
    assert all(ln.kernel != "ssd_bwd_dcb_gluon" for ln in bw.plan(prob, cfg, t, buf, "cuda"))
    _check(prob, seed=19)


# the H200 records' knobs that set these stages' registers: G in one 16-bit operand (dx: 75 KB of
# shared memory where two operands take 91 KB), dB's folded row weights on 64 x 128 tiles
_RECORD_KNOBS = dict(dx_g_split=1, db_fold=1, dbc_block_m=64, dbc_block_n=128, dbc_block_k=64, dbc_stages=3)


@pytest.mark.parametrize("knob,stage,kernel,extra", [
    ("dx_maxnreg", "dx", "ssd_bwd_dx_gluon", {}),
    ("rev_walk_maxnreg", "state_passing_rev", "ssd_bwd_state_walk_rev", {}),
    ("db_maxnreg", "db", "ssd_bwd_db", {}),
    # dC's shared memory fits a third CTA only at two stages and with its state product in place
    ("dc_maxnreg", "dc", "ssd_bwd_dc", dict(dc_cs_dot=2, dbc_stages=2))])
def test_register_caps_reach_the_kernels_and_buy_a_third_cta(knob, stage, kernel, extra):
    """The register caps of the Gluon dx, the reverse Gluon walk, dB and dC (the H200's training
    records run dx at 168: three CTAs per SM where ptxas's choice leaves two): the cap reaches the
    stage's launch and its compiled kernel, which differs from the uncapped one, stays within the
    cap and fits a third CTA."""
    from autossd.compile import compile_config
    from autossd.render import _interpret
    prob = Problem(4, 2048, 8, 64, 128, 1, "bf16", chunk_size=256, has_D=True)
    cfg = default_config("sm90", prob).replace(**{**_RECORD_KNOBS, **extra})
    assert cfg.dx_gluon == 1 and cfg.rev_walk == 1 and not violations(cfg.replace(**{knob: 168}), "sm90", prob)
    with _interpret(False):
        (ln,) = [ln for ln in get_op("ssd_bwd").fn("meta_launches")(prob, cfg.replace(**{knob: 168}), "cuda")
                 if ln.stage == stage]
    assert ln.kernel == kernel and ln.options.get("maxnreg") == 168
    free = compile_config(cfg, "sm90", prob, stages=(stage,))
    capped = compile_config(cfg.replace(**{knob: 168}), "sm90", prob, stages=(stage,))
    assert free.ok and capped.ok, (free.why(), capped.why())
    (f,), (c,) = free.stages, capped.stages
    assert f.registers > 168 >= c.registers and c.occupancy == 3 and f.occupancy == 2, (f, c)
    assert c.artifact_sha != f.artifact_sha


def test_the_reverse_walks_cap_needs_the_reverse_walk():
    prob = Problem(4, 2048, 8, 64, 128, 1, "bf16", chunk_size=256, has_D=True)
    cfg = default_config("sm90", prob).replace(rev_walk=0, rev_walk_maxnreg=168)
    assert any("rev_walk_maxnreg=168" in w and "rev_walk=1" in w for w in violations(cfg, "sm90", prob))


@pytest.mark.parametrize("features", [{}, {"seqlen": 1000, "batch": 2, "has_initial_states": True,
                                           "return_final_states": True, "ngroups": 2},
                                      {"dstate": 64, "headdim": 128, "dtype": "fp16", "state_dtype": "fp16"},
                                      {"chunk_size": 64, "state_dtype": "fp32"}])
def test_reverse_walk_replaces_two_stages_and_cross_compiles_without_spills(features):
    """rev_walk = 1 (sm90's default where the problem fits): one Gluon launch in place of the
    dstates and reverse state-passing stages, one program per (headdim tile, dstate tile of up to
    128, head, batch), a slot per row of each program's tile for the last-dA partials; it
    compiles for sm90 in two CTAs per SM (three at dstate 64) without spills at states in the
    inputs' type (fp32 states spill a few bytes: the state tile it reads for those partials)."""
    from autossd.compile import compile_config
    from autossd.ops.ssd.bwd_gluon import rev_walk_slots
    from autossd.render import _interpret
    features = dict(features)
    sd = features.pop("state_dtype", "bf16")
    prob = Problem(1, 4096, 8, 64, 128, 1, "bf16", chunk_size=256, has_D=True).replace(**features)
    cfg = default_config("sm90", prob).replace(state_dtype=sd)
    assert cfg.rev_walk == 1
    with _interpret(False):
        launches = get_op("ssd_bwd").fn("meta_launches")(prob, cfg, "cuda")
    stages = [ln.stage for ln in launches]
    assert "dstates" not in stages and stages.count("state_passing_rev") == 1
    (walk,) = [ln for ln in launches if ln.stage == "state_passing_rev"]
    n_tiles = (prob.headdim // 64) * -(-prob.dstate // 128)
    assert walk.kernel == "ssd_bwd_state_walk_rev" and walk.grid == (n_tiles, prob.nheads, prob.batch)
    assert rev_walk_slots(prob, cfg) == 64 * n_tiles
    # the chunks' state gradients in the inputs' 16-bit type where every reader rounds them to
    # that (dx_g_split = 1), fp32 where dx carries them in two 16-bit operands
    for g_split, g_type in ((1, {"bf16": torch.bfloat16, "fp16": torch.float16}[prob.dtype]), (2, torch.float32)):
        with _interpret(False):
            ls = get_op("ssd_bwd").fn("meta_launches")(prob, cfg.replace(dx_g_split=g_split), "cuda")
        assert next(ln for ln in ls if ln.stage == "state_passing_rev").args["dst_desc"].base.dtype == g_type
    rep = compile_config(cfg, "sm90", prob, stages=("state_passing_rev",))
    assert rep.ok, rep.why()
    (st,) = rep.stages
    assert st.occupancy >= (3 if prob.dstate == 64 else 2)
    assert st.spill_bytes == 0 if sd != "fp32" else st.spill_bytes <= 16
    for other in (prob.replace(dtype="fp32"), prob.replace(has_seq_idx=True), prob.replace(dstate=256)):
        assert default_config("sm90", other).rev_walk == 0


def test_the_recomputing_walk_on_64_wide_dstate_tiles_doubles_a_batch_of_ones_programs():
    """recompute_walk = 3 at 2.7b 1 x 65536: the forward's walk in the backward on 64-wide dstate
    tiles with its 64-token ring, 160 programs where recompute_walk = 2 runs 80, the kernel
    compiled to refuse another tile; cross-compiled for sm90, four CTAs an SM without spills."""
    from autossd.compile import compile_config
    from autossd.render import _interpret
    prob = Problem(1, 65536, 80, 64, 128, 1, "bf16", chunk_size=256, has_D=True, has_dt_bias=True, dt_softplus=True)
    base = default_config("sm90", prob).replace(save_states=0, state_dtype="bf16")
    grids = {}
    for mode in (2, 3):
        cfg = base.replace(recompute_walk=mode)
        assert not violations(cfg, "sm90", prob), violations(cfg, "sm90", prob)
        with _interpret(False):
            launches = get_op("ssd_bwd").fn("meta_launches")(prob, cfg, "cuda")
        (walk,) = [ln for ln in launches if ln.kernel == "ssd_state_walk"]
        grids[mode] = (walk.grid, walk.constexprs["BN"])
    assert grids == {2: ((1, 80, 1), 128), 3: ((2, 80, 1), 64)}
    rep = compile_config(base.replace(recompute_walk=3), "sm90", prob, stages=("state_walk",))
    assert rep.ok, rep.why()
    (st,) = rep.stages
    assert st.spill_bytes == 0 and st.occupancy >= 4


def test_the_reverse_walk_on_64_wide_dstate_tiles_runs_twice_the_programs_in_three_ctas():
    """rev_walk = 2 at 2.7b's dstate 128: 64-wide dstate tiles, twice the programs and the
    last-dA slots of rev_walk = 1, the kernel compiled to refuse another tile; cross-compiled for
    sm90 at 4 x 16384 bf16, three CTAs an SM without spills (rev_walk = 1: two)."""
    from autossd.compile import compile_config
    from autossd.ops.ssd.bwd_gluon import rev_walk_slots
    from autossd.render import _interpret
    prob = Problem(4, 16384, 80, 64, 128, 1, "bf16", chunk_size=256, has_D=True, has_dt_bias=True, dt_softplus=True)
    one = default_config("sm90", prob)
    two = one.replace(rev_walk=2)
    assert one.rev_walk == 1 and not violations(two, "sm90", prob)
    walks = {}
    for cfg in (one, two):
        with _interpret(False):
            launches = get_op("ssd_bwd").fn("meta_launches")(prob, cfg, "cuda")
        (walks[cfg.rev_walk],) = [ln for ln in launches if ln.stage == "state_passing_rev"]
    assert walks[1].grid == (1, 80, 4) and walks[2].grid == (2, 80, 4)
    assert (walks[1].constexprs["BN"], walks[2].constexprs["BN"]) == (128, 64)
    assert rev_walk_slots(prob, two) == 2 * rev_walk_slots(prob, one) == 128
    occ = {}
    for cfg in (one, two):
        rep = compile_config(cfg, "sm90", prob, stages=("state_passing_rev",))
        assert rep.ok, rep.why()
        (st,) = rep.stages
        assert st.spill_bytes == 0
        occ[cfg.rev_walk] = st.occupancy
    assert (occ[1], occ[2]) == (2, 3)


def test_the_forwards_walk_recomputes_the_states_in_place_of_two_stages(monkeypatch):
    """recompute_walk = 1: on sm90 the forward's own Gluon walk (the same kernel) recomputes the
    chunk states in place of the chunk-state and state-passing stages, storing chunk 0's entering
    state too and no final state; it cross-compiles without spills. What it needs is named; a
    call it cannot take (here: the interpreter) runs the tl stages, every gradient in bounds."""
    from autossd.compile import compile_config
    from autossd.render import _interpret
    prob = Problem(2, 1000, 8, 64, 128, 1, "bf16", chunk_size=256, has_D=True, has_initial_states=True)
    cfg = default_config("sm90", prob).replace(recompute_walk=1)
    assert not violations(cfg, "sm90", prob)
    with _interpret(False):
        launches = get_op("ssd_bwd").fn("meta_launches")(prob, cfg, "cuda")
    stages = [ln.stage for ln in launches]
    assert "chunk_state" not in stages and "state_passing" not in stages
    (walk,) = [ln for ln in launches if ln.kernel == "ssd_state_walk"]
    assert walk.constexprs["FIRST_STORED"] == 0 and not walk.constexprs["HAS_FINAL"]
    assert walk.constexprs["HAS_INIT"] and walk.args["final_ptr"] is None
    assert walk.grid == (1, prob.nheads, prob.batch)
    rep = compile_config(cfg, "sm90", prob, stages=("state_walk",))
    assert rep.ok and [st.spill_bytes for st in rep.stages] == [0], rep.why()
    assert any("needs states in the input dtype" in w
               for w in violations(cfg.replace(state_dtype="fp32"), "sm90", prob))
    assert any("save_states=0" in w for w in violations(cfg.replace(save_states=1), "sm90", prob))
    assert any("seq_idx" in w for w in violations(cfg, "sm90", prob.replace(has_seq_idx=True)))
    base = bw.config_for
    monkeypatch.setattr(bw, "config_for", lambda p, a, d=None: base(p, a, d).replace(recompute_walk=1))
    _check(_prob("bf16", l=150, h=2, p=64, n=64, has_D=True, has_initial_states=True), seed=35)


def test_the_recompute_walk_with_the_64_token_ring():
    """recompute_walk = 2: the same walk with its 64-token ring; it cross-compiles for sm90 without
    spills in less shared memory than the 128-token ring, three CTAs per SM where that one fits two,
    and is another kernel."""
    from autossd.compile import compile_config
    prob = Problem(2, 1000, 8, 64, 128, 1, "bf16", chunk_size=256, has_D=True, has_initial_states=True)
    cfg = default_config("sm90", prob).replace(recompute_walk=1)
    assert not violations(cfg.replace(recompute_walk=2), "sm90", prob)
    (wide,), (narrow,) = (compile_config(c, "sm90", prob, stages=("state_walk",)).stages
                          for c in (cfg, cfg.replace(recompute_walk=2)))
    assert narrow.spill_bytes == 0 and narrow.shared_bytes < wide.shared_bytes
    assert (wide.occupancy, narrow.occupancy) == (2, 3) and narrow.artifact_sha != wide.artifact_sha


def test_a_record_carried_to_a_narrow_headdim_avoids_the_tl_dx_tiles_that_fault():
    """The tl dx with 64-wide rows, time steps and dstate steps over a headdim tile of 32 faulted on
    an H200: sm90's default at a 64-wide headdim (those three at 64 with the Gluon dx), carried to
    headdim 32 by the lookup, leaves one of them at 32, and a config asking for all three is
    refused with the reason."""
    from autossd.db.lookup import transfer
    wide = Problem(8, 2048, 80, 64, 128, 1, "bf16", chunk_size=256, has_D=True)
    narrow = Problem(2, 333, 4, 32, 64, 4, "bf16", chunk_size=64, has_initial_states=True)
    c = transfer(default_config("sm90", wide), "sm90", narrow, op="ssd_bwd")
    assert c is not None and c.dx_gluon == 0 and not violations(c, "sm90", narrow)
    assert 32 in (c.dx_block_m, c.dx_block_k, c.dx_block_d) and c.dx_block_n == 32
    why = violations(c.replace(dx_block_m=64, dx_block_k=64, dx_block_d=64), "sm90", narrow)
    assert any("faults" in w for w in why)
    assert not any("faults" in w for w in violations(c.replace(dx_block_m=64, dx_block_k=64, dx_block_d=64),
                                                      "gfx942", narrow))


@pytest.mark.parametrize("knob,dtype,flags", [("dx_gluon", "bf16", dict(l=150)),
                                             ("rev_walk", "fp16", dict(l=200, has_initial_states=True))])
def test_each_gluon_stage_falls_back_to_the_tl_stages_where_the_call_cannot_take_it(monkeypatch, knob, dtype, flags):
    """sm90's default with a Gluon stage (the dx, the reverse walk), where a call cannot run it
    (here: no GPU, or a GPU with seq_idx): the backward runs the tl stages of the same config,
    every gradient within the dtype's bound (initial and final states included); the reason is
    named."""
    from autossd.ops.ssd import bwd_gluon
    gaps = {"dx_gluon": bwd_gluon.dx_gluon_gaps, "rev_walk": bwd_gluon.rev_walk_gaps}[knob]
    monkeypatch.setattr(bw, "config_for", lambda p, a, d=None: default_config("sm90", p.replace(has_seq_idx=False)))
    prob = _prob(dtype, h=2, p=64, n=64, chunk=64, has_D=True, return_final_states=True,
                 has_seq_idx=DEV != "cpu", **flags)
    cfg = default_config("sm90", prob.replace(has_seq_idx=False))
    assert cfg[knob] == 1
    t = make_inputs(prob, DEV, seed=5)
    buf = bw.allocate(prob, cfg, t, torch.randn_like(t["x"]), None, set(bw.GRAD_NAMES), None)
    assert gaps(prob, cfg, t, buf, "cuda")
    _check(prob, seed=17)


def test_opcheck_on_the_backward_op():
    """torch.library.opcheck on autossd::ssd_bwd: schema, fake kernel and dispatch agree."""
    prob = _prob("fp32", l=20, has_D=True)
    t = make_inputs(prob, DEV, seed=16)
    dout = torch.randn_like(t["x"])
    args = (dout, None, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], None, None, None, None, 64, False, 0.0,
            float("inf"), None, [True, True, True, True, True, True, False, False, False])
    torch.library.opcheck(torch.ops.autossd.ssd_bwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("arch", ["sm90", "sm80", "gfx90a", "gfx942"])
def test_default_config_cross_compiles(arch):
    """Every stage of the ssd_bwd default compiles for each arch at mamba2-2.7b's shapes (meta
    tensors, no device). ~15-45 s per arch."""
    from autossd.compile import compile_config
    prob = Problem(8, 2048, 80, 64, 128, 1, "bf16", chunk_size=256, has_D=True, has_z=True, has_dt_bias=True,
                   dt_softplus=True, has_initial_states=True, return_final_states=True)
    cfg = default_config(arch, prob)
    rep = compile_config(cfg, arch, prob)
    assert not rep.reasons, rep.reasons
    # (the reverse walk, sm90's default, is one launch in the dstates and reverse passing's place)
    gone = {"dstates"} if cfg.rev_walk else set()
    assert {s.stage for s in rep.stages} == set(get_op("ssd_bwd").sequences[cfg.cb]) - gone
    assert all(not s.reasons for s in rep.stages), [s.reasons for s in rep.stages]


def test_the_backward_asks_for_the_config_of_the_inputs_gpu(monkeypatch):
    """The backward's config comes from the records of the GPU the inputs are on (its name, as
    the lookup ranks a card's own measurements first): here the name faked on the CPU."""
    from autossd.db import lookup
    cfg = bw.config_for
    asked = []
    monkeypatch.setattr(lookup, "device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(bw, "config_for", lambda p, a, d=None: asked.append(d) or cfg(p, a, d))
    _check(_prob("fp32", l=70, h=2, p=16, n=16), seed=3)
    assert asked and set(asked) == {"NVIDIA H200"}


def test_a_recorded_backward_replays_on_each_calls_own_tensors(monkeypatch):
    """The backward's launch cache: the first call of a key plans, launches and records (the gate
    separately, as it runs before the other buffers exist); a second call of the same key with
    other inputs launches nothing through the plan, replays the record on its own tensors and
    buffers, and its gradients match float64 as the first call's do; another key records anew."""
    seen = interpret_launch_cache(monkeypatch, bw, "run")
    prob = _prob("fp32", **FULL)
    _check(prob, seed=0)
    planned = seen["planned"]
    assert planned >= 8 and seen["replays"] == 0 and len(bw._launch_cache) == 1
    (gate, rest, _), = bw._launch_cache.values()   # (and the state gradients' type)
    assert len(gate) == 1 and len(gate) + len(rest) == planned
    _check(prob, seed=3)   # other inputs, the same key
    assert seen == {"planned": planned, "replays": 2}
    _check(prob.replace(seqlen=130), seed=4)   # another key
    assert seen["planned"] > planned and seen["replays"] == 2 and len(bw._launch_cache) == 2


def test_a_replay_of_the_sm90_gluon_stages_passes_a_fresh_plans_arguments(monkeypatch):
    """sm90's default backward (the Gluon dx and reverse walk, planned as on a GPU: their gaps
    stubbed) recorded once and replayed on two other calls' inputs and buffers: each launch gets
    what a fresh plan of that call passes, pointers as the call's own addresses and each TMA
    descriptor on the call's own tensor with the recorded shape (compiled kernels stubbed)."""
    from autossd.render import load
    monkeypatch.setattr(bw, "dx_gluon_gaps", lambda *a, **k: [])
    monkeypatch.setattr(bw, "rev_walk_gaps", lambda *a, **k: [])
    prob = _prob("bf16", b=2, l=200, h=2, p=64, n=64, chunk=64, has_D=True, has_z=True, has_initial_states=True,
                 return_final_states=True)
    cfg = default_config("sm90", prob)
    assert cfg.dx_gluon and cfg.rev_walk
    mod = load(cfg)

    def planned(seed):
        t = make_inputs(prob, DEV, seed=seed)
        t["y_pre"] = torch.randn_like(t["x"])
        dout, dfinal = torch.randn_like(t["x"]), torch.randn(2, 2, 64, 64, device=DEV)
        ti = dict(t, dout=dout, dfinal=dfinal)
        buf = bw.allocate(prob, cfg, t, dout, dfinal, set(bw.GRAD_NAMES), None)
        return ti, buf, bw.plan(prob, cfg, t, buf, "cuda", (0.0, float("inf")), dout, dfinal)

    launches1, descs = record_and_replay(planned, mod, bw.BWD_INPUTS, bw._BWD_BUFFERS)
    kernels = [ln.kernel for ln in launches1]
    assert "ssd_bwd_dx_gluon" in kernels and "ssd_bwd_state_walk_rev" in kernels and "ssd_bwd_gate" in kernels
    assert descs >= 2 * 6   # dx's three and the walk's three, per replay
