"""The decode step (`ssd_decode`, `autossd.selective_state_update`) against its float64 reference, in
Triton's CPU interpreter. Shapes are tiny (each launch is a few interpreted programs); every
output starts poisoned with NaN so an element the kernel never writes shows."""
import math

import pytest
import torch

from autossd import render
from autossd.ops.registry import get_op
from autossd.ops.ssd import decode as dec
from autossd.ops.ssd.decode import DecodeProblem, selective_state_update, tune_inputs
from autossd.ops.ssd.decode_knobs import KNOBS, DecodeConfig, default_config, violations
from autossd.ops.ssd.naive import ssd_recurrent, state_update_ref
from autossd.testing import rel_err, tolerance

DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the interpreter without a GPU


def _run(t, pr, config=None, idx=None, pad=-1, poison=True):
    """One call on a copy of the state, out= poisoned; returns (out, new state, the state object)."""
    state = t["state"].clone()
    out = torch.full(t["x"].shape, float("nan"), dtype=t["x"].dtype, device=t["x"].device) if poison else None
    got = selective_state_update(state, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"],
                                 pr.dt_softplus, state_batch_indices=idx, pad_slot_id=pad, out=out, config=config)
    if poison:
        assert got is out   # the caller's out= is written and returned
    return got, state


def _check(pr, t, got, state, idx=None):
    ref_y, ref_s = state_update_ref(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                    t["dt_bias"], pr.dt_softplus, idx)
    assert torch.isfinite(got).all()
    tol = tolerance(pr.dtype, pr.state_dtype)
    assert rel_err(got, ref_y) < tol, (rel_err(got, ref_y), tol)
    assert rel_err(state, ref_s) < tolerance(pr.state_dtype), rel_err(state, ref_s)


CASES = [
    # ngroups > 1 (two heads per group), D per head, z, dt_bias + softplus, fp32 state
    (DecodeProblem(2, 4, 4, 16, 2, "fp32", "fp32", has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True),
     DecodeConfig(heads=2, block_p=4)),
    # bf16 state and inputs, no gate
    (DecodeProblem(2, 2, 4, 16, 1, "bf16", "bf16", has_D=True), None),
    # fp16 state and inputs, dt_bias without softplus, the dstate walked in slices (dstate 24: a
    # partial last slice)
    (DecodeProblem(2, 2, 4, 24, 1, "fp16", "fp16", has_dt_bias=True, has_z=True),
     DecodeConfig(layout="tiled", block_n=16, block_p=2, heads=2, pdl=1)),
    # bf16 state with fp32 inputs; headdim 6 against a tile of 4: a partial headdim tile
    (DecodeProblem(2, 2, 6, 16, 2, "fp32", "bf16", has_z=True), DecodeConfig(block_p=4, heads=2, pdl=1)),
    # resident programs walking the tiles (3 programs in the interpreter: 18 tiles, 6 each), a
    # partial headdim tile, two groups, two pipeline stages
    (DecodeProblem(3, 4, 6, 16, 2, "bf16", "fp32", has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True),
     DecodeConfig(layout="persistent", block_p=4, stages=2)),
]


@pytest.mark.parametrize("i", range(len(CASES)), ids=["fp32-g2-D-z-softplus", "bf16", "fp16-tiled-pdl", "bf16state-fp32-pdl", "persistent"])
def test_matches_float64_reference(i):
    pr, cfg = CASES[i]
    t = tune_inputs(pr, DEV, seed=i)   # the tied-stride forms Mamba-2 passes
    assert t["dt"].stride()[-1] == 0 and t["A"].stride()[1:] == (0, 0)
    got, state = _run(t, pr, cfg)
    _check(pr, t, got, state)


def test_plain_forms_tied_D_and_state_updated_in_place():
    """dt (batch, nheads), A and dt_bias (nheads,), D (nheads, headdim) varying over headdim; the
    caller's state tensor itself holds the new state; out allocated when not given."""
    pr = DecodeProblem(2, 2, 4, 16, 1, "fp32", "fp32", has_D=True, has_dt_bias=True, dt_softplus=True)
    t = tune_inputs(pr, DEV, seed=3)
    t["dt"] = t["dt"][..., 0].contiguous()
    t["A"] = t["A"][:, 0, 0].contiguous()
    t["dt_bias"] = t["dt_bias"][:, 0].contiguous()
    t["D"] = torch.randn(2, 4, device=DEV)
    state = t["state"].clone()
    ptr = state.data_ptr()
    got = selective_state_update(state, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["dt_bias"],
                                 dt_softplus=True)
    assert state.data_ptr() == ptr and got.shape == t["x"].shape and got.dtype == t["x"].dtype
    _check(pr, t, got, state)


