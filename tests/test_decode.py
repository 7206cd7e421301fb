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
    (lambda a: a.update(state=a["state"][0, 0]), ValueError, "state"),   # 3-D: the Mamba-1 form
    (lambda a: a.update(state=a["state"].int()), TypeError, "state"),
    (lambda a: a.update(x=a["x"][:, :1]), ValueError, "x"),
    (lambda a: a.update(x="x"), TypeError, "x"),
    (lambda a: a.update(dt=a["dt"][:1]), ValueError, "dt"),
    (lambda a: a.update(A=torch.randn(2, 4, 8, device=DEV)), ValueError, "A"),
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
        # a dense A: Mamba 2.8b's layer in the Mamba-1 form (one head of 5120 channels), and the
        # Mamba-2 form's shapes with a dense A
        for dense in (DecodeProblem(16, 1, 5120, 16, 1, "bf16", "bf16", **DENSE), pr.replace(A_dense=True)):
            for cfg in (default_config(arch, dense), default_config(arch, dense, layout="tiled"),
                        default_config(arch, dense, layout="persistent")):
                rep = compile_config(cfg, arch, dense)
                assert rep.ok and rep.stages and all(s.spill_bytes == 0 for s in rep.stages), (arch, cfg, rep)


def _stub_launches(monkeypatch, refuse: list | None = None) -> dict:
    """The GPU routing with the launches stubbed (the interpreter records none): a first call of
    a key "launches" and leaves a record; a kept key's replay is logged with its pointers by name,
    and refused while `refuse` holds anything. Returns the log: launches counted, replays."""
    from autossd.ops.common import launch_cache as lc
    dec.clear_cache()
    seen = {"launch": 0, "replay": []}

    def launch(call, t):
        seen["launch"] += 1
        call.record = ["record"]

    def replay(record, names, ptrs, device):
        seen["replay"].append(dict(zip(names, ptrs)))
        return not refuse

    monkeypatch.setattr(dec, "_launch", launch)
    monkeypatch.setattr(lc, "pointers_only", lambda record: record == ["record"])
    monkeypatch.setattr(lc, "replay_ptrs", replay)
    return seen


def test_a_kept_key_replays_without_building_the_key(monkeypatch):
    """The routing on a GPU, with the launches stubbed (the interpreter records none): a call of a
    kept key replays its record with the new tensors' pointers, and returns a fresh out; a call
    with another shape, or with the replay refused (a profiler's hook, another device), takes
    the checked path."""
    full = dict(has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True)
    pr = DecodeProblem(2, 4, 8, 16, 1, "bf16", "fp32", **full)
    cfg = DecodeConfig(heads=2, block_p=8)
    refuse = []
    seen = _stub_launches(monkeypatch, refuse)

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


# --- a dense A and the Mamba-1 form ------------------------------------------------------------
def _mamba1(t: dict) -> dict:
    """The same call in the Mamba-1 form: a one-head problem's tensors without their head axis
    (state (slots, dim, dstate), x (b, [T,] dim), A (dim, dstate), B (b, [T,] dstate), D (dim,))."""
    at = 2 if t["x"].dim() == 4 else 1

    def drop(v, axis):
        return None if v is None else v.select(axis, 0)

    return dict(state=t["state"][:, 0], x=drop(t["x"], at), dt=drop(t["dt"], at), A=t["A"][0],
                B=drop(t["B"], at), C=drop(t["C"], at), D=drop(t["D"], 0), z=drop(t["z"], at),
                dt_bias=drop(t["dt_bias"], 0))


def _spread(v):
    """v with the same values in memory that is not contiguous: every axis' stride doubled (as a
    slice of a larger buffer is), so a kernel that assumes dense rows or columns reads wrong."""
    if v is None:
        return None
    big = torch.full([2 * n for n in v.shape], float("nan"), dtype=v.dtype, device=v.device)
    view = big[tuple(slice(None, None, 2) for _ in v.shape)]
    view.copy_(v)
    return view


