"""The causal depthwise conv1d (autossd.ops.conv1d): the reference against torch's own conv1d, and
the Triton forward and backward (dx, dweight, dbias) against float64 autograd through the
reference, as relative L2 errors, in fp32 and bf16, with and without seq_idx, bias and SiLU, at
widths 2 to 4. Small tiles make every launch span several token and channel tiles (and several
backward programs per row), and every buffer the kernels write starts as NaN."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autossd.ops.conv1d import causal_conv1d as cc
from autossd.ops.conv1d.naive import causal_conv1d_ref
from autossd.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: the kernels accumulate in fp32 (measured ~1e-7); bf16: the output and dx are rounded to
# bf16 once (~1.7e-3 measured); dweight and dbias come in the weight's fp32. A wrong tap or a
# sequence mixed across a boundary gives ~1e-1 to 1.
TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-3}
SMALL = cc.Blocks(block_l=8, block_c=16, num_warps=4, bwd_block_l=8, bwd_block_c=16, bwd_tiles=2)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels write (outputs, dx, the partial sums) starts as NaN."""
    monkeypatch.setattr(cc, "_new", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                            device=device))


def _seq(b, l, cuts):
    s = torch.zeros(b, l, dtype=torch.int32)
    for c in cuts:
        s[0, c:] += 1          # the first row packs len(cuts) + 1 sequences, the others one
    return s.to(DEV)


def _inputs(b, l, c, width, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(b, l, c + 11, generator=g).to(dtype).to(DEV)
    x = wide[..., 5:5 + c]      # xBC is a slice of zxbcdt: token stride != channels
    w = (torch.randn(c, width, generator=g) * 0.5).to(DEV)
    bb = (torch.randn(c, generator=g) * 0.3).to(DEV) if bias else None
    dy = torch.randn(b, l, c, generator=g).to(dtype).to(DEV)
    return x, w, bb, dy


def test_reference_is_torch_conv1d():
    """Without seq_idx the reference is torch's depthwise conv1d cut to causal; with seq_idx it is
    that conv run on each packed sequence alone."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64)

    def torch_conv(xx):
        return F.conv1d(xx.transpose(1, 2), w[:, None, :], b, padding=3, groups=5)[..., :xx.shape[1]].transpose(1, 2)
    assert torch.allclose(causal_conv1d_ref(x, w, b), torch_conv(x), rtol=1e-12, atol=1e-12)
    assert torch.allclose(causal_conv1d_ref(x, w, b, activation="silu"), F.silu(torch_conv(x)))
    seq = torch.tensor([[0] * 4 + [1] * 7 + [2] * 2] * 2)
    parts = [torch_conv(x[:, a:e]) for a, e in ((0, 4), (4, 11), (11, 13))]
    assert torch.allclose(causal_conv1d_ref(x, w, b, seq), torch.cat(parts, 1), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(causal_conv1d_ref(x, w, b), torch.cat(parts, 1))   # the boundaries matter


CASES = [   # dtype, width, activation, seq_idx cuts (None: no seq_idx), bias
    (torch.float32, 4, "silu", (6, 13), True),
    (torch.float32, 3, None, (9,), False),
    (torch.float32, 2, "swish", None, True),
    (torch.bfloat16, 4, "silu", (6, 13), True),
    (torch.bfloat16, 3, None, None, True),
]


def _id(case) -> str:
    dtype, width, act, cuts, bias = case
    return (f"{str(dtype)[6:]}-w{width}-{act or 'noact'}-{'seq' if cuts else 'noseq'}"
            f"-{'bias' if bias else 'nobias'}")


@pytest.mark.parametrize("dtype,width,act,cuts,bias", CASES, ids=[_id(c) for c in CASES])
def test_forward_and_gradients_match_float64(poisoned, dtype, width, act, cuts, bias):
    b, l, c = 2, 19, 24
    x, w, bb, dy = _inputs(b, l, c, width, dtype, bias, seed=width + 7 * len(cuts or ()))
    seq = _seq(b, l, cuts) if cuts is not None else None
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, bb) if t is not None]
    xg, wg = leaves[0], leaves[1]
    bg = leaves[2] if bias else None
    out = cc.causal_conv1d(xg, wg, bg, seq, act, blocks=SMALL)
    assert out.dtype == dtype and out.shape == (b, l, c) and out.is_contiguous()
    out.backward(dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = causal_conv1d_ref(ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias else None, seq, act)
    ref.backward(dy.double())
    errs = {"out": rel_err(out.detach(), ref.detach())}
    for name, got, want in zip(("x", "weight", "bias"), leaves, ref_leaves):
        assert got.grad is not None and got.grad.dtype == got.dtype and got.grad.shape == got.shape, name
        assert float(want.grad.norm()) > 0, name
        errs[name] = rel_err(got.grad, want.grad)
    print(f"conv1d {_id((dtype, width, act, cuts, bias))}:", {k: f"{v:.1e}" for k, v in errs.items()})
    bound = TOL[dtype]
    assert all(e < bound for e in errs.values()), errs


def test_packed_sequences_see_nothing_of_each_other():
    """The kernel's output for a sequence packed after another equals its output alone, and the
    gradient of a sequence's loss reaches no token of its neighbours."""
    x, w, bb, _ = _inputs(1, 16, 24, 4, torch.float32, True, seed=3)
    seq = _seq(1, 16, (5,))
    xg = x.detach().clone().requires_grad_()
    out = cc.causal_conv1d(xg, w, bb, seq, "silu")
    alone = cc.causal_conv1d(x[:, 5:], w, bb, None, "silu")
    assert torch.allclose(out[:, 5:], alone, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(cc.causal_conv1d(x, w, bb, None, "silu")[:, 5:], alone, rtol=1e-3, atol=1e-3)
    out[:, 5:].sum().backward()
    assert torch.all(xg.grad[:, :5] == 0) and torch.all(xg.grad[:, 5:] != 0)


def test_gradcheck_float64():
    """torch's own finite-difference check, through the Triton kernels in float64."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 7, 3, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    w = torch.randn(3, 3, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    b = torch.randn(3, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    seq = _seq(1, 7, (4,))
    assert torch.autograd.gradcheck(lambda *a: cc.causal_conv1d(*a, seq, "silu"), (x, w, b), fast_mode=True)


def test_bad_arguments_are_named():
    x = torch.randn(1, 8, 6)
    w = torch.randn(6, 4)
    with pytest.raises(ValueError, match="weight: expected"):
        cc.causal_conv1d(x, torch.randn(6, 5))
    with pytest.raises(ValueError, match="weight: expected"):
        cc.causal_conv1d(x, torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"bias: expected shape \(6,\)"):
        cc.causal_conv1d(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="seq_idx: expected shape"):
        cc.causal_conv1d(x, w, None, torch.zeros(1, 7, dtype=torch.int32))
    with pytest.raises(TypeError, match="seq_idx: expected an int32"):
        cc.causal_conv1d(x, w, None, torch.zeros(1, 8))
    with pytest.raises(ValueError, match="activation: expected"):
        cc.causal_conv1d(x, w, None, None, "relu")
    with pytest.raises(ValueError, match="x: expected"):
        cc.causal_conv1d(x[0], w)
    with pytest.raises(ValueError, match="Blocks.block_l"):
        cc.Blocks(block_l=12)
