"""Input validation: every bad call names the argument and what was expected."""
import math

import pytest
import torch

from autossd.problem import Problem, from_args, supported_chunk


def _args(b=2, l=10, h=4, p=8, n=16, g=2, dtype=torch.float16):
    return dict(x=torch.randn(b, l, h, p, dtype=dtype), dt=torch.rand(b, l, h), A=-torch.rand(h),
                B=torch.randn(b, l, g, n, dtype=dtype), C=torch.randn(b, l, g, n, dtype=dtype),
                chunk_size=64)


def test_valid_call_describes_problem():
    a = _args()
    prob = from_args(**a, D=torch.randn(4, 8), z=torch.randn(2, 10, 4, 8, dtype=torch.float16),
                     dt_bias=torch.randn(4), dt_softplus=True, dt_limit=(0.0, 1.0),
                     return_final_states=True)
    assert prob == Problem(batch=2, seqlen=10, nheads=4, headdim=8, dstate=16, ngroups=2, dtype="fp16",
                           chunk_size=64, has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True,
                           dt_softplus=True, has_dt_limit=True, return_final_states=True)


def _bad(match, exc=ValueError, **over):
    a = _args()
    kw = {}
    for k, v in over.items():
        (a if k in a else kw)[k] = v
    with pytest.raises(exc, match=match):
        from_args(**a, **kw)


@pytest.mark.parametrize("over,match,exc", [
    (dict(x=torch.randn(2, 10, 4)), r"^x: expected 4 dims", ValueError),
    (dict(x=torch.randn(2, 0, 4, 8, dtype=torch.float16)), r"^x: sequence length is 0", ValueError),
    (dict(x=[1, 2]), r"^x: expected a torch.Tensor", TypeError),
    (dict(dt=torch.rand(2, 11, 4)), r"^dt: expected shape \(2, 10, 4\)", ValueError),
    (dict(dt=torch.rand(3, 10, 4)), r"^dt: expected shape", ValueError),
    (dict(A=-torch.rand(5)), r"^A: expected shape \(4,\)", ValueError),
    (dict(B=torch.randn(2, 9, 2, 16, dtype=torch.float16)), r"^B: expected shape \(2, 10, \*, \*\)", ValueError),
    (dict(C=torch.randn(2, 10, 2, 8, dtype=torch.float16)), r"^C: expected shape \(2, 10, 2, 16\)", ValueError),
    (dict(B=torch.randn(2, 10, 3, 16, dtype=torch.float16), C=torch.randn(2, 10, 3, 16, dtype=torch.float16)),
     r"^B: nheads=4 is not divisible by ngroups=3", ValueError),
    (dict(B=torch.randn(2, 10, 2, 16, dtype=torch.bfloat16)), r"^B: dtype torch.bfloat16 differs from x", TypeError),
    (dict(x=torch.randn(2, 10, 4, 8, dtype=torch.float64)), r"^x: expected float16, bfloat16 or float32", TypeError),
    (dict(dt=torch.rand(2, 10, 4, dtype=torch.float64)), r"^dt: expected float16", TypeError),
    (dict(x=torch.randint(0, 3, (2, 10, 4, 8))), r"^x: expected float16", TypeError),
    (dict(D=torch.randn(3)), r"^D: expected shape \(4,\) or \(4, 8\)", ValueError),
    (dict(z=torch.randn(2, 10, 4, 8)), r"^z: dtype torch.float32 differs", TypeError),
    (dict(z=torch.randn(2, 10, 4, 7, dtype=torch.float16)), r"^z: expected shape", ValueError),
    (dict(dt_bias=torch.randn(4, 1)), r"^dt_bias: expected 1 dims", ValueError),
    (dict(initial_states=torch.randn(2, 4, 8, 15)), r"^initial_states: expected shape \(2, 4, 8, 16\)", ValueError),
    (dict(seq_idx=torch.zeros(2, 10)), r"^seq_idx: expected int32", TypeError),
    (dict(seq_idx=torch.zeros(2, 9, dtype=torch.int32)), r"^seq_idx: expected shape", ValueError),
    (dict(cu_seqlens=torch.tensor([0, 10], dtype=torch.int32), seq_idx=torch.zeros(2, 10, dtype=torch.int32),
          return_varlen_states=True), r"^cu_seqlens: expected batch 1", ValueError),
    (dict(return_varlen_states=True), r"^cu_seqlens: required", ValueError),
    (dict(chunk_size=0), r"^chunk_size: expected a positive int", ValueError),
    (dict(chunk_size=-64), r"^chunk_size: expected a positive int", ValueError),
    (dict(chunk_size=True), r"^chunk_size: expected a positive int", ValueError),
    (dict(chunk_size=64.0), r"^chunk_size: expected", ValueError),
    (dict(dt_limit=(1.0, 0.5)), r"^dt_limit: expected lo <= hi", ValueError),
    (dict(dt_limit=(0.0, math.nan)), r"^dt_limit: expected lo <= hi", ValueError),
    (dict(dt_limit=3.0), r"^dt_limit: expected a pair", ValueError),
    (dict(state_dtype=torch.int8), r"^state_dtype: expected", TypeError),
    (dict(x=torch.randn(2, 10, 8, 4, dtype=torch.float16).transpose(2, 3)), r"^x: last dimension is not contiguous", ValueError),
    (dict(C=torch.randn(2, 10, 16, 2, dtype=torch.float16).transpose(2, 3)), r"^C: last dimension is not contiguous", ValueError),
    (dict(dt=torch.rand(2, 10, 4, device="meta")), r"^dt: on meta, but x is on cpu", ValueError),
])
def test_bad_input_names_argument(over, match, exc):
    _bad(match, exc, **over)