DENSE = dict(has_D=True, has_z=True, has_dt_bias=True, dt_softplus=True, A_dense=True)
DENSE_CASES = [
    # the Mamba-2 form with A, dt, D and dt_bias varying over headdim (A over dstate too): two
    # groups, two heads a program, fp32
    ("m2-fp32", DecodeProblem(2, 4, 4, 16, 2, "fp32", "fp32", **DENSE), DecodeConfig(heads=2, block_p=4, a_dense=1), False),
    # bf16 state and inputs, dstate walked in slices with a partial last slice, no D
    ("m2-bf16-tiled", DecodeProblem(2, 2, 4, 24, 1, "bf16", "bf16", has_z=True, has_dt_bias=True, dt_softplus=True,
                                    A_dense=True),
     DecodeConfig(layout="tiled", block_n=16, block_p=2, heads=2, a_dense=1), False),
    # fp16, resident programs walking the tiles, no optional input, no softplus
    ("m2-fp16-persistent", DecodeProblem(3, 2, 6, 16, 1, "fp16", "fp16", A_dense=True),
     DecodeConfig(layout="persistent", block_p=4, stages=2, a_dense=1), False),
    # T tokens per row, the A tile held through them
    ("m2-tokens", DecodeProblem(2, 2, 4, 16, 2, "bf16", "fp32", tokens=3, **DENSE), DecodeConfig(block_p=4, a_dense=1),
     False),
    # the Mamba-1 form (one head of headdim = dim): dim 40 against 16-row tiles (a partial tile),
    # fp32, the looked-up config
    ("m1-fp32", DecodeProblem(2, 1, 40, 16, 1, "fp32", "fp32", **DENSE), None, True),
    ("m1-bf16-state", DecodeProblem(2, 1, 24, 16, 1, "fp32", "bf16", **DENSE), DecodeConfig(block_p=8, a_dense=1), True),
    ("m1-fp16-tiled", DecodeProblem(2, 1, 12, 40, 1, "fp16", "fp16", has_D=True, A_dense=True),
     DecodeConfig(layout="tiled", block_n=16, block_p=4, a_dense=1), True),
    ("m1-bf16-persistent", DecodeProblem(3, 1, 20, 16, 1, "bf16", "bf16", has_z=True, has_dt_bias=True, A_dense=True),
     DecodeConfig(layout="persistent", block_p=8, a_dense=1), True),
    ("m1-tokens", DecodeProblem(2, 1, 12, 16, 1, "fp32", "fp32", tokens=2, **DENSE), DecodeConfig(block_p=4, a_dense=1),
     True),
]


@pytest.mark.parametrize("spread", [False, True], ids=["dense", "strided"])
@pytest.mark.parametrize("i", range(len(DENSE_CASES)), ids=[c[0] for c in DENSE_CASES])
def test_dense_A_and_the_mamba1_form_match_float64(i, spread):
    """A dense A in both forms against the float64 reference, out= poisoned; strided: every
    input (the state too) laid out with doubled strides."""
    _, pr, cfg, m1 = DENSE_CASES[i]
    t = tune_inputs(pr, DEV, seed=20 + i)
    assert t["A"].stride()[-1] != 0 and (t["dt"].stride()[-1] != 0)
    if m1:
        t = _mamba1(t)
        assert t["state"].dim() == 3 and t["A"].dim() == 2
    if spread:
        t = {k: _spread(v) for k, v in t.items()}
    problem, picked, _ = dec.kernel_for(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                        t["dt_bias"], pr.dt_softplus)
    assert problem == pr and picked.a_dense == 1
    if spread:   # _run clones the state (a dense copy): keep its strides
        state = _spread(t["state"])
        out = _spread(torch.full_like(t["x"], float("nan")))
        got = selective_state_update(state, t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"],
                                     pr.dt_softplus, out=out, config=cfg)
        assert got is out and state.stride() != t["state"].contiguous().stride()
    else:
        got, state = _run(t, pr, cfg)
    assert got.shape == t["x"].shape
    _check(pr, t, got, state)


