"""Packed prefill (`ssd_varlen`, `autossd.ssd_varlen`, `autossd.mamba_chunk_scan_combined_varlen`)
against its float64 reference, in Triton's interpreter on the CPU: mixed lengths (one token, a
part chunk, several chunks), per-sequence initial states, final and per-chunk states, `out=`,
poisoned intermediates; the chunk table; the batch drop-in as a second reference; bad input."""
from __future__ import annotations

import math

import os
import subprocess
import sys

import pytest
import torch

import autossd
from autossd import render
from autossd.ops.registry import get_op
from autossd.ops.ssd import varlen as vl
from autossd.ops.ssd.naive import varlen_ref
from autossd.ops.ssd.varlen_knobs import KNOBS, VarlenConfig, VarlenProblem, default_config, violations

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# small tiles: the interpreter's time grows with every element of a tile
SMALL = dict(cumsum_block_h=2, bmm_block_m=16, bmm_block_n=16, bmm_block_k=16, state_block_m=16, state_block_n=16,
             state_block_k=16, scan_block_m=16, scan_block_n=16, scan_block_k=16, scan_block_d=16, pass_block=64)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def inputs(lens, h=4, p=16, n=16, g=2, dtype=torch.float32, seed=0, D_hdim=False, z=True, init=True):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rnd(*s, dt=dtype, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dt).to(DEV)
    return dict(x=rnd(T, h, p), dt=(torch.rand(T, h, generator=gen) * 2 - 2).to(dtype).to(DEV),
                A=(-torch.rand(h, generator=gen) - 0.3).to(DEV),
                B=rnd(T, g, n), C=rnd(T, g, n), D=rnd(h, p, dt=torch.float32) if D_hdim else rnd(h, dt=torch.float32),
                z=rnd(T, h, p) if z else None, dt_bias=rnd(h, dt=torch.float32, scale=0.3),
                initial_states=rnd(len(lens), h, p, n, dt=torch.float32, scale=0.5) if init else None,
                cu_seqlens=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV))


def check(t, q, cfg, dtype=torch.float32, dt_limit=(0.0, float("inf")), computed=None, state_dtype=None):
    cuc, last, seq = vl.varlen_chunks(t["cu_seqlens"], q, computed)
    out = torch.full_like(t["x"], float("nan"))
    y, fin, st = autossd.ssd_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], q, t["cu_seqlens"], D=t["D"], z=t["z"],
                                    dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True,
                                    dt_limit=dt_limit, cu_chunk_seqlens=cuc, last_chunk_indices=last, seq_idx=seq,
                                    out=out, return_intermediate_states=True, state_dtype=state_dtype, config=cfg,
                                    poison=True)
    assert y is out
    yr, fr, sr = varlen_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], cuc, last, seq, D=t["D"], z=t["z"],
                            dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True,
                            dt_limit=dt_limit)
    tol = max(TOL[dtype], TOL[state_dtype] if state_dtype is not None else 0.0)   # states kept in that dtype
    assert torch.isfinite(y).all() and torch.isfinite(fin).all() and torch.isfinite(st).all()
    assert rel(y, yr) < tol and rel(fin, fr) < tol and rel(st, sr) < tol, (rel(y, yr), rel(fin, fr), rel(st, sr))
    return y, fin, st


@pytest.mark.parametrize("cb,split", [("stage", False), ("inline", True), ("stage", True)])
def test_mixed_lengths_match_float64(cb, split):
    """One token, a part chunk, an exact chunk and several chunks, each from its own state; chunks
    of two row tiles, so that decay_split has blocks before the diagonal to factor."""
    t = inputs([1, 9, 32, 75], D_hdim=cb == "inline")
    check(t, 32, VarlenConfig(cb=cb, decay_split=split, **SMALL))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_and_limits(dtype):
    t = inputs([23, 3], dtype=dtype, seed=1, z=False, init=False)
    check(t, 16, VarlenConfig(**SMALL), dtype=dtype, dt_limit=(0.05, 0.5))


def test_prefix_aligned_chunks_and_bf16_states():
    """computed_tokens cuts each sequence's first chunk at its logical chunk boundary; the chunk
    states (kept in bf16) are the states at those boundaries."""
    t = inputs([20, 7], seed=2)
    cuc, last, seq = vl.varlen_chunks(t["cu_seqlens"], 16, computed_tokens=[5, 16])
    assert cuc.tolist() == [0, 11, 20, 27] and last.tolist() == [1, 2] and seq.tolist() == [0, 0, 1]
    check(t, 16, VarlenConfig(**SMALL), computed=[5, 16], state_dtype=torch.bfloat16)


