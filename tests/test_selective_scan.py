"""Mamba-1's selective scan (`autossd.selective_scan_fn`, ops sscan_fwd and sscan_bwd) against its
float64 reference, in Triton's CPU interpreter: every B/C form, with and without D, z,
delta_bias and softplus, in fp32, bf16 and fp16; outputs poisoned with NaN where the ops write
into buffers of their own; a length that is no multiple of the chunk; bad input refused by
name. Shapes are tiny: each launch is a few interpreted programs."""
import dataclasses
import os

import pytest
import torch
import triton
import triton.language as tl

import autossd
from autossd import render
from autossd.ops.mamba1 import fwd
from autossd.ops.mamba1 import scan as scan_module
from autossd.ops.mamba1.naive import selective_scan_ref
from autossd.ops.mamba1.problem import ScanProblem
from autossd.ops.mamba1.scan_knobs import BwdConfig, FwdConfig, fwd_default_config, violations
from autossd.testing import rel_err, tolerance

DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the interpreter without a GPU
# the backward's windowed walks with gluon = 0 and 1 on a GPU (in the interpreter a gluon config
# runs the same tl kernel: once is enough there)
GLUON_ON_GPU = [0, 1] if DEV == "cuda" else [0]


def _problem(form, dtype="fp32", **kw):
    """Small problems of each B/C form: "3d" (batch, dstate, seqlen), "groups" (batch, 2, dstate,
    seqlen), "invariant" (dim, dstate) B and C, "mixed" (a time-varying B, an invariant C)."""
    b_var, c_var, g = {"3d": (True, True, 1), "groups": (True, True, 2), "invariant": (False, False, 1),
                       "mixed": (True, False, 1)}[form]
    base = dict(batch=2, dim=8, dstate=16 if form != "mixed" else 12, seqlen=45, ngroups=g, dtype=dtype,
                B_var=b_var, C_var=c_var)
    return ScanProblem(**{**base, **kw})


def _call(p, t, **kw):
    return autossd.selective_scan_fn(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                                     delta_softplus=p.delta_softplus, return_last_state=p.return_last_state, **kw)


FLAGS = [dict(has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True),
         dict(return_last_state=True), dict(has_D=True, delta_softplus=True), dict(has_z=True, has_delta_bias=True)]


@pytest.mark.parametrize("form", ["3d", "groups", "invariant", "mixed"])
@pytest.mark.parametrize("flags", range(len(FLAGS)), ids=["all", "none-last", "D-softplus", "z-bias"])
def test_forward_matches_float64(form, flags):
    p = _problem(form, **FLAGS[flags])
    t = fwd.tune_inputs(p, DEV, seed=flags)
    got = _call(p, t)
    ref = selective_scan_ref(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                             p.delta_softplus, True)
    out, last = got if p.return_last_state else (got, None)
    assert out.dtype == t["u"].dtype and out.shape == t["u"].shape
    assert rel_err(out, ref[0]) < tolerance("fp32"), rel_err(out, ref[0])
    if last is not None:
        assert last.dtype == torch.float32 and last.shape == (p.batch, p.dim, p.dstate)
        assert rel_err(last, ref[1]) < tolerance("fp32")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_half_inputs_with_mixed_dtypes(dtype):
    """u in a 16-bit type, delta and B in fp32, C in the other 16-bit type (as mamba_ssm takes):
    held to u's dtype's tolerance."""
    p = _problem("3d", dtype, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    t = fwd.tune_inputs(p, DEV, seed=5)
    t["delta"] = t["delta"].float()
    t["B"] = t["B"].float()
    t["C"] = t["C"].to(torch.float16 if dtype == "bf16" else torch.bfloat16)
    out, last = _call(p, t)
    ref = selective_scan_ref(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"], True, True)
    assert out.dtype == t["u"].dtype
    assert rel_err(out, ref[0]) < tolerance(dtype), rel_err(out, ref[0])
    assert rel_err(last, ref[1]) < tolerance(dtype), rel_err(last, ref[1])


FWD_CONFIGS = {
    "assoc-many-chunks": FwdConfig(scan="assoc", block_d=2, chunk=16),
    "assoc-one-chunk": FwdConfig(scan="assoc", block_d=4, chunk=64, warps=2, stages=2),
    "serial-many-chunks": FwdConfig(block_d=4, chunk=16, lanes_n=8, warps=1),
    "serial-one-chunk": FwdConfig(block_d=2, chunk=64, lanes_n=16, warps=1, stages=2),
    "serial-time-lanes": FwdConfig(block_d=2, chunk=16, lanes_n=2, lanes_t=8, warps=1),
    "serial-channel-rows": FwdConfig(block_d=4, chunk=8, lanes_n=1, lanes_t=8, warps=1),
    # 45 steps in 6 chunks of 8: segments of 2 chunks (3), of 1 chunk (6, the split past the chunks)
    "serial-seq-split": FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=2),
    "serial-seq-split-lanes": FwdConfig(block_d=2, chunk=8, lanes_n=4, lanes_t=4, warps=1, seq_split=4),
    "serial-seq-split-past-chunks": FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=16),
    # state_in: each segment's first chunk walked before the chunk loop (with one chunk a segment,
    # the loop walks none)
    "serial-seq-split-state-in": FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=2, state_in=1),
    "serial-seq-split-state-in-lanes": FwdConfig(block_d=2, chunk=8, lanes_n=4, lanes_t=4, warps=1, seq_split=4,
                                                 state_in=1),
    "serial-seq-split-state-in-past-chunks": FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=16,
                                                       state_in=1),
    # softplus_poly: delta' as max(x, 0) + log1p(exp(-|x|)), log1p a polynomial
    "serial-softplus-poly": FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, softplus_poly=1),
    "serial-seq-split-softplus-poly": FwdConfig(block_d=2, chunk=8, lanes_n=4, lanes_t=4, warps=1, seq_split=4,
                                                state_in=1, softplus_poly=1),
    # gluon: the Gluon kernel on a GPU, the serial tl kernel of the same config in the interpreter
    "gluon": FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, gluon=1),
    "gluon-seq-split": FwdConfig(block_d=4, chunk=16, lanes_n=8, warps=1, seq_split=2, gluon=1, softplus_poly=1)}


@pytest.mark.parametrize("cfg", FWD_CONFIGS.values(), ids=FWD_CONFIGS.keys())
def test_forward_poisoned_outputs_and_configs(cfg):
    """Every element written (out and last state start NaN), at a length of 45: chunks with a
    partial last one, or one chunk longer than the sequence; both layouts, the serial one with
    its steps in one thread, split across time lanes, or a thread per channel and state."""
    p = _problem("groups", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    assert not violations(cfg, "sm90", p)
    t = fwd.tune_inputs(p, DEV, seed=11)
    out, last = fwd.tune_run(p, cfg, t, poison=True)
    ref = fwd.tune_reference(p, t)
    assert torch.isfinite(out).all() and torch.isfinite(last).all()
    assert rel_err(out, ref[0]) < tolerance("fp32") and rel_err(last, ref[1]) < tolerance("fp32")


def test_the_polynomial_softplus_holds_over_the_whole_range_of_delta():
    """softplus_poly against float64 where delta + bias spans -30 to 25 (past both ends of the
    polynomial's use: -|x| of either sign, and the identity above 20), the forward's output and
    last state and every gradient, as softplus_poly = 0 does."""
    from autossd.ops.mamba1 import bwd
    p = _problem("3d", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    t = bwd.tune_inputs(p, DEV, seed=23)
    t["delta"] = torch.linspace(-30.0, 25.0, t["delta"].numel())[torch.randperm(t["delta"].numel(),
                                                                              generator=torch.Generator().manual_seed(2))
                                                                 ].view_as(t["delta"]).to(t["delta"].dtype)
    ref_out = fwd.tune_reference(p, t)
    ref_grad = bwd.tune_reference(p, t)
    for poly in (0, 1):
        out, last = fwd.tune_run(p, FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, softplus_poly=poly), t,
                                 poison=True)
        assert rel_err(out, ref_out[0]) < tolerance("fp32") and rel_err(last, ref_out[1]) < tolerance("fp32"), poly
        got = bwd.tune_run(p, BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, softplus_poly=poly), t, poison=True)
        for k in ref_grad:
            assert rel_err(got[k], ref_grad[k]) < GRAD_TOL["fp32"], (poly, k, rel_err(got[k], ref_grad[k]))