@pytest.mark.parametrize("m1", [False, True], ids=["m2", "m1"])
def test_dense_A_cache_slots_pad_slot_and_out(m1):
    """Dense A, in each form, with cache slots: the rows update the slots their indices name; the
    pad row leaves every slot as it was to the bit and outputs 0; an index past the cache outputs
    NaN and touches nothing; the caller's (poisoned) out is written and returned."""
    pr = DecodeProblem(4, 1 if m1 else 2, 8, 16, 1, "bf16", "fp32", **DENSE)
    t = tune_inputs(pr, DEV, seed=31)
    t["state"] = torch.randn(6, pr.nheads, 8, 16, device=DEV)
    if m1:
        t = _mamba1(t)
    idx = torch.tensor([4, -1, 0, 9], dtype=torch.int64, device=DEV)
    got, state = _run(t, pr, None, idx=idx)
    ref_y, ref_s = state_update_ref(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                    t["dt_bias"], True, idx)
    for s in (1, 2, 3, 5):
        assert torch.equal(state[s], t["state"][s])
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.isnan(got[3]).all()
    tol = tolerance("bf16")
    assert rel_err(got[[0, 2]], ref_y[[0, 2]]) < tol
    assert rel_err(state[[4, 0]], ref_s[[4, 0]]) < tolerance("fp32")


def test_a_per_head_A_in_the_mamba1_form_and_the_forms_agree():
    """The Mamba-1 form of a call equals the Mamba-2 form of the same call with one head, to the
    bit (the same kernel on the same values); an A expanded with stride 0 (one value) takes the
    per-head kernel in either form."""
    pr = DecodeProblem(2, 1, 16, 16, 1, "fp32", "fp32", **DENSE)
    t2 = tune_inputs(pr, DEV, seed=41)
    t1 = _mamba1(t2)
    y2, s2 = _run(t2, pr, None)
    y1, s1 = _run(t1, pr, None)
    assert torch.equal(y1, y2[:, 0]) and torch.equal(s1, s2[:, 0])
    tied = dict(t1, A=torch.full((1, 1), -1.5, device=DEV).expand(16, 16))
    problem, cfg, _ = dec.kernel_for(tied["state"], tied["x"], tied["dt"], tied["A"], tied["B"], tied["C"],
                                     tied["D"], tied["z"], tied["dt_bias"], True)
    assert not problem.A_dense and cfg.a_dense == 0
    y, s = _run(tied, pr.replace(A_dense=False), None)
    _check(pr, tied, y, s)


def test_the_mamba1_reference_is_the_textbook_recurrence():
    """The float64 reference's Mamba-1 form against the recurrence written out on its own terms:
    dt' = softplus(dt + bias); h = h exp(dt' A) + dt' x B; y = h C + D x, times z sigmoid(z)."""
    g = torch.Generator().manual_seed(1)
    b, dim, n = 3, 5, 4
    h0, A = torch.randn(b, dim, n, generator=g, dtype=torch.float64), -torch.rand(dim, n, generator=g, dtype=torch.float64)
    x, dt, z = (torch.randn(b, dim, generator=g, dtype=torch.float64) for _ in range(3))
    B, C = torch.randn(b, n, generator=g, dtype=torch.float64), torch.randn(b, n, generator=g, dtype=torch.float64)
    D, bias = torch.randn(dim, generator=g, dtype=torch.float64), torch.randn(dim, generator=g, dtype=torch.float64)
    y, s = state_update_ref(h0, x, dt, A, B, C, D, z, bias, True)
    for i in range(b):
        for c in range(dim):
            d = math.log1p(math.exp(dt[i, c] + bias[c]))
            hc = h0[i, c] * torch.exp(d * A[c]) + d * x[i, c] * B[i]
            yc = (hc * C[i]).sum() + D[c] * x[i, c]
            assert torch.allclose(s[i, c], hc) and torch.allclose(y[i, c], yc * z[i, c] * torch.sigmoid(z[i, c]))