def test_fp16_states_of_a_resume_mid_chunk_with_cb_inline():
    """fp16 inputs with the chunk states kept in fp16, C·Bᵀ computed in the scan, and sequences
    that resume mid-chunk (computed_tokens): the first chunk of each ends at its logical chunk
    boundary, and the returned chunk-end states are the states there."""
    t = inputs([21, 40, 2], dtype=torch.float16, seed=4)
    cuc, last, seq = vl.varlen_chunks(t["cu_seqlens"], 16, computed_tokens=[3, 30, 15])
    assert cuc.tolist() == [0, 13, 21, 23, 39, 55, 61, 62, 63] and seq.tolist() == [0, 0, 1, 1, 1, 1, 2, 2]
    _, _, st = check(t, 16, VarlenConfig(cb="inline", decay_split=True, **SMALL), dtype=torch.float16,
                     computed=[3, 30, 15], state_dtype=torch.float16)
    assert st.dtype == torch.float16


def test_chunk_table_of_plain_lengths_and_an_empty_sequence():
    cuc, last, seq = vl.varlen_chunks(torch.tensor([0, 3, 3, 40]), 16)
    assert cuc.tolist() == [0, 3, 19, 35, 40] and seq.tolist() == [0, 2, 2, 2] and last.tolist() == [0, 0, 3]
    assert cuc.dtype == torch.int32
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        vl.varlen_chunks(torch.tensor([0, 5, 3]), 16)
    with pytest.raises(ValueError, match="^computed_tokens:"):
        vl.varlen_chunks(torch.tensor([0, 5]), 16, computed_tokens=[1, 2])


def test_a_one_token_prefill():
    """One sequence of one token: (1, h, p) is the packed form, not a batch of one."""
    check(inputs([1], seed=7), 16, VarlenConfig(**SMALL))


def test_an_empty_sequence_keeps_its_initial_state():
    t = inputs([0, 18], seed=3)
    t["cu_seqlens"] = torch.tensor([0, 0, 18], dtype=torch.int32, device=DEV)
    _, fin, _ = check(t, 16, VarlenConfig(**SMALL))
    assert torch.equal(fin[0], t["initial_states"][0])


def test_agrees_with_the_batch_drop_in_per_sequence():
    """Each sequence of the packed call equals the batch drop-in run on that sequence alone from
    the same initial state: y and the final state (two computations sharing no kernel code)."""
    lens = [70, 6]   # the drop-in's chunks are 64 tokens at least
    t = inputs(lens, seed=4, z=False)
    y, fin = autossd.ssd_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], 64, t["cu_seqlens"], D=t["D"],
                                dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True,
                                config=VarlenConfig(**SMALL))
    a = 0
    for s, ln in enumerate(lens):
        sl = slice(a, a + ln)
        ys, fs = autossd.mamba_chunk_scan_combined(
            t["x"][None, sl], t["dt"][None, sl], t["A"], t["B"][None, sl], t["C"][None, sl], 64, D=t["D"],
            dt_bias=t["dt_bias"], initial_states=t["initial_states"][s:s + 1], dt_softplus=True,
            return_final_states=True)
        assert rel(y[sl], ys[0]) < 1e-4 and rel(fin[s], fs[0]) < 1e-4
        a += ln


def test_vllm_contract_writes_out_and_returns_states():
    t = inputs([10, 30], seed=5)
    cuc, last, seq = vl.varlen_chunks(t["cu_seqlens"], 16)
    kw = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], initial_states=t["initial_states"], dt_softplus=True)
    out = torch.full_like(t["x"], float("nan"))
    fin = autossd.mamba_chunk_scan_combined_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, t["cu_seqlens"],
                                                   cuc, last, seq, out, **kw)
    states = autossd.mamba_chunk_scan_combined_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, t["cu_seqlens"],
                                                      cuc, last, seq, torch.empty_like(out), return_intermediate_states=True,
                                                      **kw)
    yr, fr, sr = varlen_ref(t["x"], t["dt"], t["A"], t["B"], t["C"], cuc, last, seq, **kw)
    assert fin.shape == (2, 4, 16, 16) and states.shape == (len(seq), 4, 16, 16)
    assert rel(out, yr) < 1e-4 and rel(fin, fr) < 1e-4 and rel(states, sr) < 1e-4
    # mamba_ssm's varlen form, a leading batch of 1, is taken too
    y1, _ = autossd.ssd_varlen(t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], 16, t["cu_seqlens"],
                               **kw)
    assert rel(y1, yr) < 1e-4