def test_forward_checkpoints_are_the_chunk_start_states():
    """The states the training forward stores: chunk c's entering state, zero for the first."""
    p = _problem("3d", has_D=True, delta_softplus=True)
    t = fwd.tune_inputs(p, DEV, seed=2)
    for cfg in (FwdConfig(scan="assoc", block_d=4, chunk=16),
                FwdConfig(block_d=4, chunk=16, lanes_n=2, lanes_t=4, warps=1),
                FwdConfig(block_d=4, chunk=16, lanes_n=2, lanes_t=4, warps=1, seq_split=2),
                FwdConfig(block_d=4, chunk=16, lanes_n=2, lanes_t=4, warps=1, seq_split=2, state_in=1),
                FwdConfig(block_d=4, chunk=16, lanes_n=8, warps=1, seq_split=2, gluon=1)):
        _check_checkpoints(p, t, cfg)


def test_a_split_sequence_plans_a_summary_launch_and_whole_chunk_segments():
    """seq_split: segments of whole chunks, none empty (6 chunks in 4 asked for: 3 segments of 2);
    a summary launch over all but the last segment and one chaining them before the main one,
    which alone writes the output, the last state and the checkpoints; without a split, one
    launch as before."""
    p = _problem("groups", has_D=True, return_last_state=True)
    cfg = FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4)
    assert fwd.segments(p, cfg) == (2, 3) and fwd.segments(p, cfg.replace(seq_split=1)) == (6, 1)
    t = fwd.tune_inputs(p, DEV, seed=3)
    buf = fwd.allocate(p, cfg, t, last=True, ckpt_dtype="fp32")
    first, chain, main = fwd.plan(p, cfg, t, buf)
    assert (first.grid[2], chain.grid[2], main.grid[2]) == (2, 1, 3) and first.grid[:2] == main.grid[:2]
    assert [ln.constexprs["PHASE"] for ln in (first, chain, main)] == [1, 2, 0]
    assert not any(ln.constexprs["LAST"] or ln.constexprs["SAVE"] for ln in (first, chain))
    assert main.constexprs["LAST"] and main.constexprs["SAVE"]
    assert buf["he"].shape == (p.batch, 2, p.dim, p.dstate) and buf["sd"].shape == (p.batch, 2, p.dim)
    (one,) = fwd.plan(p, cfg.replace(seq_split=1), t, fwd.allocate(p, cfg.replace(seq_split=1), t, True, None))
    assert len(one.grid) == 2 and "PHASE" not in one.constexprs


def _check_checkpoints(p, t, cfg):
    ck = fwd.forward(p, cfg, t, ckpt_dtype="fp32", poison=True)["ckpt"]
    assert ck.shape == (2, 3, 8, 16)
    for c in range(3):
        want = torch.zeros(2, 8, 16, dtype=torch.float64, device=ck.device) if c == 0 else selective_scan_ref(
            t["u"][..., :16 * c], t["delta"][..., :16 * c], t["A"], t["B"][..., :16 * c], t["C"][..., :16 * c],
            delta_softplus=True, return_last_state=True)[1]
        assert (ck[:, c].double() - want).abs().max() < 1e-4


def test_complex_A_is_refused_by_name():
    p = _problem("3d")
    t = fwd.tune_inputs(p, DEV)
    with pytest.raises(TypeError, match="A: complex"):
        autossd.selective_scan_fn(t["u"], t["delta"], t["A"].to(torch.complex64), t["B"], t["C"])


@pytest.mark.parametrize("change,err,match", [
    (lambda t: t.update(u=t["u"][0]), ValueError, "u: expected 3 dims"),
    (lambda t: t.update(delta=t["delta"][:, :, :-1]), ValueError, "delta: expected shape"),
    (lambda t: t.update(A=t["A"][:-1]), ValueError, r"A: expected shape \(8, dstate\)"),
    (lambda t: t.update(B=t["B"][:, :, :-1]), ValueError, "B: expected shape"),
    (lambda t: t.update(C=torch.randn(2, 3, 16, 45)), ValueError, "C: ngroups=3 must divide dim=8"),
    (lambda t: t.update(B=torch.randn(2, 2, 16, 45), C=torch.randn(2, 4, 16, 45)), ValueError, "C: ngroups=4 differs"),
    (lambda t: t.update(D=torch.randn(7)), ValueError, "D: expected shape"),
    (lambda t: t.update(delta_bias=torch.randn(8, 1)), ValueError, "delta_bias: expected 1 dims"),
    (lambda t: t.update(z=t["u"][:1]), ValueError, "z: expected shape"),
    (lambda t: t.update(u=t["u"].to(torch.int32)), TypeError, "u: expected float32"),
    (lambda t: t.update(B=t["B"].double()), TypeError, "B: expected float32"),
    (lambda t: t.update(D=[1.0] * 8), TypeError, "D: expected a torch.Tensor"),
    (lambda t: t.update(u=t["u"][:, :, :0], delta=t["delta"][:, :, :0]), ValueError, "u: expected non-empty"),
    (lambda t: t.update(softplus="False"), TypeError, "delta_softplus: expected a bool"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_is_refused_naming_the_argument(change, err, match):
    p = _problem("3d", has_D=True, has_z=True, has_delta_bias=True)
    t = fwd.tune_inputs(p, DEV)
    t["softplus"] = True
    change(t)
    with pytest.raises(err, match=match):
        autossd.selective_scan_fn(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"],
                                  delta_softplus=t["softplus"])


@pytest.mark.skipif(DEV != "cuda", reason="needs a device other than the inputs'")
def test_inputs_on_two_devices_are_refused():
    p = _problem("3d")
    t = fwd.tune_inputs(p, DEV)
    with pytest.raises(ValueError, match="delta: on cpu"):
        autossd.selective_scan_fn(t["u"], t["delta"].cpu(), t["A"], t["B"], t["C"])


def test_defaults_fit_every_grid_problem_and_its_groups():
    """The default config runs every problem of the shipped grid, and with groups its channel
    block divides a group's channels."""
    from autossd.tuner.shapes import grid
    probs = grid(("bf16",), op="sscan_fwd")
    assert {p.dim for p in probs} == {1536, 2048, 3072, 4096, 5120, 8192} and {p.dstate for p in probs} == {16}
    for arch in ("sm80", "sm90", "gfx90a", "gfx942"):
        for p in probs + [ScanProblem(1, 24, 64, 100, 8, "fp16", has_D=True)]:
            assert not violations(fwd_default_config(arch, p), arch, p), (arch, p)


# --- the backward ----------------------------------------------------------------------------
GRAD_TOL = {"fp32": 1e-4, "bf16": 1.5e-2, "fp16": 3e-3}   # autossd.testing.grad_tolerance's bounds


def _grads(p, t, seed=0):
    """Every input's gradient through selective_scan_fn (out and, where returned, last_state
    weighted by random cotangents) and the float64 reference's."""
    from autossd.ops.mamba1.bwd import reference
    g = torch.Generator().manual_seed(seed + 99)
    dev = t["u"].device
    dout = torch.randn(t["u"].shape, generator=g).to(device=dev, dtype=t["u"].dtype)
    dlast = torch.randn(p.batch, p.dim, p.dstate, generator=g).to(dev) if p.return_last_state else None
    x = {k: v.detach().clone().requires_grad_() for k, v in t.items() if v is not None}
    got = autossd.selective_scan_fn(x["u"], x["delta"], x["A"], x["B"], x["C"], x.get("D"), x.get("z"),
                                    x.get("delta_bias"), delta_softplus=p.delta_softplus,
                                    return_last_state=p.return_last_state)
    out, last = got if p.return_last_state else (got, None)
    loss = (out.float() * dout.float()).sum() + ((last * dlast).sum() if last is not None else 0)
    loss.backward()
    ref = reference(t, p.delta_softplus, dout, dlast)
    return {k: v.grad for k, v in x.items()}, ref


@pytest.mark.parametrize("form", ["3d", "groups", "invariant", "mixed"])
@pytest.mark.parametrize("flags", [0, 1, 3], ids=["all", "none-last", "z-bias"])
def test_every_gradient_matches_float64_autograd(form, flags):
    p = _problem(form, **FLAGS[flags])
    t = fwd.tune_inputs(p, DEV, seed=flags + 20)
    got, ref = _grads(p, t, flags)
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == t[k].dtype and got[k].shape == t[k].shape, k
        assert rel_err(got[k], ref[k]) < GRAD_TOL["fp32"], (k, rel_err(got[k], ref[k]))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_gradients_within_the_dtype_tolerance(dtype):
    p = _problem("groups", dtype, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True)
    t = fwd.tune_inputs(p, DEV, seed=31)
    got, ref = _grads(p, t, 3)
    for k in ref:
        assert got[k].dtype == t[k].dtype
        assert rel_err(got[k], ref[k]) < GRAD_TOL[dtype], (k, rel_err(got[k], ref[k]))


BWD_CONFIGS = {
    "assoc-many-chunks": BwdConfig(scan="assoc", block_d=2, chunk=16, sub=1),
    "assoc-one-chunk-bf16-ckpt-sub2": BwdConfig(scan="assoc", block_d=2, chunk=64, sub=2, ckpt_dtype="bf16"),
    "assoc-sub4": BwdConfig(scan="assoc", block_d=1, chunk=32, sub=4),
    "serial-many-chunks": BwdConfig(block_d=4, chunk=16, lanes_n=8, warps=1),
    "serial-one-chunk-bf16-ckpt": BwdConfig(block_d=2, chunk=64, lanes_n=16, warps=1, ckpt_dtype="bf16"),
    "serial-time-lanes": BwdConfig(block_d=4, chunk=16, lanes_n=2, lanes_t=4, warps=1),
    "serial-channel-rows": BwdConfig(block_d=4, chunk=8, lanes_n=1, lanes_t=8, warps=1),
    # 6 chunks of 8: 3 segments of 2 chunks; 6 of one (time lanes)
    "serial-seq-split": BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4),
    "serial-seq-split-lanes": BwdConfig(block_d=4, chunk=8, lanes_n=2, lanes_t=4, warps=1, seq_split=16),
    "serial-seq-split-softplus-poly": BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4, softplus_poly=1),
    # gluon: the Gluon kernel on a GPU, the serial tl kernel of the same config in the interpreter
    "gluon": BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, gluon=1),
    "gluon-seq-split": BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4, gluon=1, softplus_poly=1)}


