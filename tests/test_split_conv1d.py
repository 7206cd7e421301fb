"""autossd.mamba_split_conv1d_scan_combined, the training path of Mamba-2 (conv1d, SSD, gated
RMSNorm, output projection): its output and final states, and the gradient of every tensor input,
against float64 autograd through the plain-torch references (mamba_split_conv1d_scan_ref: the
naive conv1d, the token-by-token SSD, the naive norm), as relative L2 errors, in fp32 and bf16.
The cases cover D of shape (nheads,) and (nheads, headdim), the norm with the gate before or
after it and absent (z then gates inside the SSD), one and two groups, the projection with and
without bias and absent, seq_idx, initial states, dt_limit, every activation and the gated-MLP
part of zxbcdt. Buffers the conv1d and the norm write start as NaN."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import autossd
from autossd.ops.conv1d import causal_conv1d as cc
from autossd.ops.norm import gated_rmsnorm as gn
from autossd.ops.ssd.split_conv1d import mamba_split_conv1d_scan_ref
from autossd.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 measures ~1e-6 on every output and gradient. bf16: the conv output, the SSD and the norm
# each round to bf16 and the SSD's own bf16 gradients reach ~1e-2 (test_backward); measured here
# up to ~7e-3 (dt_bias). A wrong split, tap, gate or group gives ~1e-1 to 1.
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}


@pytest.fixture
def poisoned(monkeypatch):
    def nan(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(cc, "_new", nan)
    monkeypatch.setattr(gn, "_new", nan)


def _make(dtype, b=2, l=24, h=4, p=8, n=8, g=1, width=4, d_mlp=0, D_hdim=False, conv_bias=True, norm=True,
          outproj="bias", init=True, seed=0):
    """Fresh random inputs: zxbcdt in `dtype`, parameters in fp32 (as Mamba-2 keeps them), the
    projection's weight in `dtype` (an fp32 one would need autocast, as in mamba_ssm)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=gen) * scale + shift
    dim, conv = h * p, h * p + 2 * g * n
    zx = rnd(b, l, 2 * d_mlp + 2 * dim + 2 * g * n + h)
    zx[..., -h:] = zx[..., -h:] * 0.5 - 2.0        # dt' = softplus(dt + dt_bias) ~ 0.15: states last ~10 tokens
    t = dict(zxbcdt=zx.to(dtype), conv1d_weight=rnd(conv, width, scale=0.4),
             conv1d_bias=rnd(conv, scale=0.3) if conv_bias else None, dt_bias=rnd(h, scale=0.3),
             A=-torch.rand(h, generator=gen) - 0.5, D=rnd(h, p) if D_hdim else rnd(h),
             initial_states=rnd(b, h, p, n) if init else None,
             rmsnorm_weight=rnd(dim, scale=0.2, shift=1.0) if norm else None,
             outproj_weight=(rnd(12, d_mlp + dim, scale=0.25)).to(dtype) if outproj else None,
             outproj_bias=rnd(12).to(dtype) if outproj == "bias" else None)
    return {k: v.to(DEV) if v is not None else None for k, v in t.items()}


def _seq_idx(b, l, cut):
    s = torch.zeros(b, l, dtype=torch.int32)
    s[0, cut:] = 1        # row 0 packs two sequences
    return s.to(DEV)