@pytest.mark.parametrize("change,exc,name", [
    (lambda a: a.update(x=a["x"][:, :8]), ValueError, "x"),
    (lambda a: a.update(x=torch.randn(2, 4, 6, device=DEV)), ValueError, "x"),   # the Mamba-2 form's x
    (lambda a: a.update(dt=a["dt"][:, :1]), ValueError, "dt"),
    (lambda a: a.update(A=a["A"][:, :8]), ValueError, "A"),
    (lambda a: a.update(A=a["A"][0]), ValueError, "A"),
    (lambda a: a.update(B=a["B"][:, None]), ValueError, "B"),
    (lambda a: a.update(C=torch.randn(2, 8, device=DEV)), ValueError, "C"),
    (lambda a: a.update(D=torch.randn(2, 24, device=DEV)), ValueError, "D"),
    (lambda a: a.update(dt_bias=torch.randn(23, device=DEV)), ValueError, "dt_bias"),
    (lambda a: a.update(z=torch.randn(2, 1, 24, device=DEV)), ValueError, "z"),
    (lambda a: a.update(out=torch.empty(2, 1, 24, device=DEV)), ValueError, "out"),
    (lambda a: a.update(state=a["state"][0]), ValueError, "state"),
])
def test_bad_input_in_the_mamba1_form_names_the_argument(change, exc, name):
    pr = DecodeProblem(2, 1, 24, 16, 1, "fp32", "fp32", A_dense=True)
    t = _mamba1(tune_inputs(pr, DEV))
    a = dict(state=t["state"], x=t["x"], dt=t["dt"], A=t["A"], B=t["B"], C=t["C"])
    change(a)
    with pytest.raises(exc, match=rf"^{name}:"):
        selective_state_update(**a)


def test_the_dense_kernel_is_the_problem_s_and_per_head_records_keep_their_keys():
    """a_dense follows A_dense: the default takes it, violations refuse the other value either
    way, a tune never offers it; a per-head problem's key leaves A_dense out (the key its
    records were stored under) and reads back; a dense problem's holds it; the dense A's bytes
    count once."""
    from autossd.ops.ssd.decode_knobs import excluded
    per_head = DecodeProblem(16, 80, 64, 128, 1, "bf16", "fp32", has_D=True, has_dt_bias=True, dt_softplus=True)
    dense = per_head.replace(A_dense=True)
    assert "A_dense" not in per_head.key() and DecodeProblem(**per_head.key()) == per_head
    assert dense.key()["A_dense"] is True and DecodeProblem(**dense.key()) == dense
    for arch in ("sm80", "sm90", "gfx90a", "gfx942"):
        assert default_config(arch, per_head).a_dense == 0 and default_config(arch, dense).a_dense == 1
        for layout in ("whole", "tiled", "persistent"):
            cfg = default_config(arch, dense, layout=layout)
            assert cfg.a_dense == 1 and violations(cfg, arch, dense) == [], (arch, layout)
    assert any("a_dense=0" in w for w in violations(DecodeConfig(), "sm90", dense))
    assert any("a_dense=1" in w for w in violations(DecodeConfig(a_dense=1), "sm90", per_head))
    assert excluded(dense) == {"a_dense": (0,)} and excluded(per_head) == {"a_dense": (1,)}
    # the A tile doubles the registers a state element takes: a tile at the limit alone is over it
    at_limit = DecodeConfig(block_p=32, warps=1)   # 32 x 128 / 32 threads = 128 elements each
    assert violations(at_limit, "sm90", per_head) == []
    assert any("spill" in w for w in violations(at_limit.replace(a_dense=1), "sm90", dense))
    assert dense.min_bytes() - per_head.min_bytes() == 80 * 64 * 128 * 4
    from autossd.tuner.search_space import build_space
    for static in (False, True):
        space = build_space("sm90", dense, static=static, op="ssd_decode")
        assert "a_dense" not in [d.name for d in space.dims] and space.pinned["a_dense"] == 1