@pytest.mark.parametrize("asked,runs", [(64, 64), (256, 256), (1, 64), (32, 64), (90, 64), (100, 128),
                                         (200, 256), (512, 256), (4096, 256)])
def test_any_positive_chunk_size_runs_at_the_nearest_supported_one(asked, runs):
    import numpy as np
    assert supported_chunk(asked) == runs == supported_chunk(np.int64(asked))
    assert from_args(**{**_args(), "chunk_size": asked}).chunk_size == runs


def test_problem_flags_take_bools_only():
    with pytest.raises(TypeError, match=r"^has_D: expected a bool, got 'yes'"):
        Problem(1, 64, 2, 16, 16, 1, "fp32", has_D="yes")


def test_problem_rejects_bad_fields():
    with pytest.raises(ValueError, match="^ngroups"):
        Problem(batch=1, seqlen=4, nheads=6, headdim=8, dstate=8, ngroups=4, dtype="fp16")
    with pytest.raises(ValueError, match="^seqlen"):
        Problem(batch=1, seqlen=0, nheads=4, headdim=8, dstate=8, ngroups=1, dtype="fp16")
    with pytest.raises(ValueError, match="^dtype"):
        Problem(batch=1, seqlen=4, nheads=4, headdim=8, dstate=8, ngroups=1, dtype="fp64")
    with pytest.raises(ValueError, match="^batch"):
        Problem(batch=True, seqlen=4, nheads=4, headdim=8, dstate=8, ngroups=1, dtype="fp16")


def test_floor_figures():
    p = Problem(batch=1, seqlen=2048, nheads=80, headdim=64, dstate=128, ngroups=1, dtype="fp16")
    # x + y + B + C + dt, 2 bytes each
    assert p.min_bytes() == 2 * (2 * 2048 * 80 * 64 + 2 * 2048 * 128 + 2048 * 80)
    assert p.flops(256) > 0 and p.replace(has_z=True).min_bytes() > p.min_bytes()


def test_strides_past_the_kernels_32_bit_offsets_are_refused_by_name():
    # head-major x of a long sequence, group-major B: (nheads-1)*stride(2) reaches 2**31 (a
    # reviewer's repro segfaulted the interpreter; on a GPU, an out-of-bounds read). Meta
    # tensors: the check needs only shapes and strides, not 8 GB of memory.
    b, l, h, p, g, n = 1, 4096, 4, 64, 2, 16

    def meta(shape, strides, dtype=torch.float16):
        return torch.empty_strided(shape, strides, dtype=dtype, device="meta")

    ok = dict(x=meta((b, l, h, p), (l * h * p, h * p, p, 1)), dt=meta((b, l, h), (l * h, h, 1), torch.float32),
              A=meta((h,), (1,), torch.float32), B=meta((b, l, g, n), (l * g * n, g * n, n, 1)),
              C=meta((b, l, g, n), (l * g * n, g * n, n, 1)), chunk_size=64)
    assert from_args(**ok).nheads == h
    big = 2**30
    with pytest.raises(ValueError, match=r"^x: strides .* 32-bit offsets.*x\.contiguous\(\)"):
        from_args(**{**ok, "x": meta((b, l, h, p), (4 * big, p, big, 1))})
    with pytest.raises(ValueError, match=r"^B: strides .*B\.contiguous\(\)"):
        from_args(**{**ok, "B": meta((b, l, g, n), (4 * big, n, 2 * big, 1))})
    assert from_args(**{**ok, "x": meta((b, l, h, p), (4 * big, p, big // 4, 1))}).nheads == h


def test_flags_take_bools_numpy_bools_and_0_1_only():
    import numpy as np
    t = {k: torch.randn(*s) for k, s in dict(x=(1, 8, 2, 4), dt=(1, 8, 2), A=(2,), B=(1, 8, 1, 4),
                                               C=(1, 8, 1, 4)).items()}
    for ok, want in ((True, True), (np.bool_(True), True), (1, True), (0, False), (np.bool_(False), False)):
        assert from_args(*t.values(), 64, dt_softplus=ok).dt_softplus is want
    with pytest.raises(TypeError, match=r"^dt_softplus: expected a bool"):
        from_args(*t.values(), 64, dt_softplus="False")
    with pytest.raises(TypeError, match=r"^return_final_states: expected a bool"):
        from_args(*t.values(), 64, return_final_states="yes")
