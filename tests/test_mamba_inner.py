"""autossd.mamba_inner_fn, the Mamba-1 mixer after its input projection (mamba_ssm's training
path): its output and the gradient of every tensor input against float64 autograd through the
plain-torch reference (mamba_inner_ref: the naive conv1d, explicit projections, a token-by-token
scan), as relative L2 errors, in fp32. The cases cover Mamba's own call (conv and projection
biases, D, delta_bias, softplus), FalconMamba's (B, C and dt RMS-normalized with weights, here not
ones so that their use shows), B given (4-D) or from the projection with B_proj_bias and
C_proj_bias, widths 2 to 4. Buffers the conv1d writes start as NaN. Also the decode form of the
conv1d (causal_conv1d_update) against transformers' definition, and bad arguments named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autossd
from autossd.ops.conv1d import causal_conv1d as cc
from autossd.ops.mamba1.inner import mamba_inner_ref
from autossd.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the conv accumulates in fp32, the matmuls and the scan in fp32 (~1e-6 expected); a wrong
# split, tap, norm axis or group gives ~1e-1 to 1.
TOL = 1e-4


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(cc, "_new", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                            device=device))


def _make(b=2, l=14, dim=24, n=8, rank=4, dm=16, width=4, conv_bias=True, out_bias=True, rms=False,
          given_B=False, proj_bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g) * scale + shift
    xz = rnd(b, 2 * dim + 6, l)[:, 3:3 + 2 * dim]   # a slice: channel stride != seqlen
    rows = rank + n * (1 if given_B else 2)
    t = dict(xz=xz, conv1d_weight=rnd(dim, 1, width, scale=0.5), conv1d_bias=rnd(dim, scale=0.3) if conv_bias else None,
             x_proj_weight=rnd(rows, dim, scale=dim ** -0.5), delta_proj_weight=rnd(dim, rank, scale=rank ** -0.5),
             out_proj_weight=rnd(dm, dim, scale=dim ** -0.5), out_proj_bias=rnd(dm) if out_bias else None,
             A=-torch.rand(dim, n, generator=g) * 2 - 0.3, D=rnd(dim), delta_bias=rnd(dim, scale=0.3, shift=-1.5))
    if given_B:   # the 4-D form; its one group matches C's from the projection (the scan, as mamba_ssm's,
        t["B"] = rnd(b, 1, n, l)   # takes B and C with the same group count)
    if proj_bias:
        t["C_proj_bias"] = rnd(n, scale=0.5)
        if not given_B:
            t["B_proj_bias"] = rnd(n, scale=0.5)
    if rms:
        t.update(b_rms_weight=rnd(n, scale=0.2, shift=1.0), c_rms_weight=rnd(n, scale=0.2, shift=1.0),
                 dt_rms_weight=rnd(dim, scale=0.2, shift=1.0))
    return {k: v.to(DEV) for k, v in t.items() if v is not None}   # absent: the signature's default


REQUIRED = dict(conv1d_bias=None, out_proj_bias=None)   # positional in the signature: None where absent
CASES = {
    "mamba": (dict(), dict()),
    "falcon-rms-nobias": (dict(rms=True, conv_bias=False, out_bias=False, width=3), dict(b_c_dt_rms_eps=1e-5)),
    "given-B-4d-proj-bias-w2": (dict(given_B=True, proj_bias=True, width=2, b=1), dict()),
    "proj-bias-rms": (dict(proj_bias=True, rms=True, dim=16, n=4), dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_output_and_every_gradient_match_float64(poisoned, case):
    make_kw, call_kw = CASES[case]
    t = _make(seed=len(case), **make_kw)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    y = autossd.mamba_inner_fn(**{**REQUIRED, **leaves}, **call_kw)
    b, _, l = t["xz"].shape
    assert y.shape == (b, l, t["out_proj_weight"].shape[0]) and y.dtype == torch.float32
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(DEV)
    (y * dy).sum().backward()
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in t.items()}
    ry = mamba_inner_ref(**{**REQUIRED, **ref_leaves}, **call_kw)
    (ry * dy.double()).sum().backward()
    errs = {"out": rel_err(y.detach(), ry.detach())}
    for k, v in leaves.items():
        assert v.grad is not None and v.grad.shape == v.shape, k
        assert float(ref_leaves[k].grad.norm()) > 0, f"{k}: zero reference gradient, the check would be empty"
        errs[k] = rel_err(v.grad, ref_leaves[k].grad)
    print(f"mamba_inner {case}:", {k: f"{e:.1e}" for k, e in errs.items()})
    bad = {k: e for k, e in errs.items() if not e < TOL}
    assert not bad, f"{case}: off (bound {TOL}): {errs}"


def test_reference_normalizes_as_falcon_mamba_weightless_norm():
    """With weights of ones the norms are FalconMamba's weightless RMSNorm of B and C (over dstate)
    and of delta (over dim, after the dt projection, as mamba_ssm places it): the reference
    equals a hand computation of that, and differs from the un-normalized call."""
    t = {k: v.double() for k, v in _make(b=1, l=5, dim=8, n=4, rank=2, dm=4, seed=3).items()}
    dim, n = 8, 4
    ones = dict(b_rms_weight=torch.ones(n, dtype=torch.float64), c_rms_weight=torch.ones(n, dtype=torch.float64),
                dt_rms_weight=torch.ones(dim, dtype=torch.float64))
    got = mamba_inner_ref(**t, **ones, b_c_dt_rms_eps=1e-6)
    plain = mamba_inner_ref(**t)

    def norm(v):   # (..., features)
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
    from autossd.ops.conv1d.naive import causal_conv1d_ref
    x, z = t["xz"][:, :dim].transpose(1, 2), t["xz"][:, dim:]
    u = causal_conv1d_ref(x, t["conv1d_weight"][:, 0], t["conv1d_bias"], activation="silu")   # (b, l, d)
    dbl = u @ t["x_proj_weight"].T
    delta = norm(dbl[..., :2] @ t["delta_proj_weight"].T)
    B, C = norm(dbl[..., 2:6]), norm(dbl[..., 6:10])
    from autossd.ops.mamba1.naive import selective_scan_ref   # float64 in, float64 out
    y = selective_scan_ref(u.transpose(1, 2), delta.transpose(1, 2), t["A"], B.transpose(1, 2),
                           C.transpose(1, 2), D=t["D"], z=z, delta_bias=t["delta_bias"], delta_softplus=True)
    want = y.transpose(1, 2) @ t["out_proj_weight"].T + t["out_proj_bias"]
    assert rel_err(got, want) < 1e-12
    assert rel_err(plain, want) > 1e-3


def _update_ref(x, state, w, b, act):
    """transformers' Mamba decode conv: the state then the tokens, the conv's last outputs, the
    state's last state_len inputs kept."""
    T, S = x.shape[-1], state.shape[-1]
    window = torch.cat([state, x], -1)
    state.copy_(window[..., -S:])
    out = F.conv1d(window, w[:, None], b, groups=x.shape[1])[..., -T:]
    return F.silu(out) if act else out