def test_multi_token_step():
    """x (batch, T, nheads, headdim): T tokens per row in one step equal T single steps."""
    pr = DecodeProblem(2, 2, 4, 16, 1, "fp32", "fp32", has_D=True, has_z=True, tokens=3)
    t = tune_inputs(pr, DEV, seed=5)
    got, state = _run(t, pr, DecodeConfig(heads=2, block_p=4))
    _check(pr, t, got, state)


@pytest.mark.parametrize("cfg", [DecodeConfig(heads=2, block_p=4), DecodeConfig(layout="persistent", block_p=2)],
                         ids=["whole", "persistent"])
def test_state_batch_indices_pad_permutation_and_bad_index(cfg):
    """Rows update the slots their indices name (a permutation of some of 6 slots); the pad row
    leaves every slot as it was to the bit and outputs 0; an index past the cache outputs NaN and
    touches nothing."""
    pr = DecodeProblem(4, 2, 4, 16, 1, "fp32", "fp32", has_z=True)
    t = tune_inputs(pr, DEV, seed=7)
    cache = torch.randn(6, 2, 4, 16, device=DEV)
    t["state"] = cache
    idx = torch.tensor([4, -1, 0, 9], dtype=torch.int32, device=DEV)
    got, state = _run(t, pr, cfg, idx=idx)
    ref_y, ref_s = state_update_ref(cache, t["x"], t["dt"], t["A"], t["B"], t["C"], None, t["z"], None, False, idx)
    for s in (1, 2, 3, 5):   # slots no row names (the pad row's and the bad row's included)
        assert torch.equal(state[s], cache[s])
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.isnan(got[3]).all()
    ok = [0, 2]
    assert rel_err(got[ok], ref_y[ok]) < tolerance("fp32")
    assert rel_err(state[[4, 0]], ref_s[[4, 0]]) < tolerance("fp32")


def test_second_call_reuses_the_call_key():
    pr = DecodeProblem(1, 2, 4, 16, 1, "fp32", "fp32")
    t = tune_inputs(pr, DEV, seed=11)
    dec.clear_cache()
    a, sa = _run(t, pr, DecodeConfig(heads=2, block_p=4))
    assert len(dec._calls) == 1
    t2 = dict(t, x=torch.randn_like(t["x"]))
    b, sb = _run(t2, pr, DecodeConfig(heads=2, block_p=4))
    assert len(dec._calls) == 1   # same shapes, dtypes and strides: no second validation
    _check(pr, t2, b, sb)


def test_reference_agrees_with_the_recurrent_forward():
    """T decode steps from a state equal the forward's recurrence from that initial state."""
    g = torch.Generator().manual_seed(0)
    b, T, h, p, n, ng = 2, 5, 4, 3, 8, 2
    x, z = torch.randn(b, T, h, p, generator=g), torch.randn(b, T, h, p, generator=g)
    dt = torch.rand(b, T, h, generator=g) - 0.5
    A, D, bias = -torch.rand(h, generator=g) - 0.5, torch.randn(h, generator=g), torch.randn(h, generator=g)
    B, C = torch.randn(b, T, ng, n, generator=g), torch.randn(b, T, ng, n, generator=g)
    s0 = torch.randn(b, h, p, n, generator=g)
    y, s = state_update_ref(s0, x, dt, A, B, C, D, z, bias, True)
    y2, s2, _ = ssd_recurrent(x, dt, A, B, C, D=D, z=z, dt_bias=bias, initial_states=s0, dt_softplus=True)
    assert torch.allclose(y, y2) and torch.allclose(s, s2)


# --- bad input: clear errors naming the argument, before any launch ---------------------------
def _args():
    pr = DecodeProblem(2, 2, 4, 16, 1, "fp32", "fp32")
    t = tune_inputs(pr, DEV)
    return dict(state=t["state"], x=t["x"], dt=t["dt"], A=t["A"], B=t["B"], C=t["C"])