@pytest.mark.parametrize("cfg", BWD_CONFIGS.values(), ids=BWD_CONFIGS.keys())
def test_backward_poisoned_buffers_and_configs(cfg):
    """Through the op's own hooks: the forward's checkpoints and the backward's outputs and
    partials start NaN (an element never written fails), length 45 against chunks of 8 to 64;
    both layouts (the serial one's walk from a chunk's end flips each thread's steps and, with
    time lanes, the runs' order across lanes)."""
    from autossd.ops.mamba1 import bwd
    p = _problem("groups", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    assert not violations(cfg, "sm90", p)
    t = bwd.tune_inputs(p, DEV, seed=4)
    got = bwd.tune_run(p, cfg, t, poison=True)
    ref = bwd.tune_reference(p, t)
    tol = GRAD_TOL["fp32"] if cfg.ckpt_dtype == "fp32" else GRAD_TOL["bf16"]
    for k in ref:
        assert torch.isfinite(got[k]).all(), k
        assert rel_err(got[k], ref[k]) < tol, (k, rel_err(got[k], ref[k]))


@pytest.mark.parametrize("cfg", [BwdConfig(scan="assoc", block_d=2, chunk=16, sub=8),
                                 BwdConfig(scan="assoc", block_d=4, chunk=32, sub=4),
                                 BwdConfig(block_d=4, chunk=16, lanes_n=4, lanes_t=2, warps=1)],
                         ids=["sub8", "sub4", "serial"])
def test_spare_sub_blocks_read_no_group_past_the_last(cfg):
    """The last program's channel blocks past dim (dim 6 in blocks of 2 x 8 or 4 x 4; serial, a
    block of 4 with 2 past dim) read B and C of a real group: with B and C 4-D views of one group
    into buffers whose next group is NaN, a read past the last group would make the gradients
    non-finite."""
    from autossd.ops.mamba1 import bwd
    p = _problem("3d", dim=6, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True)
    t = bwd.tune_inputs(p, DEV, seed=9)
    assert not violations(cfg, "sm90", p)
    for k in ("B", "C"):
        big = torch.full((p.batch, 2, p.dstate, p.seqlen), float("nan"), device=DEV)
        big[:, 0] = t[k]
        t[k] = big[:, :1]   # (batch, 1, dstate, seqlen): one group, the NaN group right after it
    ref = bwd.tune_reference(p, {**t, "B": t["B"][:, 0], "C": t["C"][:, 0]})
    got = bwd.tune_run(p, cfg, t)
    for k in ref:
        g = got[k].reshape(ref[k].shape)
        assert torch.isfinite(g).all(), k
        assert rel_err(g, ref[k]) < GRAD_TOL["fp32"], (k, rel_err(g, ref[k]))


def test_backward_is_bitwise_reproducible():
    # 20 steps: three chunks of the default config (the last ragged), each a segment of its split, two
    # programs a batch row: the partial sums the host adds in a fixed order
    p = _problem("groups", "bf16", seqlen=20, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True,
                 return_last_state=True)
    t = fwd.tune_inputs(p, DEV, seed=8)
    a, _ = _grads(p, t, 1)
    b, _ = _grads(p, t, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_backward_without_checkpoints_recomputes_them():
    """The backward op given no checkpoints (a forward run without grad) runs the forward again for
    them: the same gradients bit for bit."""
    p = _problem("3d", has_D=True, delta_softplus=True)
    t = fwd.tune_inputs(p, DEV, seed=9)
    dout = torch.randn(t["u"].shape, device=t["u"].device)
    args = [t[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    need = [True, True, True, True, True, True, False, False]
    _, _, ck = torch.ops.autossd.sscan_fwd(*args, True, False, True)
    with_ck = torch.ops.autossd.sscan_bwd(dout, None, *args, ck, True, need)
    without = torch.ops.autossd.sscan_bwd(dout, None, *args, None, True, need)
    assert all(torch.equal(x, y) for x, y in zip(with_ck, without))


def test_torch_compile_fullgraph_forward_and_backward():
    """No graph break: the forward and its backward are registered custom ops with fake kernels."""
    p = _problem("3d", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    t = fwd.tune_inputs(p, DEV, seed=12)

    def f(u, delta, A, B, C, D, z, db):
        out, last = autossd.selective_scan_fn(u, delta, A, B, C, D, z, db, delta_softplus=True, return_last_state=True)
        return out.sum() + last.square().sum()

    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    xe = [t[k].clone().requires_grad_() for k in names]
    xc = [t[k].clone().requires_grad_() for k in names]
    f(*xe).backward()
    torch.compile(f, backend="aot_eager", fullgraph=True)(*xc).backward()
    for k, a, b in zip(names, xe, xc):
        assert torch.equal(a.grad, b.grad), k


def test_an_eager_call_runs_the_ops_bodies_with_the_ops_gradients():
    """An eager call skips torch's custom-op dispatch (its own autograd over the same two bodies):
    its outputs and gradients equal the registered ops' bit for bit, also where only the last
    state is used (out's cotangent then zeros) and where only some inputs require grad. (20 steps:
    three chunks of the default config, the last ragged; the dispatch is what differs.)"""
    from autossd.ops.mamba1.bwd import reference
    p = _problem("groups", seqlen=20, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True,
                 return_last_state=True)
    t = fwd.tune_inputs(p, DEV, seed=14)
    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    dlast = torch.randn(p.batch, p.dim, p.dstate, generator=torch.Generator().manual_seed(5)).to(DEV)
    for wanted in (names, ("delta", "B")):
        xe = {k: t[k].clone().requires_grad_(k in wanted) for k in names}
        xo = {k: t[k].clone().requires_grad_(k in wanted) for k in names}
        out_e, last_e = autossd.selective_scan_fn(*xe.values(), delta_softplus=True, return_last_state=True)
        out_o, last_o, _ = torch.ops.autossd.sscan_fwd(*xo.values(), True, True, True)
        assert torch.equal(out_e, out_o) and torch.equal(last_e, last_o)
        ge = torch.autograd.grad(last_e, [xe[k] for k in wanted], dlast)
        go = torch.autograd.grad(last_o, [xo[k] for k in wanted], dlast)
        ref = reference(t, True, torch.zeros_like(t["u"]), dlast)
        for k, a, b in zip(wanted, ge, go):
            assert torch.equal(a, b), k
            assert rel_err(a, ref[k]) < GRAD_TOL["fp32"], (k, rel_err(a, ref[k]))


def test_a_recorded_call_replays_on_each_calls_own_tensors(monkeypatch):
    """The launch cache: a training call's forward and backward each plan, launch and record the
    first time their key is seen; a second call of the same key with other values plans nothing
    and replays both records on its own tensors and buffers (gradients within the float64 bound
    both times); another key (a longer sequence) records anew."""
    from autossd.testing import interpret_launch_cache
    seen = interpret_launch_cache(monkeypatch, fwd, "launch_all")
    p = _problem("groups", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    cfgs = (FwdConfig(block_d=4, chunk=16, lanes_n=8, warps=1, seq_split=2), BwdConfig(block_d=4, chunk=16, lanes_n=8,
                                                                                         warps=1))
    monkeypatch.setattr(scan_module, "configs", lambda prob, device, training=False: (*cfgs, "cuda"))

    def check(prob, seed):
        got, ref = _grads(prob, fwd.tune_inputs(prob, DEV, seed=seed), seed)
        assert set(got) == set(ref)
        for k in ref:
            assert rel_err(got[k], ref[k]) < GRAD_TOL["fp32"], (k, rel_err(got[k], ref[k]))

    check(p, 1)
    planned = seen["planned"]
    assert planned == 4 and seen["replays"] == 0 and len(fwd._launch_cache) == 2   # 3 split launches + the backward
    check(p, 2)
    assert seen == {"planned": planned, "replays": 2}
    check(dataclasses.replace(p, seqlen=61), 3)
    assert seen["planned"] == 2 * planned and seen["replays"] == 2 and len(fwd._launch_cache) == 4


def test_the_shape_grammar_writes_mamba1_calls():
    from autossd.tuner.shapes import describe, parse_shape
    p = parse_shape("b=2,l=4k,d=5120", "bf16", op="sscan_bwd")
    assert p == ScanProblem(2, 5120, 16, 4096, 1, "bf16", has_D=True, has_z=True, has_delta_bias=True,
                            delta_softplus=True)
    assert parse_shape("b=1,l=64,d=8,n=4,g=2,z=0,last=1,bvar=0", op="sscan_fwd") == ScanProblem(
        1, 8, 4, 64, 2, "fp16", has_D=True, has_delta_bias=True, delta_softplus=True, B_var=False,
        return_last_state=True)
    assert describe(p) == "b=2,l=4096,d=5120,n=16,g=1 bf16"


@pytest.mark.parametrize("arch", ["sm80", "sm90", "gfx90a", "gfx942"])
def test_the_shipped_databases_hold_a_fresh_static_record_at_every_grid_shape(isolated_db, arch):
    """Both ops at every Mamba-1 grid shape (d_inner 1536-8192, d_state 16, fp16 and bf16) find an
    exact, fresh record of the shipped file through the one selector: static (a model's ranking)
    until measured records replace them; where the arch has measured records (sm90's H200 at a few
    shapes), a measurement transferred from a near shape beats an exact prediction."""
    from autossd.core import select
    from autossd.tuner.shapes import grid
    select.clear()
    for op in ("sscan_fwd", "sscan_bwd"):
        for p in grid(op=op):
            m = select.select(op, p, arch)
            assert (m.kind == "exact" or (m.kind == "transfer" and m.record.provenance == "measured")) \
                and not m.stale, (op, p, m.reason)
            assert m.record.origin == "shipped" and m.record.provenance in ("static", "measured")
            assert not violations(m.config, arch, p)


@pytest.mark.parametrize("form", ["3d", "groups", "invariant", "mixed"])
def test_the_reference_in_runs_of_steps_matches_the_whole_sequence(form):
    """The float64 reference composes the recurrence by doubling within a run of steps, the state
    carried from run to run (each run checkpointed when gradients are wanted), so the tuner's gate
    fits in memory and host time at 4 x 8192 or 1 x 65536: one run of the whole sequence and runs
    of 7 steps give the same outputs, last state and gradients as runs of one step, the
    recurrence stepped one time step at a time."""
    p = _problem(form, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True)
    t = fwd.tune_inputs(p, "cpu", seed=8)
    x = {k: t[k].double().requires_grad_() for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")}
    outs = []
    for run in (1, None, 7):
        out, last = selective_scan_ref(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"], x["delta_bias"],
                                       True, True, run=run)
        g = torch.autograd.grad((out * torch.cos(out)).sum() + last.sum(), list(x.values()))
        outs.append((out.detach(), last.detach(), g))
    o1, l1, g1 = outs[0]
    for o2, l2, g2 in outs[1:]:
        assert rel_err(o2, o1) < 1e-12 and rel_err(l2, l1) < 1e-12
        for k, a, b in zip(x, g1, g2):
            assert rel_err(b, a) < 1e-12, k


@triton.jit
def _pair_combine(a1, b1, a2, b2):
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _scans_and_reductions(x_ptr, y_ptr, z_ptr, w_ptr, v_ptr, REV: tl.constexpr):
    # a pair scan along axis 1 (forward or reversed), a pair reduction along axis 2, a flip of axis 0
    i = tl.arange(0, 8)[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    a = tl.load(x_ptr + i)
    b = tl.load(y_ptr + i)
    _, pb = tl.associative_scan((a, b), axis=1, combine_fn=_pair_combine, reverse=REV)
    tl.store(z_ptr + i, pb)
    r = tl.reduce((a, b), 2, _pair_combine)
    tl.store(w_ptr + tl.arange(0, 8)[:, None] * 4 + tl.arange(0, 4)[None, :], r[1])
    tl.store(v_ptr + i, tl.flip(b, 0))


def test_the_interpreters_scans_and_reductions_of_own_combines_step_whole_slices():
    """autossd's interpreter fix: a scan or reduction with a combine function of the kernel's own
    runs a combine call per step of the axis on whole slices, in the axis's order: bitwise the
    results of Triton's element-by-element fallback, forward, reversed and reduced (tl.flip is
    xor reductions)."""
    from triton.runtime import interpreter as it

    import autossd.interpret as ai
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the interpreter's fix: runs where kernels are interpreted")
    ai.apply()

    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(256, generator=g), torch.randn(256, generator=g)
    fast = (it.ScanOps.generic_scan, it.ReduceOps.generic_reduce)
    slow = (ai.ELEMENTWISE_SCAN, ai.ELEMENTWISE_REDUCE)
    forward = None
    for rev in (False, True):
        got = []
        for scan, red in (fast, slow):
            it.ScanOps.generic_scan, it.ReduceOps.generic_reduce = scan, red
            try:
                z, w, v = torch.empty(256), torch.empty(32), torch.empty(256)
                _scans_and_reductions[(1,)](x, y, z, w, v, rev)
            finally:
                it.ScanOps.generic_scan, it.ReduceOps.generic_reduce = fast
            got.append((z, w, v))
        for a, b in zip(*got):
            assert torch.equal(a, b)
        forward = forward if rev else got[0][0]
    # the reference itself: a sequential recurrence of (x, y) along axis 1
    ref = torch.empty(8, 4, 8)
    h = torch.zeros(8, 8)
    xs, ys = x.view(8, 4, 8), y.view(8, 4, 8)
    for j in range(4):
        h = ys[:, j] if j == 0 else xs[:, j] * h + ys[:, j]
        ref[:, j] = h
    assert torch.allclose(forward.view(8, 4, 8), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cfg", [FwdConfig(block_d=32, chunk=16, lanes_n=4, seq_split=16),
                                 FwdConfig(block_d=128, chunk=8, lanes_n=1, seq_split=16),
                                 BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=8),
                                 BwdConfig(block_d=8, chunk=8, lanes_n=4, warps=1, seq_split=8)],
                         ids=["fwd", "fwd-h200-pick", "bwd", "bwd-h200-pick"])
def test_a_split_sequence_cross_compiles_for_sm90_without_spills(cfg):
    """seq_split's three launches of the one kernel (summaries, their chain, the main walk)
    compile for sm90 at Mamba 2.8b's width, batch 1, without spills (among them the H200's
    batch-1 picks); the backward's main launch at the unsplit one's occupancy (its entering
    gradient costs a few registers, not a block an SM)."""
    from autossd.compile import compile_config
    prob = ScanProblem(batch=1, dim=5120, dstate=16, seqlen=2048, ngroups=1, dtype="bf16", B_var=True, C_var=True,
                       has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True)
    rep = compile_config(cfg, "sm90", prob)
    assert rep.ok, rep.why()
    assert len(rep.stages) == 3 and all(s.spill_bytes == 0 for s in rep.stages)
    if cfg.op == "sscan_bwd":
        whole = compile_config(cfg.replace(seq_split=1), "sm90", prob)
        assert rep.stages[2].occupancy >= whole.stages[0].occupancy



@pytest.mark.parametrize("form", ["invariant", "mixed", "3d"])
def test_a_split_backward_sums_each_segments_channel_sums(form):
    """seq_split in the backward: every gradient against float64 where B or C is time-invariant
    (their sums, like dA's, dD's and ddelta_bias's, are written per batch row and segment and added
    after), without a last state's gradient, at 4 segments of 2 chunks (the last chunk ragged); the
    plan's three launches."""
    from autossd.ops.mamba1 import bwd
    p = _problem(form, seqlen=60, has_D=True, has_delta_bias=True, delta_softplus=True)
    cfg = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4)
    assert not violations(cfg, "sm90", p) and fwd.segments(p, cfg) == (2, 4)
    t = bwd.tune_inputs(p, DEV, seed=9)
    got = bwd.tune_run(p, cfg, t, poison=True)
    ref = bwd.tune_reference(p, t)
    for k in ref:
        assert torch.isfinite(got[k]).all(), k
        assert rel_err(got[k], ref[k]) < GRAD_TOL["fp32"], (k, rel_err(got[k], ref[k]))
    buf = bwd.allocate(p, cfg, t)
    tt = dict(t, ckpt=torch.zeros(2, 8, 8, 16, device=DEV))
    phases = [ln.constexprs["PHASE"] for ln in bwd.plan(p, cfg, tt, buf)]
    assert phases == [1, 2, 0] and buf["pA"].shape[0] == p.batch * 4


@pytest.mark.parametrize("gluon", GLUON_ON_GPU)
@pytest.mark.parametrize("form", ["3d", "groups", "invariant", "mixed"])
def test_a_windowed_backward_bounds_its_partials_and_keeps_every_gradient(form, gluon, monkeypatch):
    """window = 1: the sequence's chunks in windows, a launch each from the last, the time-varying
    dB / dC partials one window long (summed after each window's launch), the gradient carried and the
    per-channel sums added from window to window. With the bound at 3 chunks' partials: 9 chunks
    of 8 (the last ragged) in 3 windows (the last, launched first; one between; the first), the
    partials' rows padded, every gradient against float64 with poisoned buffers, a last state's
    gradient; and a config without the knob is switched to it by the bound (where a partial varies
    in time, its run is the windowed one, and so the one checked)."""
    from autossd.ops.mamba1 import bwd
    p = _problem(form, seqlen=66, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True,
                 return_last_state=True)
    cfg = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, gluon=gluon)
    per_chunk = p.batch * bwd.programs(p, cfg) * p.dstate * 4 * cfg.chunk
    monkeypatch.setattr(bwd, "WINDOW_BYTES", 3 * per_chunk)
    win = cfg.replace(window=1)
    assert not violations(win, "sm90", p) and bwd.windows(p, win) == (3, 3)
    varying = p.B_var or p.C_var
    assert bwd.bounded(p, cfg) == (win if varying else cfg)
    t = bwd.tune_inputs(p, DEV, seed=12)
    ref = bwd.tune_reference(p, t)
    walked, run_windows = [], bwd._run_windows
    monkeypatch.setattr(bwd, "_run_windows",
                        lambda prob, c, *a, **k: walked.append(c) or run_windows(prob, c, *a, **k))
    # cfg: the bound switches it to windows where a partial varies in time (its run walks them at
    # win's config: win's own run would repeat it launch for launch); the invariant form's, one launch
    for c in ((cfg,) if varying else (win, cfg)):
        got = bwd.tune_run(p, c, t, poison=True)
        for k in ref:
            assert torch.isfinite(got[k]).all(), (c, k)
            assert rel_err(got[k], ref[k]) < GRAD_TOL["fp32"], (c, k, rel_err(got[k], ref[k]))
    assert walked == [win]
    buf = bwd.allocate(p, win, t)
    if p.B_var:
        # a window's 24 steps in rows of 32: a row length Triton knows divisible by 16 (vector stores)
        assert buf["pB"].shape[-1] == 32 and buf["oB"].shape[-1] == p.seqlen
    tt = dict(t, ckpt=torch.zeros(p.batch, 9, p.dim, p.dstate, device=DEV), dlast=None)
    walks = [ln for ln in bwd.plan(p, win, tt, buf) if ln.kernel.startswith("sscan_bwd")]
    assert [(ln.args["C0"], ln.args["NCW"], ln.args["ACC_IN"]) for ln in walks] == \
        [(6, 3, 0), (3, 3, 1), (0, 3, 1)]


def test_state_in_is_refused_without_segments_and_changes_the_split_kernel():
    """state_in = 1 reads a segment's entering state: refused without a split, and at one it
    compiles a kernel of its own (the segment's first chunk walked before the loop)."""
    p = _problem("3d", seqlen=90)
    cfg = FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4)
    assert any("state_in=1" in w for w in violations(cfg.replace(seq_split=1, state_in=1), "sm90", p))
    assert not violations(cfg.replace(state_in=1), "sm90", p)
    assert render.kernel_hash(cfg.replace(state_in=1), "cuda") != render.kernel_hash(cfg, "cuda")


def _same_gradients_bitwise(p, first, second, t) -> dict:
    """Two backward configs' gradients (poisoned buffers) bitwise equal, the second's within fp32's
    bound of the float64 reference; the reference, for further checks."""
    from autossd.ops.mamba1 import bwd
    ref = bwd.tune_reference(p, t)
    a = bwd.tune_run(p, first, t, poison=True)
    b = bwd.tune_run(p, second, t, poison=True)
    for k in ref:
        assert torch.equal(a[k], b[k]), k
        assert rel_err(b[k], ref[k]) < GRAD_TOL["fp32"], (k, rel_err(b[k], ref[k]))
    return ref


@pytest.mark.parametrize("gluon", GLUON_ON_GPU)
@pytest.mark.parametrize("form", ["groups", "mixed"])
def test_a_split_backward_in_windows_of_whole_segments_gives_the_unwindowed_gradients_bitwise(form, gluon,
                                                                                             monkeypatch):
    """seq_split with window = 1: the segments' start gradients over the whole sequence, then a
    main launch per window of whole segments from the last, the time-varying partials one window
    long. With the bound at two segments' partials: 9 chunks of 8 in 5 segments of 2 (the last
    one chunk, ragged) make windows of 2, 2 and 1 segments; every gradient bitwise the unwindowed
    split's and within float64's bound, poisoned buffers, a last state's gradient. window = 2
    (one checkpoint a window) stays refused beside a split, and the bound does not switch a split
    record to windows."""
    from autossd.ops.mamba1 import bwd
    p = _problem(form, seqlen=69, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True,
                 return_last_state=True)
    cfg = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=8, gluon=gluon)   # 9 chunks: 5 segments of 2
    assert fwd.segments(p, cfg) == (2, 5)
    monkeypatch.setattr(bwd, "WINDOW_BYTES", bwd._partial_bytes(p, cfg, 2 * 2 * cfg.chunk))
    win = cfg.replace(window=1)
    assert not violations(win, "sm90", p) and bwd.windows(p, win) == (4, 3)
    assert any("window=2" in w and "seq_split" in w for w in violations(cfg.replace(window=2), "sm90", p))
    assert bwd.bounded(p, cfg) == cfg
    t = bwd.tune_inputs(p, DEV, seed=14)
    buf = bwd.allocate(p, win, t)
    assert buf["pB"].shape[-1] == 32   # a window's 32 steps (rows a multiple of 16)
    tt = dict(t, ckpt=torch.zeros(p.batch, 9, p.dim, p.dstate, device=DEV), dlast=t["dlast"])
    launches = bwd.plan(p, win, tt, buf)
    assert [(ln.constexprs["PHASE"], ln.grid[2], ln.args["C0"]) for ln in launches] == \
        [(1, 4, 0), (2, 1, 0), (0, 1, 8), (0, 2, 4), (0, 2, 0)]
    _same_gradients_bitwise(p, cfg, win, t)


@pytest.mark.parametrize("form", ["3d", "groups", "mixed"])
def test_b_and_c_converted_once_give_the_same_forward_bitwise(form, monkeypatch):
    """bc_f32 = 1 (a time-varying B and C converted to fp32 before the launch, not at each read):
    in bf16, bitwise the output and last state of the same config without it, and within bf16's
    bound against float64; the kernel it compiles reads B and C as fp32."""
    p = _problem(form, "bf16", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True,
                 return_last_state=True)
    cfg = FwdConfig(block_d=4, chunk=16, lanes_n=8, lanes_t=2, warps=1)
    assert not violations(cfg.replace(bc_f32=1), "sm90", p)
    t = fwd.tune_inputs(p, DEV, seed=21)
    out0, last0 = fwd.tune_run(p, cfg, t, poison=True)
    out1, last1 = fwd.tune_run(p, cfg.replace(bc_f32=1), t, poison=True)
    assert torch.equal(out0, out1) and torch.equal(last0, last1)
    ref = fwd.tune_reference(p, t)
    assert rel_err(out1, ref[0]) < tolerance("bf16") and rel_err(last1, ref[1]) < tolerance("bf16")
    staged = fwd.staged(p, cfg.replace(bc_f32=1), t)
    assert staged["B"].dtype == torch.float32 and staged["C"].dtype == (torch.float32 if p.C_var else t["C"].dtype)
    assert staged["u"] is t["u"]
    # the launch gets them so: the plan's pointers, and a kernel of its own
    seen = []
    plan = fwd.plan
    monkeypatch.setattr(fwd, "plan", lambda *a, **k: seen.append(plan(*a, **k)) or seen[-1])
    fwd.tune_run(p, cfg.replace(bc_f32=1), t)
    (ln,) = seen[-1]
    assert ln.args["B_ptr"].dtype == torch.float32 and ln.args["C_ptr"].dtype == staged["C"].dtype
    assert render.kernel_hash(cfg.replace(bc_f32=1), "cuda") != render.kernel_hash(cfg, "cuda")


@pytest.mark.parametrize("form", ["3d", "mixed"])
def test_b_and_c_converted_once_give_the_same_gradients_bitwise(form):
    """The backward's bc_f32 = 1: in bf16, bitwise every gradient of the same config without it, in
    each input's dtype, and within bf16's bound against float64."""
    from autossd.ops.mamba1 import bwd
    p = _problem(form, "bf16", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True,
                 return_last_state=True)
    cfg = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1)
    assert not violations(cfg.replace(bc_f32=1), "sm90", p)
    t = bwd.tune_inputs(p, DEV, seed=23)
    g0 = bwd.tune_run(p, cfg, t, poison=True)
    g1 = bwd.tune_run(p, cfg.replace(bc_f32=1), t, poison=True)
    ref = bwd.tune_reference(p, t)
    for k in ref:
        assert torch.equal(g0[k], g1[k]) and g1[k].dtype == t[k].dtype, k
        assert rel_err(g1[k], ref[k]) < GRAD_TOL["bf16"], (k, rel_err(g1[k], ref[k]))


@pytest.mark.parametrize("gluon", GLUON_ON_GPU)
@pytest.mark.parametrize("form", ["3d", "groups", "invariant", "mixed"])
def test_one_checkpoint_a_window_gives_the_windowed_backwards_gradients_bitwise(form, gluon, monkeypatch):
    """window = 2: the training forward stores one checkpoint a window (fp32), and before each
    window's launch the forward's kernel walks that window again from it, each chunk's entering
    state into a buffer one window long. With the bound at 2 chunks' partials (6 chunks of 8 in 3
    windows, the last ragged): the checkpoints (batch, 3, dim, dstate), every gradient bitwise
    window = 1's (fp32 checkpoints there) and within the float64 bound, poisoned buffers; bf16
    checkpoints within the bound; and the call through selective_scan_fn with a window = 2 record."""
    from autossd.ops.mamba1 import bwd
    p = _problem(form, seqlen=42, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True,
                 return_last_state=True)
    cfg = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, gluon=gluon)
    per_chunk = p.batch * bwd.programs(p, cfg) * p.dstate * 4 * cfg.chunk
    monkeypatch.setattr(bwd, "WINDOW_BYTES", 2 * per_chunk)
    one, two = cfg.replace(window=1), cfg.replace(window=2)
    assert not violations(two, "sm90", p) and bwd.windows(p, two) == (2, 3)
    assert bwd.ckpt_every(p, two) == 2 and bwd.ckpt_every(p, one) == 1
    assert bwd.ckpt_shape(p, two) == ((p.batch, 3, p.dim, p.dstate), torch.float32)
    fcfg = bwd.forward_config(p, two, None, "sm90")
    assert fcfg.ckpt_stride == 1 and fcfg.chunk == 8
    # a split forward record (the H200's batch-1 kind) becomes an unsplit, runnable one
    split = bwd.forward_config(p, two, FwdConfig(block_d=4, chunk=16, lanes_n=8, warps=1, seq_split=4, state_in=1),
                               "sm90")
    assert (split.seq_split, split.state_in, split.ckpt_stride) == (1, 0, 1) and not violations(split, "sm90", p)
    t = bwd.tune_inputs(p, DEV, seed=31)
    ck = fwd.forward(p, fcfg, t, ckpt_dtype="fp32", ckpt_every=2, poison=True)["ckpt"]
    assert tuple(ck.shape) == (p.batch, 3, p.dim, p.dstate) and torch.isfinite(ck).all()
    ref = _same_gradients_bitwise(p, one, two, t)
    g3 = bwd.tune_run(p, two.replace(ckpt_dtype="bf16"), t, poison=True)
    for k in ref:
        assert rel_err(g3[k], ref[k]) < GRAD_TOL["bf16"], k