def test_meta_launches_of_the_dense_kernel():
    pr = DecodeProblem(16, 1, 5120, 16, 1, "bf16", "fp32", **DENSE)   # Mamba 2.8b's layer
    cfg = default_config("sm90", pr)
    (ln,) = get_op("ssd_decode").fn("meta_launches")(pr, cfg, "cuda")
    assert ln.kernel == "ssd_decode_whole" and ln.grid == (16, 5120 // cfg.block_p, 1)
    assert (ln.args["s_A_p"], ln.args["s_A_n"]) == (16, 1) and ln.args["s_dt_p"] == 1 and ln.args["s_D_p"] == 1
    (ln,) = get_op("ssd_decode").fn("meta_launches")(pr.replace(A_dense=False), default_config("sm90", pr.replace(A_dense=False)), "cuda")
    assert "s_A_p" not in ln.args


# --- mamba_ssm's own test forms (tests/ops/triton/test_selective_state_update.py), small ----------
# Its four tests at their parametrizations, with dims scaled down for the interpreter (2048,
# 2048 + 16, 4096 -> 32, 48, 64; headdim 64 -> 4 with dims 2048, 4096 -> 16, 32) and its input
# forms: the state and x, dt, z in itype; A, B, C, D, dt_bias in fp32; a cache of 10x the batch
# with a random permutation of slots; Mamba-2 A, dt, D, dt_bias either per channel or expanded
# from per-head values with stride 0 (tie_hdim). Checked against float64, not its fp32 reference.
# All 540 cases take about 90 s in the interpreter: those at one dim (the partial tile's for the
# Mamba-1 form) and, with heads, one dstate run unmarked (about 15 s), the rest are marked slow
# (deselected by default: `pytest -m slow` runs them).
ITYPES = [torch.float32, torch.float16, torch.bfloat16]
SLOW = pytest.mark.slow
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _check_mamba_ssm_form(state, x, dt, A, B, C, D, z, dt_bias, idx, itype):
    ref_y, ref_s = state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, True, idx)
    new = state.clone()
    out = torch.full_like(x, float("nan"))
    got = selective_state_update(new, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                                 state_batch_indices=idx, out=out)
    assert got is out
    name = _NAMES[itype]
    assert rel_err(got, ref_y) < tolerance(name, name), rel_err(got, ref_y)
    assert rel_err(new, ref_s) < tolerance(name, name), rel_err(new, ref_s)
    if idx is not None:   # the slots no row names are untouched
        rest = torch.ones(state.shape[0], dtype=torch.bool, device=state.device)
        rest[idx.long()] = False
        assert torch.equal(new[rest], state[rest])


@pytest.mark.parametrize("indices", [False, True], ids=["", "batch_indices"])
@pytest.mark.parametrize("itype", ITYPES, ids=_NAMES.get)
@pytest.mark.parametrize("has_z", [False, True])
@pytest.mark.parametrize("dstate", [16, 32, 64])
@pytest.mark.parametrize("dim", [pytest.param(32, marks=SLOW), 48, pytest.param(64, marks=SLOW)])
def test_mamba_ssm_form_mamba1(dim, dstate, has_z, itype, indices):
    g = torch.Generator().manual_seed(0)
    batch = 3 if indices else 2

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    slots = 10 * batch if indices else batch
    state = rnd(slots, dim, dstate, dtype=itype)
    idx = torch.randperm(slots, generator=g)[:batch].to(torch.int32).to(DEV) if indices else None
    x, dt = rnd(batch, dim, dtype=itype), rnd(batch, dim, dtype=itype)
    dt_bias = (torch.rand(dim, generator=g) - 4.0).to(DEV)
    A = (-torch.rand(dim, dstate, generator=g) - 1.0).to(DEV)
    B, C, D = rnd(batch, dstate), rnd(batch, dstate), rnd(dim)
    z = rnd(batch, dim, dtype=itype) if has_z else None
    _check_mamba_ssm_form(state, x, dt, A, B, C, D, z, dt_bias, idx, itype)


