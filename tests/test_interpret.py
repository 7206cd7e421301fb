"""autossd's fixes to Triton 3.6's interpreter: bf16 in tl.dot and bf16<->fp16 casts."""
import pytest
import torch
import triton
import triton.language as tl

from autossd import interpret

pytestmark = pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="interpreter only")


@triton.jit
def _dot_cast(a_ptr, b_ptr, o_ptr, h_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    tl.store(o_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))
    tl.store(h_ptr + i[:, None] * N + i[None, :], a.to(tl.float16))


def test_bf16_dot_and_cast_are_right():
    interpret.apply()
    a = torch.randn(16, 16, dtype=torch.bfloat16)
    b = torch.randn(16, 16, dtype=torch.bfloat16)
    o = torch.empty(16, 16)
    h = torch.empty(16, 16, dtype=torch.float16)
    _dot_cast[(1,)](a, b, o, h, 16)
    assert torch.allclose(o, a.float() @ b.float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(h, a.to(torch.float16))


@triton.jit
def _bf16_math(a_ptr, b_ptr, f_ptr, o_ptr, r_ptr, i_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    a = tl.load(a_ptr + ij)
    b = tl.load(b_ptr + ij)
    outs = (a * b, a + b, a - b, tl.maximum(a, b), tl.where(a < b, a, b), -a, a * 3.0,
            tl.fma(a, b, a), a / b, tl.abs(a), tl.load(f_ptr + ij).to(tl.bfloat16),
            tl.cumsum(a, axis=1))
    for k in tl.static_range(len(outs)):
        tl.store(o_ptr + k * N * N + ij, outs[k])
    tl.store(r_ptr + i, tl.sum(a, axis=1))
    tl.store(r_ptr + N + i, tl.max(a, axis=1))
    tl.store(i_ptr + ij, (a * 8.0).to(tl.int32))


def test_bf16_elementwise_reductions_and_casts_are_right():
    """Arithmetic on two bf16 tensors (not only tl.dot) must compute on values, not on the uint16
    bit patterns the interpreter stores: those products wrap around into NaN and Inf."""
    interpret.apply()
    n = 16
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).bfloat16()
    b = torch.randn(n, n, generator=g).bfloat16()
    f = torch.randn(n, n, generator=g) * 3
    o = torch.empty(12, n, n, dtype=torch.bfloat16)
    r = torch.empty(2, n, dtype=torch.bfloat16)
    ints = torch.empty(n, n, dtype=torch.int32)
    _bf16_math[(1,)](a, b, f, o, r, ints, n)
    af, bf = a.float(), b.float()
    # one rounding of an exact (or fp32) result, to nearest-even: torch's bf16 ops, bit for bit
    exact = (a * b, a + b, a - b, torch.maximum(a, b), torch.where(a < b, a, b), -a, a * 3.0,
             (af * bf + af).bfloat16(), a / b, a.abs(), f.bfloat16())
    for k, want in enumerate(exact):
        assert torch.equal(o[k], want), k
    assert torch.allclose(o[11].float(), torch.cumsum(af, 1), rtol=1e-2, atol=2e-2)
    assert torch.allclose(r[0].float(), af.sum(1), rtol=1e-2, atol=2e-2)
    assert torch.equal(r[1], a.max(1).values)
    assert torch.equal(ints, (af * 8).to(torch.int32))


def test_bf16_drop_in_with_several_scan_tiles_per_chunk_has_no_nan():
    """headdim 64, chunk 128: the default sm90 config's chunk scan has two 64-row tiles per chunk,
    and the second scales x's rows by the decay in bf16 (x * v, both bf16) before its MMA (the
    factored decay). Interpreted, that product once multiplied bit patterns: ~9% of y was NaN."""
    import torch.nn.functional as F

    import autossd
    from autossd.ops.ssd.naive import ssd_chunked
    from autossd.testing import rel_err, tolerance

    g = torch.Generator().manual_seed(0)
    b, l, h, p, n, ng = 1, 300, 8, 64, 64, 1
    x = torch.randn(b, l, h, p, generator=g).bfloat16()
    dt = F.softplus(torch.randn(b, l, h, generator=g) - 2)
    A = -torch.exp(0.5 * torch.randn(h, generator=g))
    B = torch.randn(b, l, ng, n, generator=g).bfloat16()
    C = torch.randn(b, l, ng, n, generator=g).bfloat16()
    D = torch.randn(h, generator=g)
    y = autossd.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=128, D=D)
    y_ref = ssd_chunked(x, dt, A, B, C, 128, D=D)[0]
    assert y.dtype == torch.bfloat16 and not torch.isnan(y).any()
    assert rel_err(y, y_ref) <= tolerance("bf16")


def test_a_normal_call_prints_no_floating_point_warnings():
    """The scan computes the decay exp2(dA_t - dA_s) over a whole tile and selects the causal
    part: above the diagonal it overflows, as it does silently on a GPU. A fast decay (dt 5,
    A -20: dA -100 a token) makes that overflow certain; the interpreter must not report it
    (numpy's RuntimeWarning), and the result is the float64 reference's."""
    import warnings

    import autossd
    from autossd.ops.ssd.naive import ssd_chunked
    from autossd.testing import rel_err
    g = torch.Generator().manual_seed(0)
    x, B, C = (torch.randn(1, 100, 2, n, generator=g) for n in (16, 16, 16))
    B, C = B[:, :, :1], C[:, :, :1]
    dt = torch.full((1, 100, 2), 5.0)
    A = torch.tensor([-20.0, -0.5])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = autossd.mamba_chunk_scan_combined(x, dt, A, B, C, 64)
    floating = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert not floating, floating
    assert rel_err(y, ssd_chunked(x, dt, A, B, C, 64)[0]) < 1e-4