def _args():
    t = inputs([10, 30], seed=6)
    return dict(x=t["x"], dt=t["dt"], A=t["A"], B=t["B"], C=t["C"], chunk_size=16, cu_seqlens=t["cu_seqlens"],
                initial_states=t["initial_states"])


@pytest.mark.parametrize("change,exc,name", [
    (lambda a: a.update(dt=a["dt"][:, :2]), ValueError, "dt"),
    (lambda a: a.update(A=a["A"].double()), TypeError, "A"),
    (lambda a: a.update(B=a["B"][:, :, :8]), ValueError, "C"),
    (lambda a: a.update(chunk_size=48), ValueError, "chunk_size"),
    (lambda a: a.update(initial_states=a["initial_states"][:1]), ValueError, "initial_states"),
    (lambda a: a.update(cu_seqlens=a["cu_seqlens"].float()), TypeError, "cu_seqlens"),
    (lambda a: a.update(out=torch.empty(40, 4, 8, device=DEV)), ValueError, "out"),
    (lambda a: a.update(seq_idx=torch.zeros(2, dtype=torch.int32, device=DEV)), ValueError, "cu_chunk_seqlens, last_chunk_indices, seq_idx"),
    (lambda a: a.update(state_dtype=torch.int8), TypeError, "state_dtype"),
    (lambda a: a.update(dt_softplus="False"), TypeError, "dt_softplus"),
    (lambda a: a.update(dt_limit=("a", "b")), ValueError, "dt_limit"),
    (lambda a: a.update(dt_limit=(1.0, 0.0)), ValueError, "dt_limit"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 10, 60], dtype=torch.int32, device=DEV)), ValueError, "cu_seqlens"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 10, 30], dtype=torch.int32, device=DEV)), ValueError, "cu_seqlens"),
    (lambda a: a.update(out=torch.empty(1, 4, 16, device=DEV).expand(40, 4, 16)), ValueError, "out"),
])
def test_bad_input_names_the_argument(change, exc, name):
    a = _args()
    change(a)
    with pytest.raises(exc, match=rf"^{name}:"):
        autossd.ssd_varlen(**a)


def test_out_in_mamba_ssms_batch_of_one_form_receives_y():
    a = _args()
    y, _ = autossd.ssd_varlen(**a)
    out = torch.full((1,) + tuple(a["x"].shape), float("nan"), device=DEV)
    y1, _ = autossd.ssd_varlen(**a, out=out)
    assert y1.data_ptr() == out.data_ptr() and torch.equal(out[0], y)


def test_a_wrong_chunk_table_gives_wrong_numbers_never_a_fault():
    """A caller's table is not read on the host; its values are clamped on the device before
    the kernels index with them (an out-of-range one faulted the interpreter before), a chunk of
    no tokens and a sequence's chunks out of order included."""
    a = _args()
    cuc, last, seq = vl.varlen_chunks(a["cu_seqlens"], 16)
    y, fin = autossd.ssd_varlen(**a, cu_chunk_seqlens=cuc, last_chunk_indices=last, seq_idx=seq)
    y_own, fin_own = autossd.ssd_varlen(**a)
    assert torch.equal(y, y_own) and torch.equal(fin, fin_own)   # a valid table passes unchanged
    for bad in (dict(cu_chunk_seqlens=cuc * 3), dict(cu_chunk_seqlens=cuc - 7),
                dict(last_chunk_indices=last + 10), dict(last_chunk_indices=last - 10),
                dict(seq_idx=seq + 7), dict(seq_idx=-seq - 1),
                dict(cu_chunk_seqlens=torch.tensor([0, 20, 36, 40], dtype=torch.int32, device=DEV)),
                dict(cu_chunk_seqlens=torch.tensor([0, 16, 16, 40], dtype=torch.int32, device=DEV)),
                dict(seq_idx=torch.tensor([1, 0, 1], dtype=torch.int32, device=DEV))):
        tab = dict(cu_chunk_seqlens=cuc, last_chunk_indices=last, seq_idx=seq)
        tab.update(bad)
        if tab["cu_chunk_seqlens"].shape[0] != tab["seq_idx"].shape[0] + 1:
            tab["seq_idx"] = torch.tensor([0, 0, 1], dtype=torch.int32, device=DEV)
        y, fin = autossd.ssd_varlen(**a, **tab)
        assert y.shape == a["x"].shape and fin.shape == (2, 4, 16, 16)