@pytest.mark.parametrize("indices", [False, True], ids=["", "batch_indices"])
@pytest.mark.parametrize("itype", ITYPES, ids=_NAMES.get)
@pytest.mark.parametrize("has_z", [False, True])
@pytest.mark.parametrize("tie_hdim", [False, True])
@pytest.mark.parametrize("ngroups", [1, 2, 4])
@pytest.mark.parametrize("dstate", [16, pytest.param(32, marks=SLOW), pytest.param(64, marks=SLOW)])
@pytest.mark.parametrize("dim", [16, pytest.param(32, marks=SLOW)])
def test_mamba_ssm_form_with_heads(dim, dstate, ngroups, tie_hdim, has_z, itype, indices):
    g = torch.Generator().manual_seed(0)
    batch, headdim = (3 if indices else 2), 4
    nheads = dim // headdim

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    slots = 10 * batch if indices else batch
    state = rnd(slots, nheads, headdim, dstate, dtype=itype)
    idx = torch.randperm(slots, generator=g)[:batch].to(torch.int32).to(DEV) if indices else None
    x = rnd(batch, nheads, headdim, dtype=itype)
    if not tie_hdim:
        dt = rnd(batch, nheads, headdim, dtype=itype)
        dt_bias = (torch.rand(nheads, headdim, generator=g) - 4.0).to(DEV)
        A = (-torch.rand(nheads, headdim, dstate, generator=g) - 1.0).to(DEV)
        D = rnd(nheads, headdim)
    else:
        dt = rnd(batch, nheads, dtype=itype)[..., None].expand(batch, nheads, headdim)
        dt_bias = (torch.rand(nheads, generator=g) - 4.0).to(DEV)[:, None].expand(nheads, headdim)
        A = (-torch.rand(nheads, generator=g) - 1.0).to(DEV)[:, None, None].expand(nheads, headdim, dstate)
        D = rnd(nheads)[:, None].expand(nheads, headdim)
    B, C = rnd(batch, ngroups, dstate), rnd(batch, ngroups, dstate)
    z = rnd(batch, nheads, headdim, dtype=itype) if has_z else None
    problem = dec.kernel_for(state, x, dt, A, B, C, D, z, dt_bias, True, idx)[0]
    assert problem.A_dense is not tie_hdim
    _check_mamba_ssm_form(state, x, dt, A, B, C, D, z, dt_bias, idx, itype)


def test_a_kept_key_of_the_mamba1_form_replays_with_its_own_tensors(monkeypatch):
    """The GPU routing with the launches stubbed, as for the Mamba-2 form: a second call of a
    Mamba-1 key replays with the new call's own (2-D and 3-D) tensors' pointers and a fresh
    out of x's shape."""
    pr = DecodeProblem(2, 1, 16, 16, 1, "bf16", "fp32", **DENSE)
    cfg = DecodeConfig(block_p=8, a_dense=1)
    seen = _stub_launches(monkeypatch)
    for seed in (1, 2):
        t = _mamba1(tune_inputs(pr, DEV, seed=seed))
        y = selective_state_update(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"],
                                   t["dt_bias"], True, config=cfg)
    assert seen["launch"] == 1 and len(seen["replay"]) == 1
    assert seen["replay"][0] == {"state": t["state"].data_ptr(), "x": t["x"].data_ptr(), "dt": t["dt"].data_ptr(),
                                 "A": t["A"].data_ptr(), "B": t["B"].data_ptr(), "C": t["C"].data_ptr(),
                                 "D": t["D"].data_ptr(), "z": t["z"].data_ptr(), "dt_bias": t["dt_bias"].data_ptr(),
                                 "out": y.data_ptr()}
    assert y.shape == t["x"].shape == (2, 16)
    dec.clear_cache()