@pytest.mark.parametrize("chunks,windows", [(3, 3), (1, 7)], ids=["ragged-last", "one-chunk"])
def test_windows_of_any_length_recompute_from_fp32_checkpoints(chunks, windows, monkeypatch):
    """window = 2 with windows of 3 chunks (7 chunks: 3, 3 and a last of 1) and of one chunk (7
    windows), bf16 checkpoints asked: the training forward's checkpoints are one a window in fp32
    whatever ckpt_dtype says, as ckpt_shape (and so the fake kernel) says; one forward, no second
    one in the backward; the window's recomputed states in bf16, so every gradient bitwise
    window = 1's with bf16 checkpoints (rounded from the same fp32 states), and within the bound
    against float64."""
    from autossd.ops.mamba1 import bwd
    p = _problem("3d", seqlen=50, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True)
    cfg = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1)
    monkeypatch.setattr(bwd, "WINDOW_BYTES", chunks * p.batch * bwd.programs(p, cfg) * p.dstate * 4 * cfg.chunk)
    two = cfg.replace(window=2, ckpt_dtype="bf16")
    assert bwd.windows(p, two) == (chunks, windows) and bwd.ckpt_every(p, two) == chunks
    shape, dtype = bwd.ckpt_shape(p, two)
    assert shape == (p.batch, windows, p.dim, p.dstate) and dtype == torch.float32
    t = bwd.tune_inputs(p, DEV, seed=37)
    calls = []
    real = fwd.forward
    monkeypatch.setattr(fwd, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    g2 = bwd.tune_run(p, two, t, poison=True)
    assert len(calls) == 1   # the backward took the training forward's checkpoints
    ck = real(p, bwd.forward_config(p, two, None, "sm90"), t, ckpt_dtype="bf16", ckpt_every=chunks)["ckpt"]
    assert tuple(ck.shape) == shape and ck.dtype == dtype
    g1 = bwd.tune_run(p, cfg.replace(window=1, ckpt_dtype="bf16"), t, poison=True)
    ref = bwd.tune_reference(p, t)
    for k in ref:
        assert torch.equal(g1[k], g2[k]), k
        assert rel_err(g2[k], ref[k]) < GRAD_TOL["bf16"], k


def test_a_window_2_record_runs_selective_scan_fn_eagerly_and_compiled(isolated_db, no_shipped_db, monkeypatch):
    """Through the drop-in: a stored window = 2 backward record (the bound at 3 chunks' partials:
    45 steps in 2 windows) makes the training forward keep one checkpoint a window, (batch, 2,
    dim, dstate) fp32, as the op's fake kernel says too; each window is walked again once, the last
    first; the gradients match float64, eagerly and under torch.compile (fullgraph) bitwise alike."""
    from autossd.core import select
    from autossd.db import add_records, make_record
    from autossd.ops.mamba1 import bwd, scan
    p = _problem("3d", has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    two = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, window=2)
    monkeypatch.setattr(bwd, "WINDOW_BYTES", 3 * p.batch * bwd.programs(p, two) * p.dstate * 4 * two.chunk)
    select.clear()
    add_records(str(isolated_db), [make_record(p, two, "sm90", provenance="measured", time_ms=0.01)])
    t = fwd.tune_inputs(p, DEV, seed=33)
    fcfg, bcfg, _ = scan.configs(p, t["u"].device, training=True)
    assert bcfg == two and fcfg.ckpt_stride == 1
    names = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
    saved = []
    real, walked = fwd.forward, []
    monkeypatch.setattr(fwd, "forward", lambda *a, **k: saved.append(real(*a, **k)) or saved[-1])
    recompute = fwd.recompute
    monkeypatch.setattr(fwd, "recompute", lambda *a, **k: walked.append(a[6]) or recompute(*a, **k))

    def f(u, delta, A, B, C, D, z, db):
        out, last = autossd.selective_scan_fn(u, delta, A, B, C, D, z, db, delta_softplus=True, return_last_state=True)
        return (out.float() * 0.5).sum() + last.square().sum()

    xe = [t[k].clone().requires_grad_() for k in names]
    f(*xe).backward()
    ck = saved[0]["ckpt"]
    assert ck.dtype == torch.float32 and tuple(ck.shape) == (p.batch, 2, p.dim, p.dstate)
    assert len(saved) == 1 and walked == [3, 0]   # no second forward; each window walked again, the last first
    fake = scan._sscan_fwd_fake(*(t[k] for k in names), True, True, True)[2]
    assert fake.shape == ck.shape and fake.dtype == ck.dtype
    xc = [t[k].clone().requires_grad_() for k in names]
    torch.compile(f, backend="aot_eager", fullgraph=True)(*xc).backward()
    x64 = [t[k].detach().double().requires_grad_() for k in names]
    out, last = selective_scan_ref(*x64, True, True)
    ((out * 0.5).sum() + last.square().sum()).backward()
    for k, a, b, r in zip(names, xe, xc, x64):
        assert torch.equal(a.grad, b.grad), k
        assert rel_err(a.grad, r.grad) < GRAD_TOL["fp32"], (k, rel_err(a.grad, r.grad))
    select.clear()


GLUON_PROB = ScanProblem(batch=1, dim=5120, dstate=16, seqlen=2048, ngroups=1, dtype="bf16", B_var=True, C_var=True,
                         has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True)
GLUON_INVARIANT_B = dataclasses.replace(GLUON_PROB, dim=256, ngroups=2, B_var=False, dstate=12, return_last_state=True)


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
@pytest.mark.parametrize("cfg,prob", [
    (FwdConfig(block_d=64, warps=2, chunk=16, lanes_n=1, gluon=1, softplus_poly=1), GLUON_PROB),
    (FwdConfig(block_d=128, warps=4, chunk=16, lanes_n=1, seq_split=16, gluon=1, softplus_poly=1), GLUON_PROB),
    (FwdConfig(block_d=64, warps=4, chunk=8, lanes_n=2, gluon=1), dataclasses.replace(GLUON_PROB, batch=8)),
    (FwdConfig(block_d=32, warps=2, chunk=8, lanes_n=2, gluon=1), GLUON_INVARIANT_B),
    (BwdConfig(block_d=16, warps=1, chunk=8, lanes_n=2, gluon=1, softplus_poly=1), GLUON_PROB),
    (BwdConfig(block_d=16, warps=1, chunk=8, lanes_n=2, seq_split=16, gluon=1, softplus_poly=1), GLUON_PROB),
    (BwdConfig(block_d=64, warps=4, chunk=8, lanes_n=2, gluon=1), dataclasses.replace(GLUON_PROB, batch=8)),
    (BwdConfig(block_d=32, warps=2, chunk=8, lanes_n=2, gluon=1), GLUON_INVARIANT_B),
    (BwdConfig(block_d=16, warps=1, chunk=8, lanes_n=2, window=2, gluon=1), GLUON_PROB),
    (BwdConfig(block_d=16, warps=1, chunk=8, lanes_n=2, seq_split=16, window=1, gluon=1), GLUON_PROB)],
    ids=["fwd-8x2048-pick", "fwd-split", "fwd-state-lanes", "fwd-invariant-B-groups",
         "bwd-batch-1", "bwd-split", "bwd-four-warps", "bwd-invariant-B-groups", "bwd-window-2",
         "bwd-split-windows"])
def test_gluon_configs_cross_compile_to_the_gluon_kernel(cfg, prob, arch):
    """gluon = 1 plans the op's Gluon kernel for a GPU (meta tensors stand for one) in every
    launch (a split sequence's three) and it compiles for sm90 and sm80: unsplit, split, two state
    lanes a channel over one to four warps, a time-invariant B with groups and padded states (the
    backward with the last state's gradient), the backward in windows (one checkpoint a window, or
    whole segments a window). The forward's launches spill nothing; the
    backward's keep a chunk's states in registers and may spill a few bytes (the GPU weighs them)."""
    from autossd.compile import compile_config
    from autossd.ops.mamba1 import bwd
    op = fwd if cfg.op == "sscan_fwd" else bwd
    assert not violations(cfg, arch, prob)
    launches = op.meta_launches(prob, cfg, "cuda")
    assert {ln.kernel for ln in launches} == {f"{cfg.op}_gl"} and len(launches) == (3 if cfg.seq_split > 1 else 1)
    rep = compile_config(cfg, arch, prob)
    assert rep.ok, rep.why()
    assert len(rep.stages) == len(launches)
    if op is fwd:
        assert all(s.spill_bytes == 0 for s in rep.stages)


@pytest.mark.parametrize("form", ["3d", "invariant", "mixed"])
def test_a_gluon_backward_matches_float64_in_every_b_c_form(form):
    """The backward's gluon config in the B/C forms the poisoned test leaves out (groups is
    there): time-invariant rows, a time-varying B with an invariant C and 12 states padded to 16,
    with the last state's gradient and a partial last chunk, in segments; on a GPU the Gluon
    kernel, in the interpreter the tl kernel of the same knobs."""
    from autossd.ops.mamba1 import bwd
    p = _problem(form, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    cfg = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, seq_split=4, gluon=1)
    assert not violations(cfg, "sm90", p)
    t = bwd.tune_inputs(p, DEV, seed=31)
    got = bwd.tune_run(p, cfg, t, poison=True)
    ref = bwd.tune_reference(p, t)
    for k in ref:
        assert rel_err(got[k], ref[k]) < GRAD_TOL["fp32"], (k, rel_err(got[k], ref[k]))


@pytest.mark.parametrize("form", ["3d", "groups", "invariant", "mixed"])
def test_a_gluon_config_matches_float64_in_every_b_c_form(form):
    """A gluon config in each B/C form (time-invariant rows, groups, 12 states padded to 16), with
    the last state and a partial last chunk: on a GPU the Gluon kernel, in the interpreter the tl
    kernel of the same knobs."""
    p = _problem(form, has_D=True, has_z=True, has_delta_bias=True, delta_softplus=True, return_last_state=True)
    cfg = FwdConfig(block_d=4, chunk=16, lanes_n=8, warps=1, seq_split=2, gluon=1, softplus_poly=1)
    assert not violations(cfg, "sm90", p)
    t = fwd.tune_inputs(p, DEV, seed=21)
    out, last = fwd.tune_run(p, cfg, t, poison=True)
    ref = fwd.tune_reference(p, t)
    assert rel_err(out, ref[0]) < tolerance("fp32") and rel_err(last, ref[1]) < tolerance("fp32")


def test_gluon_is_refused_where_its_tiles_do_not_follow_from_the_serial_knobs():
    """gluon = 1 takes one channel per group of lanes_n threads, one time lane, no pipelining, B
    and C as given, no state_in or strided checkpoints, at most 32 steps a chunk; it is not offered
    on AMD; a training forward at the backward's chunk keeps it, window = 2's drops it; the
    interpreter plans the serial kernel of the same config."""
    from autossd.ops.mamba1 import bwd
    p = GLUON_PROB
    cfg = FwdConfig(block_d=64, warps=2, chunk=16, lanes_n=1, gluon=1, softplus_poly=1)
    assert not violations(cfg, "sm90", p) and cfg.replace(scan="assoc").gluon == 0   # a serial knob
    for change in (dict(block_d=32), dict(lanes_t=2), dict(stages=2), dict(bc_f32=1), dict(chunk=64),
                   dict(seq_split=4, state_in=1)):
        assert any("gluon=1" in w for w in violations(cfg.replace(**change), "sm90", p)), change
    assert any("gluon=1 is not offered on gfx942" in w for w in violations(cfg.replace(warps=1, block_d=64), "gfx942", p))
    train = bwd.forward_config(p, BwdConfig(block_d=8, chunk=8, lanes_n=4, warps=1), cfg, "sm90")
    assert (train.gluon, train.chunk) == (1, 8) and not violations(train, "sm90", p)
    two = bwd.forward_config(p, BwdConfig(block_d=8, chunk=8, lanes_n=4, warps=1, window=2), cfg, "sm90")
    assert two.gluon == 0 and two.ckpt_stride == 1 and not violations(two, "sm90", p)
    small = _problem("3d")
    t = fwd.tune_inputs(small, DEV, seed=1)
    g = FwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, gluon=1)
    (ln,) = fwd.plan(small, g, t, fwd.allocate(small, g, t, False, None))
    assert ln.kernel == ("sscan_fwd_gl" if DEV == "cuda" and not render.interpreting() else "sscan_fwd")