@pytest.mark.parametrize("T,S,width,bias,act", [(1, 4, 4, True, "silu"), (1, 3, 4, False, None),
                                                (3, 5, 2, True, "silu"), (2, 2, 3, False, "swish")])
def test_conv1d_update_matches_the_concatenated_conv(poisoned, T, S, width, bias, act):
    g = torch.Generator().manual_seed(T * 10 + S)
    x = torch.randn(3, 37, T, generator=g).to(DEV)
    state = torch.randn(3, 37, S + 2, generator=g).to(DEV)[..., 1:1 + S]   # strided, as a cache slice may be
    w = (torch.randn(37, width, generator=g) * 0.5).to(DEV)
    bb = torch.randn(37, generator=g).to(DEV) if bias else None
    ref_state = state.double().clone()
    want = _update_ref(x.double(), ref_state, w.double(), bb.double() if bias else None, act)
    got = cc.causal_conv1d_update(x, state, w, bb, activation=act, block_c=16)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, want) < 1e-6
    assert rel_err(state, ref_state) < 1e-7
    one = torch.randn(3, 37, generator=g).to(DEV)   # (batch, dim): one token, no seqlen axis
    ref_state = state.double().clone()
    want = _update_ref(one.double()[..., None], ref_state, w.double(), bb.double() if bias else None, act)[..., 0]
    assert rel_err(cc.causal_conv1d_update(one, state, w, bb, activation=act), want) < 1e-6
    assert rel_err(state, ref_state) < 1e-7


def _bad(match, exc=ValueError, **over):
    t = _make(b=1, l=4, dim=8, n=4, rank=2, dm=4)
    t.update(over)
    with pytest.raises(exc, match=match):
        autossd.mamba_inner_fn(**{**REQUIRED, **{k: v for k, v in t.items() if v is not None}})


def test_bad_arguments_are_named():
    _bad("xz: expected non-empty", xz=torch.randn(1, 15, 4))
    _bad("A: expected a real", A=torch.randn(9, 4))
    _bad("conv1d_weight: expected", conv1d_weight=torch.randn(8, 1, 5))
    _bad("x_proj_weight: expected", x_proj_weight=torch.randn(9, 8))
    _bad("delta_proj_weight: expected", delta_proj_weight=torch.randn(7, 2))
    _bad("out_proj_weight: expected", out_proj_weight=torch.randn(4, 7))
    _bad("dt_rms_weight: expected shape", dt_rms_weight=torch.ones(4))
    _bad("B: expected input-dependent", B=torch.randn(1, 4, 5), x_proj_weight=torch.randn(6, 8))
    _bad("checkpoint_lvl", checkpoint_lvl=2)
    _bad("x_proj_weight: torch.float64", TypeError, x_proj_weight=torch.randn(10, 8, dtype=torch.float64))
    _bad("xz: expected float16", TypeError, xz=torch.ones(1, 16, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="conv_state: expected"):
        cc.causal_conv1d_update(torch.randn(2, 8), torch.randn(2, 8, 2), torch.randn(8, 4))
    with pytest.raises(ValueError, match="weight: expected"):
        cc.causal_conv1d_update(torch.randn(2, 8), torch.randn(2, 8, 3), torch.randn(8, 5))
