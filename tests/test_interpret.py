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