def test_the_gluon_backward_is_refused_where_its_registers_or_sums_do_not_fit():
    """The backward's gluon = 1 also keeps a chunk's states in registers (at most 64 a thread),
    gives each thread of its channel sums a (step, state) pair (at least warps x 2 steps at 16
    states) and fits its products in shared memory; it walks windows as the tl kernel does (a
    config whose partials would pass the memory bound keeps it, in windows); the interpreter plans
    the serial kernel of the same config."""
    from autossd.ops.mamba1 import bwd
    p = GLUON_PROB
    cfg = BwdConfig(block_d=16, warps=1, chunk=8, lanes_n=2, gluon=1, softplus_poly=1)
    assert not violations(cfg, "sm90", p)
    for change, words in ((dict(chunk=16), "states a thread"), (dict(block_d=32, lanes_n=1), "states a thread"),
                          (dict(block_d=128, warps=8, lanes_n=2), "for the channel sums"),
                          (dict(block_d=32, warps=2, lanes_n=2, chunk=32), "states a thread")):
        why = violations(cfg.replace(**change), "sm90", p)
        assert any("gluon=1" in w and words in w for w in why), (change, why)
    assert not violations(cfg.replace(window=1), "sm90", p) and not violations(cfg.replace(window=2), "sm90", p)
    long = dataclasses.replace(p, seqlen=1 << 20)
    assert bwd.bounded(long, cfg) == cfg.replace(window=1) and bwd.bounded(p, cfg) == cfg
    small = _problem("3d")
    t = bwd.tune_inputs(small, DEV, seed=1)
    g = BwdConfig(block_d=4, chunk=8, lanes_n=8, warps=1, gluon=1)
    t["ckpt"] = torch.zeros(small.batch, 6, small.dim, small.dstate, device=DEV)
    (ln,) = bwd.plan(small, g, t, bwd.allocate(small, g, t))
    assert ln.kernel == ("sscan_bwd_gl" if DEV == "cuda" and not render.interpreting() else "sscan_bwd")
