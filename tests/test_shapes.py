"""The model grid of autossd/tuner/shapes.py: what the shipped databases are tuned over."""
import itertools

import pytest

from autossd.problem import Problem
from autossd.tuner.shapes import (GRID_MAX_TOKENS, MODELS, PRESET_SHAPES, ShapeError, grid, grid_dims,
                                  grid_sizes, parse_shape, preset)


def test_every_model_layer_is_in_the_grid_once():
    dims = grid_dims()
    assert len(dims) == len(set(dims)) == len(set(MODELS.values()))
    assert set(dims) == set(MODELS.values())
    # aliases share one layer: Nemotron-H 8B's is Codestral's, Bamba's is Granite 4.0-H Small's
    assert MODELS["nemotron-h-8b"] == MODELS["codestral-7b"]
    assert MODELS["bamba-9b"] == MODELS["granite-4.0-h-small"]
    for h, p, n, g in dims:
        assert h % g == 0


def test_the_sizes_span_prefill_and_training_under_the_token_cap():
    sizes = grid_sizes()
    assert len(sizes) == len(set(sizes))
    assert min(b for b, _ in sizes) == 1 and max(b for b, _ in sizes) == 64
    assert min(l for _, l in sizes) == 512 and max(l for _, l in sizes) == 131072
    assert all(b * l <= GRID_MAX_TOKENS for b, l in sizes)
    # every batch 1..64 and length 512..128k (powers of 2) is within 2x of a grid point in each,
    # the reach of the lookup's nearest tier
    for b, l in itertools.product([2 ** i for i in range(7)], [2 ** i for i in range(9, 18)]):
        if b * l <= GRID_MAX_TOKENS:
            assert any(max(b / gb, gb / b) <= 2 and max(l / gl, gl / l) <= 2 for gb, gl in sizes), (b, l)


def test_grid_problems_are_the_layer_call_ordered_by_what_compiles_alike():
    probs = grid(op="ssd_fwd")
    assert len(probs) == len(grid_dims()) * len(grid_sizes()) * 2
    assert len({(p.dtype, *sorted(p.key().items())) for p in probs}) == len(probs)
    assert all(isinstance(p, Problem) and p.has_D and p.has_dt_bias and p.dt_softplus and not p.has_z
               for p in probs)
    # dtype, then (headdim, dstate) change only at group boundaries: each group is contiguous
    keys = [(p.dtype, p.headdim, p.dstate) for p in probs]
    groups = [k for k, _ in itertools.groupby(keys)]
    assert len(groups) == len(set(groups))
    assert [p.dtype for p in grid(("bf16",), op="ssd_fwd")] == ["bf16"] * (len(probs) // 2)


def test_presets_keep_the_benchmark_shapes_and_add_grid():
    assert [(p.batch, p.seqlen) for p in preset("mamba2-2.7b", op="ssd_fwd")] == PRESET_SHAPES["mamba2-2.7b"]
    z = preset("zamba2-7b", "bf16", op="ssd_fwd")
    assert [(p.batch, p.seqlen) for p in z] == grid_sizes()
    assert {(p.nheads, p.headdim, p.dstate, p.ngroups, p.dtype) for p in z} == {(112, 64, 64, 2, "bf16")}
    assert preset("grid", "bf16", op="ssd_fwd") == grid(("bf16",), op="ssd_fwd")
    assert preset("grid", "fp16", op="ssd_bwd") == grid(("fp16",), op="ssd_bwd")
    with pytest.raises(ShapeError, match="grid"):
        preset("gpt-9", op="ssd_fwd")



def test_the_decode_and_packed_prefill_grids_cover_every_layer_in_both_cache_types():
    from autossd.ops.ssd.decode_knobs import DecodeProblem
    from autossd.ops.ssd.decode_knobs import GRID_DECODE_BATCHES
    from autossd.ops.ssd.varlen_knobs import GRID_VARLEN
    from autossd.tuner.shapes import MAMBA1_MODELS
    dec = grid(op="ssd_decode")
    assert all(isinstance(p, DecodeProblem) and p.has_D and p.has_dt_bias and p.dt_softplus for p in dec)
    # Mamba-2 layers: z applied by the gated norm; Mamba-1 layers: one head of d_inner, dense A, z
    m2 = [p for p in dec if not p.A_dense]
    m1 = [p for p in dec if p.A_dense]
    assert not any(p.has_z for p in m2) and all(p.has_z and p.nheads == 1 for p in m1)
    assert len(m2) == len(set(m2)) == len(grid_dims()) * len(GRID_DECODE_BATCHES) * 2 * 2
    assert {(p.headdim, p.dstate) for p in m1} == set(MAMBA1_MODELS.values())
    assert len(m1) == len(set(m1)) == len(set(MAMBA1_MODELS.values())) * len(GRID_DECODE_BATCHES) * 2 * 2
    assert {(p.dtype, p.state_dtype) for p in dec} == {("fp16", "fp32"), ("fp16", "fp16"), ("bf16", "fp32"),
                                                       ("bf16", "bf16")}
    assert {p.state_dtype for p in grid(op="ssd_decode", state_dtype="bf16")} == {"bf16"}
    var = grid(("bf16",), op="ssd_varlen")
    assert len(var) == len(grid_dims()) * len(GRID_VARLEN)
    assert {(p.tokens, p.seqs) for p in var} == set(GRID_VARLEN) and {p.state_dtype for p in var} == {"fp32"}
    assert preset("grid", "bf16", op="ssd_varlen") == var


def test_a_mamba1_model_prefix_sets_its_layer_where_the_form_takes_one():
    p = parse_shape("mamba-2.8b:b=64", "bf16", op="ssd_decode")
    assert (p.batch, p.nheads, p.headdim, p.dstate, p.ngroups, p.A_dense, p.has_z) == (64, 1, 5120, 16, 1, True, True)
    assert not parse_shape("mamba-2.8b:b=64,z=0", "bf16", op="ssd_decode").has_z
    assert parse_shape("b=2,h=4,p=8,n=16,g=1,adense=1", op="ssd_decode").A_dense
    assert "A_dense" not in parse_shape("b=2,h=4,p=8,n=16,g=1", op="ssd_decode").key()
    with pytest.raises(ShapeError, match="Mamba-1 model"):
        parse_shape("mamba-2.8b:b=1,l=2048", op="ssd_fwd")
    with pytest.raises(ShapeError, match="unknown preset"):
        preset("mamba-2.8b", op="ssd_fwd")
    assert {p.headdim for p in preset("falcon-mamba-7b", op="ssd_decode")} == {8192}


def test_a_model_prefix_sets_its_layer():
    p = parse_shape("falcon-h1-34b:b=2,l=4k", "bf16", op="ssd_fwd")
    assert (p.batch, p.seqlen, p.nheads, p.headdim, p.dstate, p.ngroups) == (2, 4096, 32, 128, 256, 2)