def test_a_chunk_table_too_short_is_refused():
    a = _args()
    cuc, last, seq = vl.varlen_chunks(a["cu_seqlens"], 16)
    with pytest.raises(ValueError, match="^cu_chunk_seqlens:"):
        autossd.ssd_varlen(**a, cu_chunk_seqlens=cuc[:2], last_chunk_indices=last, seq_idx=seq[:1])


# --- knobs, rules, records, hooks -----------------------------------------------------------------
def test_every_knob_changes_the_rendered_kernel():
    base = VarlenConfig()
    h0 = render.kernel_hash(base, "cuda")
    for knob in KNOBS:
        if knob.name == "walk_block":   # a launch constexpr of the packed walk: below
            continue
        other = next(v for v in knob.values if v != base[knob.name])
        if knob.name == "walk_bn":   # shapes the Gluon walk alone, which the default does not render
            walk = base.replace(state_walk=1, scan_gluon=2)
            assert render.kernel_hash(walk.replace(walk_bn=other), "cuda") != render.kernel_hash(walk, "cuda")
            continue
        assert render.kernel_hash(base.replace(**{knob.name: other}), "cuda") != h0, knob.name
    # the Gluon walk's ring takes min(chunk, walk_block) tokens a block (the chunk is the call's):
    # two stages of x and B blocks, 112 KB at 128 tokens, 64 KB at 64 (sm90 cross-compiles)
    from autossd.compile import compile_config
    prob = vl.problem_for(4096, 4, 8, 64, 128, 1, 256, "bf16")
    smem = {}
    for wb in (128, 64):
        rep = compile_config(VarlenConfig(state_walk=1, scan_gluon=2, walk_block=wb), "sm90", prob, stages=("state_walk",))
        assert rep.ok, rep.why()
        smem[wb] = rep.stages[0].shared_bytes // 1024
    assert smem == {128: 112, 64: 64}
    # walk_bn = 64: twice the walk's programs at dstate 128, each in less shared memory and fewer
    # registers (more CTAs an SM)
    reps = {bn: compile_config(VarlenConfig(state_walk=1, scan_gluon=2, walk_block=64, walk_bn=bn), "sm90", prob,
                               stages=("state_walk",)).stages[0] for bn in (128, 64)}
    assert reps[64].occupancy > reps[128].occupancy and reps[64].spill_bytes == 0
    from autossd.render import _interpret
    with _interpret(False):
        grids = {bn: next(ln.grid for ln in get_op("ssd_varlen").fn("meta_launches")(prob, VarlenConfig(state_walk=1, scan_gluon=2, walk_bn=bn),
                                                              "cuda") if ln.stage == "state_walk") for bn in (128, 64)}
    assert grids[64][0] == 2 * grids[128][0]
    inline = VarlenConfig(cb="inline")
    assert inline.replace(bmm_block_m=16) == inline   # the C·Bᵀ launch's knobs shape only "stage"