CASES = {
    # Mamba-2's defaults: D per head, the gate before the norm, conv bias, projection with bias
    "fp32-mamba2": (torch.float32, dict(), dict(seq_idx=11, return_final_states=True, norm_before_gate=False)),
    "fp32-Dhdim-gate-after-2groups": (
        torch.float32, dict(b=1, D_hdim=True, g=2, width=3, conv_bias=False, outproj=None, init=False),
        dict(norm_before_gate=True, dt_limit=(0.05, 0.5), activation="swish", ngroups=2)),
    "fp32-nonorm-mlp-noact": (torch.float32, dict(b=1, norm=False, d_mlp=4, outproj="nobias", width=2),
                              dict(activation=None, return_final_states=True, seq_idx=7)),
    "bf16-mamba2": (torch.bfloat16, dict(), dict(seq_idx=11, return_final_states=True, norm_before_gate=False)),
    "bf16-Dhdim-nonorm": (torch.bfloat16, dict(b=1, D_hdim=True, norm=False, outproj=None),
                          dict(return_final_states=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_every_gradient_match_float64(poisoned, case):
    dtype, make_kw, call_kw = CASES[case]
    t = _make(dtype, seed=len(case), **make_kw)
    b, l = t["zxbcdt"].shape[:2]
    kw = dict(call_kw)
    if "seq_idx" in kw:
        kw["seq_idx"] = _seq_idx(b, l, kw["seq_idx"])
    if not make_kw.get("D_hdim"):
        kw["headdim"] = 8
    final = kw.get("return_final_states", False)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if v is not None}
    args = {k: leaves.get(k) for k in t}

    out = autossd.mamba_split_conv1d_scan_combined(**args, chunk_size=64, **kw)
    y, fs = out if final else (out, None)
    assert y.dtype == dtype
    gen = torch.Generator().manual_seed(99)
    dy = torch.randn(y.shape, generator=gen).to(dtype).to(DEV)
    dfs = torch.randn(fs.shape, generator=gen).to(DEV) if final else None
    ((y.float() * dy.float()).sum() + ((fs * dfs).sum() if final else 0)).backward()

    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref = mamba_split_conv1d_scan_ref(**{k: ref_leaves.get(k) for k in t}, chunk_size=64, **kw)
    ry, rfs = ref if final else (ref, None)
    assert ry.shape == y.shape
    ((ry * dy.double()).sum() + ((rfs * dfs.double()).sum() if final else 0)).backward()

    errs = {"out": rel_err(y.detach(), ry.detach())}
    if final:
        assert fs.shape == rfs.shape
        errs["final_states"] = rel_err(fs.detach(), rfs.detach())
    for k, v in leaves.items():
        assert v.grad is not None and v.grad.dtype == v.dtype and v.grad.shape == v.shape, k
        assert float(ref_leaves[k].grad.norm()) > 0, f"{k}: zero reference gradient, the check would be empty"
        errs[k] = rel_err(v.grad, ref_leaves[k].grad)
    print(f"split_conv1d {case}:", {k: f"{e:.1e}" for k, e in errs.items()})
    bad = {k: e for k, e in errs.items() if not e < TOL[dtype]}
    assert not bad, f"{case}: off (bound {TOL[dtype]}): {errs}"


def test_the_conv_output_is_recomputed_not_kept_for_the_backward(monkeypatch):
    """The SSD's inputs x, B and C are the conv's output: it is freed after the forward, and the
    conv runs again when the backward needs it."""
    import gc
    import weakref
    outs, fwd = [], cc.causal_conv1d_fwd

    def spy(*a, **k):
        out = fwd(*a, **k)
        outs.append(weakref.ref(out))
        return out
    monkeypatch.setattr(cc, "causal_conv1d_fwd", spy)
    t = _make(torch.float32, b=1, l=20, seed=5)
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if v is not None}
    y = autossd.mamba_split_conv1d_scan_combined(**leaves, chunk_size=64, headdim=8)
    gc.collect()
    assert len(outs) == 1 and outs[0]() is None, "the conv's output outlived the forward"
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(DEV)
    (y * dy).sum().backward()
    assert len(outs) == 2, "the backward did not run the conv again"
    assert all(v.grad is not None and torch.isfinite(v.grad).all() for v in leaves.values())
    # (that these gradients are right: test_outputs_and_every_gradient_match_float64, same path)


def test_exported_and_inference_gives_the_training_output():
    assert "mamba_split_conv1d_scan_combined" in autossd.__all__
    t = _make(torch.float32, b=1, l=9, seed=3, outproj=None)
    with torch.no_grad():
        y = autossd.mamba_split_conv1d_scan_combined(**t, chunk_size=64, headdim=8)
    assert not y.requires_grad and y.shape == (1, 9, 32)
    z = t["zxbcdt"].clone().requires_grad_()
    y2 = autossd.mamba_split_conv1d_scan_combined(**{**t, "zxbcdt": z}, chunk_size=64, headdim=8)
    assert y2.requires_grad and torch.equal(y, y2.detach())


def _bad(match, exc=ValueError, **over):
    t = _make(torch.float32, b=1, l=4, seed=5)
    kw = dict(chunk_size=64, headdim=8)
    kw.update({k: v for k, v in over.items() if k in ("headdim", "ngroups", "activation", "seq_idx", "rmsnorm_eps")})
    t.update({k: v for k, v in over.items() if k in t})
    with pytest.raises(exc, match=match):
        autossd.mamba_split_conv1d_scan_combined(**t, **kw)


def test_bad_arguments_are_named():
    _bad("zxbcdt: last dimension 80 does not split", zxbcdt=torch.randn(1, 4, 80))
    _bad("zxbcdt: last dimension 91 does not split", zxbcdt=torch.randn(1, 4, 91))   # odd gated-MLP part
    _bad("zxbcdt: expected 3 dimensions", zxbcdt=torch.randn(4, 84))
    _bad("zxbcdt: expected float16", TypeError, zxbcdt=torch.randn(1, 4, 84, dtype=torch.float64))
    _bad("conv1d_weight: expected", conv1d_weight=torch.randn(47, 4))
    _bad("conv1d_weight: expected width 2, 3 or 4", conv1d_weight=torch.randn(48, 5))
    _bad(r"conv1d_bias: expected shape \(48,\)", conv1d_bias=torch.randn(32))
    _bad("activation: expected one of", activation="relu")
    _bad("activation: expected one of", activation="identity")
    _bad(r"headdim: required when D has shape \(nheads,\)", headdim=None)
    _bad("headdim: 4 disagrees with D's shape", D=torch.randn(4, 8), headdim=4)
    _bad(r"D: expected shape \(nheads,\) or \(nheads, headdim\)", D=torch.randn(4, 8, 1))
    _bad(r"A: expected shape \(nheads,\) = \(4,\)", A=-torch.rand(3))
    _bad(r"dt_bias: expected shape \(nheads,\) = \(4,\)", dt_bias=torch.randn(4, 1))
    _bad("ngroups: expected a positive int dividing nheads=4", ngroups=3)
    _bad(r"rmsnorm_weight: expected shape \(dim,\) = \(32,\)", rmsnorm_weight=torch.randn(16))
    _bad(r"outproj_weight: expected \(out_dim, 32\)", outproj_weight=torch.randn(12, 16))
    _bad(r"outproj_bias: expected shape \(12,\)", outproj_bias=torch.randn(11))
    _bad("outproj_bias: given without outproj_weight", outproj_weight=None)
    _bad("seq_idx: expected shape", seq_idx=torch.zeros(1, 5, dtype=torch.int32))
    _bad("conv1d_weight: expected a floating-point tensor", TypeError, conv1d_weight=torch.ones(48, 4, dtype=torch.int32))
    _bad("conv1d_bias: expected a floating-point tensor", TypeError, conv1d_bias=torch.ones(48, dtype=torch.int32))
    _bad("rmsnorm_weight: expected a floating-point tensor", TypeError, rmsnorm_weight=torch.ones(32, dtype=torch.int32))
    _bad("outproj_weight: expected a floating-point tensor", TypeError,
         outproj_weight=torch.ones(12, 32, dtype=torch.int32))
    _bad("rmsnorm_eps: expected a non-negative float", rmsnorm_eps="1e-6")
    _bad("zxbcdt: expected at least one sequence", zxbcdt=torch.randn(1, 0, 84))


_COMPILE = r'''
import inspect, json
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from autossd.compile import _nvidia_resources
from autossd.ops.conv1d import causal_conv1d as cc
from autossd.ops.norm import gated_rmsnorm as gn

POINTERS = dict(X="*bf16", Out="*bf16", DY="*bf16", DX="*bf16", Z="*bf16", Y="*bf16", DZ="*bf16", W="*fp32",
                Bias="*fp32", Seq="*i32", DWp="*fp32", DBp="*fp32", Rstd="*fp32")

def build(fn, consts, warps, target):
    sig = {n: "constexpr" if n in consts else POINTERS.get(n, "fp32" if n == "eps" else "i32")
           for n in inspect.signature(fn.fn).parameters}
    k = triton.compile(ASTSource(fn, sig, consts, {}), target=target, options=dict(num_warps=warps))
    return _nvidia_resources(k.asm["cubin"])   # (registers, spilled bytes)

out = {}
d = cc.DEFAULT
target = GPUTarget("cuda", 90, 32)
bl, bc = cc._tiles(2048, 5376, d.bwd_block_l, d.bwd_block_c)
out["conv bwd"] = build(cc._conv_bwd, dict(WIDTH=4, WPAD=4, HAS_BIAS=True, HAS_SEQ=True, SILU=True, ACC=tl.float32,
                                           BLOCK_L=bl, BLOCK_C=bc), d.bwd_warps, target)
bm, bn, warps = gn._tile(16384, 5120, gn.DEFAULT)   # Mamba-2 2.7b's one group of 5120
out["norm bwd"] = build(gn._norm_bwd, dict(HAS_Z=True, NORM_BEFORE_GATE=False, ACC=tl.float32, BLOCK_M=bm, BLOCK_N=bn,
                                           ONE_CHUNK=5120 <= bn), warps, target)
print(json.dumps(out))
'''


def test_the_triton_kernels_cross_compile_without_spills():
    """The backward kernels of the conv1d and the norm (the ones that hold the most: 2 * width - 1
    shifted tiles of x; the gate's terms), at their default tiles, bf16 with every option on, at
    Mamba-2 2.7b's widths, compile for sm90 (in a fresh interpreter: the CPU interpreter cannot
    compile) with no register spills. Two kernels only: each compile takes seconds."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report) == 2
    spills = {k: v for k, v in report.items() if v[1]}
    assert not spills, f"(registers, spilled bytes): {report}"
