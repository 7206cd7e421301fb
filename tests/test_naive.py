"""The chunked float64 reference equals the token recurrence on every contract feature."""
import pytest
import torch

from autossd.ops.ssd.naive import ssd_chunked, ssd_recurrent
from autossd.problem import Problem
from autossd.testing import call_kwargs, make_inputs, rel_err

FULL = dict(has_D=True, D_has_hdim=True, has_z=True, has_dt_bias=True, dt_softplus=True,
            has_dt_limit=True, has_initial_states=True, has_seq_idx=True)


def _both(prob, q, seed=0):
    t = make_inputs(prob, seed=seed)
    kw = call_kwargs(prob, t)
    kw.pop("return_final_states"), kw.pop("return_varlen_states")
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    return ssd_recurrent(*args, **kw), ssd_chunked(*args, chunk_size=q, group_tokens=2 * q, **kw)


@pytest.mark.parametrize("q", [64, 128, 256])
@pytest.mark.parametrize("flags", [{}, FULL, dict(has_D=True, dt_softplus=True, has_seq_idx=True)])
@pytest.mark.parametrize("l,g", [(1, 1), (150, 2), (300, 4)])
def test_chunked_matches_recurrence(q, flags, l, g):
    prob = Problem(batch=2, seqlen=l, nheads=4, headdim=8, dstate=16, ngroups=g, dtype="fp32", **flags)
    (y1, f1, _), (y2, f2, _) = _both(prob, q)
    assert rel_err(y2, y1) < 1e-12
    assert rel_err(f2, f1) < 1e-12


def test_varlen_states_match_recurrence():
    prob = Problem(batch=1, seqlen=333, nheads=4, headdim=8, dstate=16, ngroups=1, dtype="fp32",
                   has_seq_idx=True, return_varlen_states=True, dt_softplus=True, has_initial_states=True)
    (_, _, v1), (_, _, v2) = _both(prob, 64, seed=3)
    assert v1.shape == (3, 4, 8, 16)
    assert rel_err(v2, v1) < 1e-12


def test_seq_idx_resets_state():
    """Tokens of the second sequence see nothing of the first: its output equals a fresh run."""
    prob = Problem(batch=1, seqlen=120, nheads=2, headdim=4, dstate=8, ngroups=1, dtype="fp32")
    t = make_inputs(prob, seed=5)
    seq = torch.zeros(1, 120, dtype=torch.int32)
    seq[:, 50:] = 1
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    y, _, _ = ssd_chunked(*args, chunk_size=64, seq_idx=seq)
    y2, _, _ = ssd_chunked(*(a[:, 50:] if a.dim() > 1 else a for a in args), chunk_size=64)
    assert rel_err(y[:, 50:], y2) < 1e-12


def test_reference_is_float64_and_not_trivial():
    prob = Problem(batch=1, seqlen=70, nheads=2, headdim=4, dstate=8, ngroups=1, dtype="bf16", has_D=True)
    (y1, f1, _), _ = _both(prob, 64)
    assert y1.dtype == torch.float64 and f1.dtype == torch.float64
    assert y1.abs().max() > 0.1 and torch.isfinite(y1).all()


def test_chunked_cuts_a_large_batch_along_sequences_and_chunks():
    """Many heads and a small token budget: the intra-chunk matrices are built a slice of
    sequences x chunks at a time (what keeps a 64 x 8192 tokens gate reference in memory), and
    the result is the recurrence's."""
    prob = Problem(batch=3, seqlen=150, nheads=64, headdim=4, dstate=4, ngroups=2, dtype="fp32",
                   has_D=True, dt_softplus=True, has_initial_states=True)
    t = make_inputs(prob, seed=7)
    kw = call_kwargs(prob, t)
    kw.pop("return_final_states"), kw.pop("return_varlen_states")
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"])
    y1, f1, _ = ssd_recurrent(*args, **kw)
    y2, f2, _ = ssd_chunked(*args, chunk_size=32, group_tokens=64, **kw)   # 2 chunks of 1 sequence
    assert rel_err(y2, y1) < 1e-12 and rel_err(f2, f1) < 1e-12