def test_defaults_are_feasible_and_rules_refuse_what_cannot_run():
    big = vl.problem_for(65536, 8, 80, 64, 128, 1, 256, "bf16", has_D=True, has_z=True, has_init=True)
    few = vl.problem_for(40, 4, 24, 64, 128, 1, 256, "fp16")
    for arch in ("sm80", "sm90", "gfx90a", "gfx942"):
        for pr in (big, few, VarlenProblem(3, 1, 1, 3, 5, 7, 1, 16, "fp32")):
            assert violations(default_config(arch, pr), arch, pr) == [], (arch, pr)
    assert default_config("sm80", few).cb == "inline" and default_config("sm80", big).cb == "stage"
    # sm90: the forward's Gluon walk and scan (C·Bᵀ staged) wherever the problem fits them
    assert all(default_config("sm90", pr).replace(walk_block=128) == default_config("sm80", big).replace(
        state_walk=1, scan_gluon=3) for pr in (few, big))
    assert default_config("sm90", big.replace(dtype="fp32")).state_walk == 0
    assert any("needs scan_gluon" in w for w in violations(VarlenConfig(state_walk=1), "sm90", big))
    assert any("needs state_walk=1" in w for w in violations(VarlenConfig(scan_gluon=2), "sm90", big))
    assert any("dstate 64 or 128" in w for w in violations(default_config("sm90", big), "sm90", big.replace(dstate=256)))
    assert any("scan_block_m" in w for w in violations(VarlenConfig(scan_block_m=128), "sm90", big.replace(chunk_size=64)))
    assert any("shared memory" in w for w in violations(
        VarlenConfig(scan_block_m=128, scan_block_n=128, scan_block_k=128, scan_block_d=256, scan_stages=4), "sm90", big))
    assert VarlenProblem(**big.key()) == big
    op = get_op("ssd_varlen")
    assert op.problem_type is VarlenProblem and op.config_type is VarlenConfig
    costs = op.fn("cost_model")(big, default_config("sm90", big))
    assert [c.stage for c in costs] == list(op.sequences["stage"])


def test_a_record_near_in_size_is_picked_else_the_default(isolated_db, no_shipped_db):
    from autossd.db import add_records, make_record
    pr = vl.problem_for(4096, 4, 8, 16, 16, 1, 64, "fp32")
    tuned = VarlenConfig(scan_warps=8, state_warps=2)
    add_records(str(isolated_db), [make_record(pr.replace(tokens=5000, chunks=82), vl.fit(tuned, pr), "sm90",
                                               provenance="measured", time_ms=0.1, op="ssd_varlen")])
    cfg, why = vl.choose(pr, "sm90")
    assert cfg == vl.fit(tuned, pr) and why.startswith("nearest match")   # its tiles cut to this problem's sizes
    other = pr.replace(dtype="fp16")   # another input type than the record's fp32: no record applies
    cfg, why = vl.choose(other, "sm90")
    assert cfg == default_config("sm90", other) and why.startswith("default config"), why


