"""What a NaN or Inf in the inputs does, as README and the drop-in's docstring state it. Inputs must
be finite: within a chunk the kernels form the intra-chunk product as a masked matmul, where a
masked-out zero times a NaN is NaN, so a non-finite value at token t may reach tokens of t's chunk
before t. What is guaranteed is causality across chunks: every token of an earlier chunk is
computed as if the bad value were not there (finite, and equal to the float64 recurrence), and
the bad value is not hidden (its own token's output is non-finite, as the recurrence's is)."""
import pytest
import torch

import autossd
from autossd.ops.ssd.naive import ssd_recurrent
from autossd.testing import make_inputs, rel_err, tolerance


@pytest.mark.parametrize("name,value", [("x", float("nan")), ("x", float("inf")), ("B", float("nan")),
                                        ("dt", float("nan"))])
def test_a_non_finite_input_leaves_earlier_chunks_exact(name, value):
    # fp32 inputs (bf16 states would loosen the comparison); D, dt_bias and softplus as Mamba-2 calls
    prob = autossd.Problem(1, 64, 4, 16, 16, 2, "fp32", chunk_size=64, has_D=True, has_dt_bias=True,
                           dt_softplus=True)
    t = make_inputs(prob, seed=5)
    call = dict(D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True)
    # the chunk length the kernels run this call at (the config's, which may differ from the request)
    q = autossd.get_kernel(autossd.from_args(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, **call)).config.chunk_size
    seqlen = 2 * q                    # two chunks; the bad value in the second, past its first tokens
    bad = q + q // 2 + 3
    prob = prob.replace(seqlen=seqlen)
    t = make_inputs(prob, seed=5)
    t[name][0, bad, 0] = value        # x: head 0; B: group 0; dt: head 0
    kernel = autossd.get_kernel(autossd.from_args(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, **call))
    assert kernel.config.chunk_size == q
    y = autossd.mamba_chunk_scan_combined(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, **call)
    ref = ssd_recurrent(t["x"], t["dt"], t["A"], t["B"], t["C"], **call)[0]
    before = slice(0, q)              # the whole first chunk
    assert torch.isfinite(ref[:, before]).all()
    assert torch.isfinite(y[:, before]).all()
    assert rel_err(y[:, before], ref[:, before]) <= tolerance("fp32")
    assert not torch.isfinite(ref[0, bad, 0]).all()
    assert not torch.isfinite(y[0, bad, 0]).all()
