"""The gated RMSNorm (autossd.ops.norm): the reference against torch's rms_norm, and the Triton
forward and backward (dx, dz, dweight) against float64 autograd through the reference, as
relative L2 errors, in fp32 and bf16 (with an fp32 weight, as Mamba-2 trains), the gate before or
after the norm or absent, one group or several. Small tiles make launches span several row tiles,
several backward programs and, where block_n is below the group, several column chunks; every
buffer the kernels write starts as NaN."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autossd.ops.norm import gated_rmsnorm as gn
from autossd.ops.norm.naive import gated_rmsnorm_ref
from autossd.testing import rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: ~1e-7 measured; bf16: y, dx and dz rounded to bf16 once (~1.7e-3 measured), dweight in
# the weight's fp32. A wrong group, gate or term gives ~1e-1 to 1.
TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-3}


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the kernels write (y, 1/rms, dx, dz, the dweight partials) starts as NaN."""
    monkeypatch.setattr(gn, "_new", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                                            device=device))


def test_reference_is_torch_rms_norm_with_the_gate_where_asked():
    g = torch.Generator().manual_seed(2)
    x, z = (torch.randn(3, 5, 12, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(12, generator=g, dtype=torch.float64)
    eps = 1e-3
    grouped = F.rms_norm(x.unflatten(-1, (3, 4)), (4,), eps=eps).flatten(-2) * w
    assert torch.allclose(gated_rmsnorm_ref(x, w, None, eps, 4), grouped)
    assert torch.allclose(gated_rmsnorm_ref(x, w, z, eps, 4, True), grouped * F.silu(z))
    gated_first = F.rms_norm((x * F.silu(z)).unflatten(-1, (3, 4)), (4,), eps=eps).flatten(-2) * w
    assert torch.allclose(gated_rmsnorm_ref(x, w, z, eps, 4, False), gated_first)
    assert torch.allclose(gated_rmsnorm_ref(x, w, None, eps), F.rms_norm(x, (12,), w, eps=eps))
    assert not torch.allclose(gated_rmsnorm_ref(x, w, None, eps), grouped)   # the groups matter


CASES = [   # dtype, has z, norm_before_gate, group_size (None: one group), block_n
    (torch.float32, True, True, None, 1024),
    (torch.float32, True, False, 8, 1024),
    (torch.float32, True, False, 12, 8),      # each group swept in two column chunks
    (torch.float32, False, True, 12, 1024),
    (torch.bfloat16, True, False, 8, 1024),
    (torch.bfloat16, True, True, None, 16),
]


def _id(case) -> str:
    dtype, has_z, nbg, gs, bn = case
    gate = ("gate-after" if nbg else "gate-before") if has_z else "nogate"
    return f"{str(dtype)[6:]}-{gate}-groups{24 // (gs or 24)}-bn{bn}"


@pytest.mark.parametrize("dtype,has_z,nbg,gs,bn", CASES, ids=[_id(c) for c in CASES])
def test_forward_and_gradients_match_float64(poisoned, dtype, has_z, nbg, gs, bn):
    g = torch.Generator().manual_seed(len(_id((dtype, has_z, nbg, gs, bn))))
    b, l, n = 2, 7, 24
    x = torch.randn(b, l, n, generator=g).to(dtype).to(DEV)
    # z is a slice of zxbcdt in Mamba-2: its row stride is wider than n
    z = torch.randn(b, l, n + 9, generator=g).to(dtype).to(DEV)[..., 3:3 + n] if has_z else None
    w = (1 + 0.3 * torch.randn(n, generator=g)).to(DEV)
    dy = torch.randn(b, l, n, generator=g).to(dtype).to(DEV)
    blocks = gn.Blocks(block_m=4, block_n=bn, bwd_programs=3)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in dict(x=x, weight=w, z=z).items() if v is not None}
    y = gn.gated_rmsnorm(leaves["x"], leaves["weight"], leaves.get("z"), 1e-5, gs, nbg, blocks=blocks)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref = gated_rmsnorm_ref(ref_leaves["x"], ref_leaves["weight"], ref_leaves.get("z"), 1e-5, gs, nbg)
    ref.backward(dy.double())
    errs = {"y": rel_err(y.detach(), ref.detach())}
    for k, v in leaves.items():
        assert v.grad is not None and v.grad.dtype == v.dtype and v.grad.shape == v.shape, k
        assert float(ref_leaves[k].grad.norm()) > 0, k
        errs[k] = rel_err(v.grad, ref_leaves[k].grad)
    print(f"norm {_id((dtype, has_z, nbg, gs, bn))}:", {k: f"{v:.1e}" for k, v in errs.items()})
    assert all(e < TOL[dtype] for e in errs.values()), errs


def test_gradcheck_float64():
    """torch's own finite-difference check, through the Triton kernels in float64, with the
    gate before the norm (Mamba-2's default) and each group swept in two column chunks."""
    g = torch.Generator().manual_seed(4)
    x, z = (torch.randn(3, 8, generator=g, dtype=torch.float64).to(DEV).requires_grad_() for _ in range(2))
    w = (1 + 0.3 * torch.randn(8, generator=g, dtype=torch.float64)).to(DEV).requires_grad_()
    blocks = gn.Blocks(block_n=2)   # one program per group (the interpreter is slow), two chunks
    assert torch.autograd.gradcheck(lambda *a: gn.gated_rmsnorm(*a, 1e-5, 4, False, blocks=blocks), (x, w, z),
                                    fast_mode=True)


def test_bad_arguments_are_named():
    x = torch.randn(2, 8)
    w = torch.randn(8)
    with pytest.raises(ValueError, match=r"weight: expected shape \(8,\)"):
        gn.gated_rmsnorm(x, torch.randn(6))
    with pytest.raises(ValueError, match="z: expected x's shape"):
        gn.gated_rmsnorm(x, w, torch.randn(2, 6))
    with pytest.raises(ValueError, match="group_size: expected a positive int dividing N=8"):
        gn.gated_rmsnorm(x, w, None, 1e-6, 3)
    with pytest.raises(ValueError, match="eps"):
        gn.gated_rmsnorm(x, w, None, -1.0)
    with pytest.raises(TypeError, match="x: expected float16"):
        gn.gated_rmsnorm(x.int(), w)
    with pytest.raises(ValueError, match="Blocks.block_n"):
        gn.Blocks(block_n=100)