@pytest.mark.usefixtures("isolated_db")
def test_the_shipped_packed_prefill_records_serve_their_own_and_nearby_batches():
    """Through the one selector (the lookup's tiers), each shipped packed-prefill record answers
    its own problem (exact), a batch of 1.3x its tokens (nearest: the token count is a size,
    not a key), and one of 1/16 of its tokens (past the nearest bound: the record of that shape
    nearest in size, carried over); never the default."""
    from autossd.db import lookup
    path = lookup.shipped_db_path("sm90")
    if path is None:
        pytest.skip("no shipped sm90 database")
    from autossd.db.records import read_records
    recs = [r for r in read_records(str(path), "sm90", "ssd_varlen", immutable=True) if r.launch_mode == "eager"]
    assert recs
    for r in recs[::7]:
        p = r.problem
        cfg, why = vl.choose(p, "sm90")
        assert why.startswith("exact match") and cfg == vl.fit(r.config, p), why
        more = p.replace(tokens=int(p.tokens * 1.3))
        cfg, why = vl.choose(more, "sm90")
        assert why.startswith("nearest match") and cfg == vl.fit(r.config, more), why
        fewer = p.replace(tokens=p.tokens // 16)
        cfg, why = vl.choose(fewer, "sm90")
        assert why.startswith(("nearest", "transfer")), why
        same = [q for q in recs if {k: v for k, v in q.problem.key().items() if k not in ("tokens", "seqs", "chunks")}
                == {k: v for k, v in p.key().items() if k not in ("tokens", "seqs", "chunks")}]
        nearest = min(same, key=lambda q: abs(math.log2(q.problem.tokens / fewer.tokens))
                      + 0.5 * abs(math.log2(q.problem.seqs / fewer.seqs)))
        assert f"t={nearest.problem.tokens}" in why and cfg == vl.fit(nearest.config, fewer), why


def test_tuner_hooks_agree_with_the_reference():
    op = get_op("ssd_varlen")
    pr = vl.problem_for(50, 3, 4, 16, 16, 2, 16, "fp32", has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True,
                        has_init=True)
    t = op.fn("tune_inputs")(pr, DEV, 0)
    assert t["cu_chunk_seqlens"].shape[0] - 1 == pr.chunks and int(t["cu_seqlens"][-1]) == pr.tokens
    y, fin = op.fn("tune_run")(pr, VarlenConfig(**SMALL), t)
    yr, fr = op.fn("tune_reference")(pr, t)
    assert rel(y, yr) < 1e-4 and rel(fin, fr) < 1e-4
    launches = op.fn("meta_launches")(pr, VarlenConfig(**SMALL), "cuda")
    assert [ln.stage for ln in launches] == list(op.sequences["stage"])


def test_cross_compiles_for_nvidia_and_amd_without_spills():
    """The defaults compile for sm80, sm90, gfx90a and gfx942 on meta tensors (a spawned compile
    worker: the interpreter cannot compile) with no register spills."""
    from autossd.compile import compile_config
    pr = vl.problem_for(16384, 4, 80, 64, 128, 1, 256, "bf16", has_D=True, has_z=True, has_dt_bias=True,
                        dt_softplus=True, has_init=True)
    for arch in ("sm80", "sm90", "gfx90a", "gfx942"):
        inline = default_config(arch, pr).replace(cb="inline")
        for cfg in (default_config(arch, pr),) + ((inline,) if arch in ("sm90", "gfx942") else ()):
            rep = compile_config(cfg, arch, pr)
            # sm90's default: the Gluon walk in place of the chunk state and the state passing
            want = ({"cumsum", "bmm", "state_walk", "chunk_scan"} if cfg.state_walk
                    else set(get_op("ssd_varlen").sequences[cfg.cb]))
            assert rep.ok and {s.stage for s in rep.stages} == want, (arch, rep)
            assert bool(cfg.state_walk) == (arch == "sm90" and cfg.cb == "stage")
            assert all(s.spill_bytes == 0 for s in rep.stages), (arch, cfg, rep)


@pytest.mark.parametrize("lens,q,computed", [
    ([0, 10, 0, 30, 0, 1, 0], 16, None),                  # empty sequences: repeated last indices, a -1
    ([0, 10, 0, 30, 0, 1, 0], 16, [0, 5, 0, 17, 3, 63, 100]),   # prefix-aligned: short first chunks
    ([300, 0, 1], 64, [10, 0, 63]),
    ([7] * 700, 4, None),                                  # more chunks than one block of the guard
])
@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_the_guard_returns_a_valid_chunk_table_unchanged(lens, q, computed, itype):
    from autossd.ops.ssd.varlen_guard import guard_table
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=itype, device=DEV)
    table = vl.varlen_chunks(cu, q, computed)
    got = guard_table(*(v.to(itype) for v in table), sum(lens), q)
    assert all(g.dtype == torch.int32 and torch.equal(g, v) for g, v in zip(got, table))


def test_a_strided_chunk_table_is_read_as_its_values():
    a = _args()
    cuc, last, seq = vl.varlen_chunks(a["cu_seqlens"], 16)
    y, fin = autossd.ssd_varlen(**a)
    wide = torch.stack([cuc, torch.full_like(cuc, 10**6)], 1)[:, 0]   # stride 2, same values
    ys, fins = autossd.ssd_varlen(**a, cu_chunk_seqlens=wide, last_chunk_indices=last, seq_idx=seq)
    assert torch.equal(ys, y) and torch.equal(fins, fin)


_GUARD_COMPILE = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from autossd.ops.ssd.varlen_guard import _BLOCK, _guard_table
sig = {n: "*i32" for n in ("cuc_ptr", "last_ptr", "seq_ptr", "cuc_out", "last_out", "seq_out")}
sig.update(tokens="i32", chunk_size="i32", nchunks="i32", nseqs="i32", BLOCK="constexpr")
for target in (GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx90a", 64),
               GPUTarget("hip", "gfx942", 64)):
    triton.compile(ASTSource(_guard_table, sig, {"BLOCK": _BLOCK}, {}), target=target, options=dict(num_warps=4))