@pytest.mark.parametrize("change,exc,name", [
    (lambda a: a.update(state=a["state"][0]), ValueError, "state"),
    (lambda a: a.update(state=a["state"].int()), TypeError, "state"),
    (lambda a: a.update(x=a["x"][:, :1]), ValueError, "x"),
    (lambda a: a.update(x="x"), TypeError, "x"),
    (lambda a: a.update(dt=a["dt"][:1]), ValueError, "dt"),
    (lambda a: a.update(A=torch.randn(2, 4, 16, device=DEV)), ValueError, "A"),
    (lambda a: a.update(B=torch.randn(2, 3, 16, device=DEV)), ValueError, "B"),
    (lambda a: a.update(C=a["C"][..., :8]), ValueError, "C"),
    (lambda a: a.update(D=torch.randn(3, device=DEV)), ValueError, "D"),
    (lambda a: a.update(z=torch.randn(2, 2, 5, device=DEV)), ValueError, "z"),
    (lambda a: a.update(dt_bias=torch.randn(2, 4, 1, device=DEV)), ValueError, "dt_bias"),
    (lambda a: a.update(state_batch_indices=torch.zeros(2, device=DEV)), TypeError, "state_batch_indices"),
    (lambda a: a.update(state_batch_indices=torch.zeros(3, dtype=torch.int32, device=DEV)), ValueError, "state_batch_indices"),
    (lambda a: a.update(state=torch.randn(3, 2, 4, 16, device=DEV)), ValueError, "state"),
    (lambda a: a.update(out=torch.empty(2, 2, 3, device=DEV)), ValueError, "out"),
    (lambda a: a.update(pad_slot_id=-1.0), TypeError, "pad_slot_id"),
    (lambda a: a.update(dt_softplus="False"), TypeError, "dt_softplus"),
    (lambda a: a.update(out=torch.empty(1, 2, 4, device=DEV).expand(2, 2, 4)), ValueError, "out"),
    (lambda a: a.update(A=a["A"].to("meta")), ValueError, "A"),
])
def test_bad_input_names_the_argument(change, exc, name):
    a = _args()
    change(a)
    with pytest.raises(exc, match=rf"^{name}:"):
        selective_state_update(**a)


