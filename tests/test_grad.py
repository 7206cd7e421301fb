"""Outputs that depend on inputs requiring grad (grad mode on) carry a grad_fn: the drop-in and a
Kernel run the generated backward; an entry point that does not describe its call (ssd_forward)
refuses a backward, naming those inputs, instead of carrying no grad_fn (a training step would
then silently drop every gradient through the SSD). Inference records nothing. The gradients'
values are checked in test_backward.py."""
from __future__ import annotations

import pytest
import torch

import autossd
from autossd.grad import any_requires_grad, requiring_grad
from autossd.ops.ssd.chunk import ssd_forward
from autossd.problem import Problem
from autossd.ops.ssd.fwd_knobs import default_config
from autossd.testing import make_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROB = Problem(1, 96, 2, 16, 16, 1, "fp32", chunk_size=64, has_D=True, has_dt_bias=True, dt_softplus=True,
               has_initial_states=True, return_final_states=True)


@pytest.fixture
def t():
    return make_inputs(PROB, DEV, seed=11)


def _calls(t):
    """The three public entry points, each returning (y, final_states)."""
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True,
              return_final_states=True)
    cfg = default_config("sm80", PROB).replace(chunk_size=64)
    kern = autossd.get_kernel(PROB, "sm90" if DEV == "cuda" else "sm80")
    return {
        "drop-in": lambda x, A: autossd.mamba_chunk_scan_combined(x, t["dt"], A, t["B"], t["C"], 64, **kw),
        "ssd_forward": lambda x, A: ssd_forward(x, t["dt"], A, t["B"], t["C"], 64, config=cfg, **kw),
        "kernel": lambda x, A: kern(x, t["dt"], A, t["B"], t["C"], **kw),
    }


@pytest.mark.parametrize("entry", ["drop-in", "kernel"])
def test_backward_through_the_public_entries_fills_grads(t, entry):
    call = _calls(t)[entry]
    with torch.no_grad():
        y0, f0 = call(t["x"], t["A"])
    x = t["x"].clone().requires_grad_()
    A = t["A"].clone().requires_grad_()     # e.g. -exp(A_log), a parameter
    y, f = call(x, A)
    assert torch.equal(y, y0) and torch.equal(f, f0)        # the same kernels, the same values
    assert y.requires_grad and f.requires_grad
    (y.sum() + f.sum()).backward()
    assert x.grad is not None and x.grad.shape == x.shape and torch.isfinite(x.grad).all()
    assert A.grad is not None and A.grad.shape == A.shape and A.grad.abs().sum() > 0


def test_ssd_forward_still_refuses_and_names_the_inputs(t):
    call = _calls(t)["ssd_forward"]
    x = t["x"].clone().requires_grad_()
    A = t["A"].clone().requires_grad_()
    y, f = call(x, A)
    assert y.requires_grad and f.requires_grad
    with pytest.raises(RuntimeError, match=r"no backward.*x, A require grad"):
        y.sum().backward()
    assert x.grad is None and A.grad is None


@pytest.mark.parametrize("entry", ["drop-in", "ssd_forward", "kernel"])
def test_inference_records_nothing(t, entry):
    call = _calls(t)[entry]
    x = t["x"].clone().requires_grad_()
    with torch.no_grad():
        y, f = call(x, t["A"])
    assert not y.requires_grad and y.grad_fn is None
    with torch.inference_mode():
        y, f = call(x, t["A"])
    assert not y.requires_grad
    y, f = call(t["x"], t["A"])                          # grad mode on, nothing requires grad
    assert y.grad_fn is None and f.grad_fn is None


def test_which_inputs_count():
    x = torch.zeros(2, requires_grad=True)
    assert any_requires_grad(None, 3, torch.zeros(1), x) and not any_requires_grad(None, torch.zeros(1))
    assert requiring_grad({"x": x, "seq_idx": x, "A": None}) == ("x",)   # seq_idx is an index
    with torch.no_grad():
        assert requiring_grad({"x": x}) == ()


def test_varlen_states_carry_no_gradient():
    """As mamba_ssm: varlen_states come back without gradient; y's backward still runs."""
    prob = Problem(1, 96, 2, 16, 16, 1, "fp32", has_seq_idx=True, return_varlen_states=True)
    t = make_inputs(prob, DEV, seed=12)
    B = t["B"].clone().requires_grad_()
    y, varlen = autossd.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], B, t["C"], 64,
                                                  seq_idx=t["seq_idx"], cu_seqlens=t["cu_seqlens"],
                                                  return_varlen_states=True)
    assert not varlen.requires_grad and y.requires_grad
    y.sum().backward()
    assert B.grad is not None and torch.isfinite(B.grad).all()


def test_compiled_call_with_grad_on_runs_forward_and_backward(t):
    """torch.compile traces the custom op's registered backward (autossd::ssd_bwd) with no graph
    break; the compiled backward gives the eager backward's gradients."""
    lin = torch.nn.Linear(16, 16).to(DEV)

    def f(x):
        return autossd.mamba_chunk_scan_combined(lin(x), t["dt"], t["A"], t["B"], t["C"], 64, D=t["D"],
                                                 dt_bias=t["dt_bias"], dt_softplus=True)
    torch._dynamo.reset()
    y = torch.compile(f, backend="aot_eager", fullgraph=True)(t["x"])
    with torch.no_grad():
        ref = f(t["x"])
    assert torch.isfinite(ref).all() and torch.equal(y.detach(), ref)
    assert y.requires_grad
    y.sum().backward()
    g = lin.weight.grad.clone()
    lin.weight.grad = None
    f(t["x"]).sum().backward()
    assert torch.equal(g, lin.weight.grad)


def test_a_strided_last_dimension_trains_like_a_contiguous_one(t):
    """Mamba-2 layers hand the SSD x, B and C split from a transposed conv output (the last
    dimension strided): the drop-in copies them, in training too, and the gradients reach the
    caller's layout equal to those of contiguous inputs."""
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True)
    grads = []
    for strided in (False, True):
        x = (t["x"].transpose(-1, -2).contiguous().transpose(-1, -2) if strided else t["x"].clone()).requires_grad_()
        B = (t["B"].transpose(-1, -2).contiguous().transpose(-1, -2) if strided else t["B"].clone()).requires_grad_()
        assert (x.stride(-1) != 1) == strided
        y = autossd.mamba_chunk_scan_combined(x, t["dt"], t["A"], B, t["C"], 64, **kw)
        (y * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
        grads.append((y.detach(), x.grad, B.grad))
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_chunk_size_the_kernels_lack_runs_forward_and_backward_at_the_nearest(t):
    """chunk_size 100 runs as 128 (the outputs do not depend on it): the forward and every
    gradient are those of a chunk_size 128 call."""
    kw = dict(D=t["D"], dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True,
              return_final_states=True)
    grads = []
    for chunk in (100, 128):
        x = t["x"].clone().requires_grad_()
        A = t["A"].clone().requires_grad_()
        y, f = autossd.mamba_chunk_scan_combined(x, t["dt"], A, t["B"], t["C"], chunk, **kw)
        (y.square().sum() + f.sum()).backward()
        grads.append((y.detach(), f.detach(), x.grad, A.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert grads[0][2].abs().sum() > 0 and grads[0][3].abs().sum() > 0