print("ok")
'''


def test_the_chunk_table_guard_cross_compiles_for_nvidia_and_amd():
    """The one hand-written kernel of packed prefill compiles for the four archs (in a fresh
    interpreter: the CPU interpreter cannot compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _GUARD_COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def test_with_a_chunk_table_nothing_is_read_on_the_host(monkeypatch):
    """What makes a call capturable in a CUDA graph: given the chunk table, the entry reads no
    tensor's values on the host (no .item(), .tolist(), bool() or int() of a tensor)."""
    t = inputs([12, 20], seed=8)
    cuc, last, seq = vl.varlen_chunks(t["cu_seqlens"], 16)
    cfg = VarlenConfig(**SMALL)
    autossd.ssd_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, t["cu_seqlens"], cu_chunk_seqlens=cuc,
                       last_chunk_indices=last, seq_idx=seq, config=cfg)   # compiled / rendered first

    def host_read(*a, **k):
        raise AssertionError("a tensor's value was read on the host")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    if DEV == "cpu":   # the interpreter itself reads values: plan the launches, launch none
        def plan_only(problem, config, t, backend, dt_limit, poison, keep_states=True):
            buf = vl.allocate(problem, config, t["x"].device)
            assert len(vl.plan(problem, config, t, buf, backend, dt_limit)) == 5
            return buf
        monkeypatch.setattr(vl, "run", plan_only)
    y, fin = autossd.ssd_varlen(t["x"], t["dt"], t["A"], t["B"], t["C"], 16, t["cu_seqlens"], cu_chunk_seqlens=cuc,
                                last_chunk_indices=last, seq_idx=seq, initial_states=t["initial_states"], config=cfg)
    assert y.shape == t["x"].shape and fin.shape == (2, 4, 16, 16)


def test_a_recorded_call_replays_on_each_calls_own_tensors(monkeypatch):
    """The launch cache: the first call of a key plans, launches and records; a second call of
    the same key with other inputs plans nothing, replays the record on its own tensors and fresh
    buffers, and matches float64 as the first does; another key (more tokens) records anew."""
    from autossd.testing import interpret_launch_cache
    seen = interpret_launch_cache(monkeypatch, vl, "launch")
    cfg = VarlenConfig(**SMALL)
    check(inputs([20, 13, 31], seed=1), 16, cfg)
    planned = seen["planned"]
    assert planned == 5 and seen["replays"] == 0 and len(vl._launch_cache) == 1
    check(inputs([30, 20, 14], seed=2), 16, cfg)   # other lengths and values, the same shapes
    assert seen == {"planned": planned, "replays": 1}
    check(inputs([30, 20, 15], seed=3), 16, cfg)   # one more token: another key
    assert seen["planned"] == 2 * planned and seen["replays"] == 1 and len(vl._launch_cache) == 2


def test_a_replay_of_the_sm90_gluon_path_passes_a_fresh_plans_arguments(monkeypatch):
    """sm90's Gluon walk and scan (planned as on a GPU: their gaps stubbed) recorded once and
    replayed on two other calls' inputs and buffers: each launch gets what a fresh plan of that
    call passes, pointers as the call's own addresses and each TMA descriptor on the call's own
    tensor (compiled kernels stubbed)."""
    from types import SimpleNamespace

    from autossd.testing import record_and_replay
    monkeypatch.setattr(vl, "gluon_gaps", lambda *a, **k: [])
    lens = [70, 33, 90]
    prob = VarlenProblem(tokens=sum(lens), seqs=3, chunks=len(vl.varlen_chunks(torch.tensor([0, 70, 103, 193]), 64)[2]),
                         nheads=2, headdim=64, dstate=64, ngroups=1, chunk_size=64, dtype="bf16", has_D=True,
                         has_z=True, has_dt_bias=True, dt_softplus=True, has_init=True)
    cfg = default_config("sm90", prob).replace(state_walk=1, scan_gluon=3, cb="stage")
    assert not violations(cfg, "sm90", prob), violations(cfg, "sm90", prob)
    mod = render.load(cfg)

    def planned(seed):
        t = inputs(lens, h=2, p=64, n=64, g=1, dtype=torch.bfloat16, seed=seed)
        t["cu_chunk_seqlens"], t["last_chunk_indices"], t["seq_idx"] = vl.varlen_chunks(t["cu_seqlens"], 64)
        t["out"] = torch.empty_like(t["x"])
        buf = vl.allocate(prob, cfg, DEV, gluon=True)
        return t, SimpleNamespace(**buf), vl.plan(prob, cfg, t, buf, "cuda")

    launches1, descs = record_and_replay(planned, mod, vl.INPUTS, vl.BUFFERS)
    assert [ln.kernel for ln in launches1][-2:] == ["ssd_state_walk", "ssd_chunk_scan_gluon_chunk"]
    assert descs == 2 * 8   # the walk's three and the scan's five, per replay