def test_a_flag_or_slot_id_is_judged_the_same_on_a_cached_call():
    """The validated-call caches key on the arguments as given, with their types: a "False" or a
    1.0 after a cached True, a -1.0 after a cached -1, still fail by name; a numpy pad slot id
    works on the first call as on later ones."""
    import numpy as np
    a = _args()
    for good, bad in ((dict(dt_softplus=True), dict(dt_softplus="False")),
                      (dict(dt_softplus=True), dict(dt_softplus=1.0)),
                      (dict(pad_slot_id=-1), dict(pad_slot_id=-1.0))):
        selective_state_update(**{**a, "state": a["state"].clone()}, **good)
        with pytest.raises(TypeError, match=rf"^{next(iter(bad))}:"):
            selective_state_update(**{**a, "state": a["state"].clone()}, **bad)
    outs = [selective_state_update(**{**a, "state": a["state"].clone()}, pad_slot_id=pad)
            for pad in (np.int64(-1), -1, np.int64(-1))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


# --- knobs, rules, records ----------------------------------------------------------------------
def test_every_knob_changes_the_rendered_kernel():
    base = DecodeConfig(layout="tiled")
    h0 = render.kernel_hash(base, "cuda")
    for knob in KNOBS:
        other = next(v for v in knob.values if v != base[knob.name])
        assert render.kernel_hash(base.replace(**{knob.name: other}), "cuda") != h0, knob.name
    whole = DecodeConfig()
    assert whole.replace(block_n=16) == whole   # block_n shapes only the tiled layout


def test_defaults_are_feasible_and_rules_refuse_what_cannot_run():
    big = DecodeProblem(64, 80, 64, 128, 1, "bf16", "fp32", has_D=True, dt_softplus=True, has_dt_bias=True)
    for arch in ("sm80", "sm90", "gfx90a", "gfx942"):
        for pr in (big, big.replace(batch=1, tokens=4), big.replace(dstate=4096), DecodeProblem(1, 3, 5, 7, 1, "fp32")):
            assert violations(default_config(arch, pr), arch, pr) == [], (arch, pr)
    assert default_config("sm90", big.replace(dstate=4096)).layout == "tiled"
    for layout in ("whole", "tiled", "persistent"):   # the default at a pinned layout keeps it
        cfg = default_config("sm90", big, layout=layout)
        assert cfg.layout == layout and violations(cfg, "sm90", big) == [], (layout, cfg)
    small = DecodeProblem(1, 2, 4, 16, 1, "fp32")
    assert any("block_p" in w for w in violations(DecodeConfig(block_p=8), "sm90", small))
    for layout in ("tiled", "persistent"):
        assert any("tokens" in w for w in violations(DecodeConfig(layout=layout), "sm90", small.replace(tokens=2)))
    huge = DecodeProblem(2**20, 64, 32, 16, 1, "bf16")   # 2^31 tiles of one headdim row
    assert any("32-bit tile index" in w for w in violations(DecodeConfig(layout="persistent", block_p=1), "sm90", huge))
    assert not any("tile index" in w for w in violations(DecodeConfig(block_p=1), "sm90", huge))
    assert any("spill" in w for w in violations(DecodeConfig(block_p=64, warps=1), "sm90", big))
    with pytest.raises(ValueError, match="ngroups"):
        DecodeProblem(1, 3, 4, 16, 2, "fp32")
    assert DecodeProblem(**big.key()) == big
    op = get_op("ssd_decode")
    assert op.problem_type is DecodeProblem and op.config_type is DecodeConfig
    assert op.fn("cost_model")(big, default_config("sm90", big))[0].unique_bytes == big.min_bytes()


def test_the_shared_lookup_picks_exact_then_nearest_then_the_default(monkeypatch):
    """An exact record; a batch within the nearest bound takes the closest record; a problem no
    record can serve (fp32 inputs from bf16 records: never transferred) gets the default."""
    from autossd.db import make_record
    pr = DecodeProblem(16, 2, 4, 16, 1, "bf16")
    tuned, other = DecodeConfig(block_p=2, heads=2, warps=2), DecodeConfig(block_p=4, heads=1, warps=1)
    recs = [make_record(pr, tuned, "sm90", provenance="measured", time_ms=0.01, op="ssd_decode"),
            make_record(pr.replace(batch=64), other, "sm90", provenance="measured", time_ms=0.02, op="ssd_decode")]
    import autossd.db.lookup as lookup
    monkeypatch.setattr(lookup, "load_records", lambda arch, op, db=None: recs)
    cfg, why = dec.choose(pr, "sm90")
    assert cfg == tuned and why.startswith("exact match")
    assert dec.choose(pr.replace(batch=24), "sm90")[0] == tuned      # 1.5x from 16, 2.7x from 64
    assert dec.choose(pr.replace(batch=48), "sm90")[0] == other
    far = pr.replace(dtype="fp32")
    cfg, why = dec.choose(far, "sm90")
    assert cfg == default_config("sm90", far) and why.startswith("default config")


def test_the_persistent_layout_launches_what_keeps_the_memory_busy(monkeypatch):
    """Per SM, enough programs that their pipelined tiles keep IN_FLIGHT_PER_SM loading, at most
    what an SM runs at once (threads per SM over the program's, 32), never more than the tiles;
    three elsewhere (the interpreter, meta tensors)."""
    pr = DecodeProblem(16, 80, 64, 128, 1, "bf16", "bf16")
    monkeypatch.setattr(dec, "_device_limits", lambda index: (132, 2048, 32))
    cuda = torch.device("cuda", 0)
    cfg = DecodeConfig(layout="persistent", block_p=16, warps=2, stages=2)   # 4 KB tiles, two in flight
    assert dec.programs(pr, cfg, cuda) == 132 * (dec.IN_FLIGHT_PER_SM // (2 * 4096))
    assert dec.programs(pr, cfg.replace(block_p=1, stages=1), cuda) == 132 * 32      # 256-byte tiles: 32 an SM
    assert dec.programs(pr, cfg.replace(block_p=1, warps=8), cuda) == 132 * 8        # 8 warps: 8 an SM
    assert dec.programs(pr.replace(batch=1, nheads=2), cfg.replace(block_p=64), cuda) == 2
    assert dec.programs(pr, DecodeConfig(layout="persistent"), torch.device("cpu")) == 3
    (ln,) = get_op("ssd_decode").fn("meta_launches")(pr, DecodeConfig(layout="persistent"), "cuda")
    assert ln.kernel == "ssd_decode_persistent" and ln.grid == (3, 1, 1) and ln.args["ROWS"] == 16


def test_meta_launches_plan_the_one_kernel():
    pr = DecodeProblem(16, 80, 64, 128, 1, "bf16", "bf16", has_D=True, has_z=True)
    cfg = default_config("sm90", pr)
    (ln,) = get_op("ssd_decode").fn("meta_launches")(pr, cfg, "cuda")
    assert ln.kernel == "ssd_decode_whole" and ln.grid == (16, math.ceil(64 / cfg.block_p), 80)
    assert ln.args["s_dt_p"] == 0 and ln.args["s_D_p"] == 0 and ln.options["num_warps"] == cfg.warps


@pytest.mark.slow
def test_cross_compiles_for_nvidia_and_amd_without_spills():
    """The default config, a tiled and a persistent one, compile for sm90 and gfx942 on meta tensors (a
    spawned compile worker: the interpreter cannot compile) with no register spills; on sm90 also
    a programmatic dependent launch."""
    from autossd.compile import compile_config
    pr = DecodeProblem(16, 80, 64, 128, 1, "bf16", "fp32", has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    for arch in ("sm90", "gfx942"):
        pdl = [DecodeConfig(pdl=1, block_p=16, warps=2)] if arch == "sm90" else []
        walk = DecodeConfig(layout="persistent", block_p=8, warps=1 if arch == "sm90" else 2, stages=2)
        for cfg in (default_config(arch, pr), DecodeConfig(layout="tiled", block_p=8, heads=2), walk, *pdl):
            rep = compile_config(cfg, arch, pr)
            assert rep.ok and rep.stages and all(s.spill_bytes == 0 for s in rep.stages), (arch, cfg, rep)


def test_a_kept_key_replays_without_building_the_key(monkeypatch):
    """The routing on a GPU, with the launches stubbed (the interpreter records none): a call of a
    kept key replays its record with the new tensors' pointers, and returns a fresh out; a call
    with another shape, or with the replay refused (a profiler's hook, another device), takes
    the checked path."""
    from autossd.ops.common import launch_cache as lc
    full = dict(has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    pr = DecodeProblem(2, 4, 8, 16, 1, "bf16", "fp32", **full)
    cfg = DecodeConfig(heads=2, block_p=8)
    dec.clear_cache()
    seen = {"launch": 0, "replay": []}

    def launch(call, t):
        seen["launch"] += 1
        call.record = ["record"]

    monkeypatch.setattr(dec, "_launch", launch)
    monkeypatch.setattr(lc, "pointers_only", lambda record: record == ["record"])
    refuse = []
    monkeypatch.setattr(lc, "replay_ptrs",
                        lambda record, names, ptrs, device: (seen["replay"].append(dict(zip(names, ptrs))), not refuse)[1])

    def call(p=pr):
        t = tune_inputs(p, DEV, seed=5)
        y = selective_state_update(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                   t["dt_bias"], p.dt_softplus, config=cfg)
        return t, y

    call()
    t, y = call()
    assert seen["launch"] == 1 and len(seen["replay"]) == 1
    ptrs = seen["replay"][0]
    assert ptrs == {"state": t["state"].data_ptr(), "x": t["x"].data_ptr(), "dt": t["dt"].data_ptr(),
                    "A": t["A"].data_ptr(), "B": t["B"].data_ptr(), "C": t["C"].data_ptr(),
                    "D": t["D"].data_ptr(), "z": t["z"].data_ptr(), "dt_bias": t["dt_bias"].data_ptr(),
                    "out": y.data_ptr()}
    assert y.shape == t["x"].shape and y.dtype == t["x"].dtype
    call(DecodeProblem(3, 4, 8, 16, 1, "bf16", "fp32", **full))   # another batch: a new key, checked
    assert seen["launch"] == 2 and len(seen["replay"]) == 1
    refuse.append(True)
    call()
    assert seen["launch"] == 3 and len(seen["replay"]) == 2   # refused: launched the checked way
    refuse.clear()
    # the caller's out: a key of its own (out given), then replayed with that buffer's pointer
    outs = []
    for _ in range(2):
        t = tune_inputs(pr, DEV, seed=6)
        outs.append(torch.empty_like(t["x"]))
        y = selective_state_update(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                   t["dt_bias"], pr.dt_softplus, out=outs[-1], config=cfg)
        assert y is outs[-1]
    assert seen["launch"] == 4 and len(seen["replay"]) == 3
    assert seen["replay"][-1]["out"] == outs[-1].data_ptr() and seen["replay"][-1]["x"] == t["x"].data_ptr()
    dec.clear_cache()
