"""autossd.db.lookup: the four tiers, the nearest bound, the ranking (fresh > stale, measured >
static > default, user > shipped), determinism, and the database precedence."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from autossd.db import add_records, make_record
from autossd.db import engine as dbengine
from autossd.db import lookup as L
from autossd.problem import Problem
from autossd.ops.ssd.fwd_knobs import default_config

P = Problem(2, 4096, 16, 64, 128, 2, "fp16", 256, has_D=True)
BASE = default_config("sm90", P)
CFG = {name: BASE.replace(**kw) for name, kw in {
    "a": dict(scan_warps=8), "b": dict(bmm_warps=8), "c": dict(state_warps=8),
    "d": dict(scan_stages=3), "e": dict(pass_warps=8)}.items()}


def R(cfg="a", problem=P, provenance="measured", time_ms=1.0, origin="user", stale=False, arch="sm90",
      launch_mode=None):
    r = make_record(problem, CFG[cfg] if isinstance(cfg, str) else cfg, arch, provenance=provenance,
                    time_ms=time_ms if provenance == "measured" else None, launch_mode=launch_mode)
    r = replace(r, origin=origin)
    return replace(r, triton_version="0.0.1") if stale else r


pytestmark = pytest.mark.usefixtures("isolated_db")  # conftest: a fresh user DB per test


def test_db_filename_per_arch():
    assert L.db_filename("sm90") == "sm90.sqlite" and L.db_filename("gfx942") == "gfx942.sqlite"


def test_distance_is_log2_ratio_over_size_dims():
    assert L.distance(P, P) == 0.0
    assert L.distance(P, P.replace(seqlen=16384)) == pytest.approx(2.0)
    assert L.distance(P, P.replace(batch=1, seqlen=8192)) == pytest.approx(2.0)
    assert L.distance(P, P.replace(nheads=32, ngroups=1)) == pytest.approx(2.0)


@pytest.mark.parametrize("change", [dict(headdim=32), dict(dstate=64), dict(dtype="bf16"),
                                    dict(chunk_size=128), dict(has_seq_idx=True),
                                    dict(has_z=True, dtype="bf16"), dict(has_D=False, headdim=32)])
def test_distance_is_infinite_when_configs_do_not_transfer(change):
    assert L.distance(P, P.replace(**change)) == math.inf


@pytest.mark.parametrize("flag", ["has_z", "has_D", "D_has_hdim", "has_dt_bias", "dt_softplus",
                                  "has_dt_limit", "has_initial_states", "return_final_states"])
def test_each_epilogue_flag_of_the_forward_adds_the_penalty(flag):
    q = P.replace(**{flag: not getattr(P, flag)})
    assert L.distance(q, P) == L.FLAG_PENALTY > 0
    assert L.distance(q, P.replace(seqlen=8192)) == pytest.approx(1 + L.FLAG_PENALTY)
    assert L.distance(q, P, op="ssd_bwd") == math.inf   # the backward declares no soft flag


def test_flag_penalties_add_up():
    q = P.replace(has_z=True, has_D=False, dt_softplus=True)
    assert L.distance(q, P) == pytest.approx(3 * L.FLAG_PENALTY)
    assert L.distance(q, P.replace(batch=4)) == pytest.approx(1 + 3 * L.FLAG_PENALTY)


def test_exact_beats_nearest_beats_default():
    near = R("b", P.replace(seqlen=8192))
    m = L.pick(P, [near, R("a")], "sm90")
    assert (m.kind, m.config, m.distance) == ("exact", CFG["a"], 0.0)
    m = L.pick(P, [near], "sm90")
    assert (m.kind, m.config, m.distance) == ("nearest", CFG["b"], 1.0)
    assert "distance 1.00" in m.reason and m.record == near
    m = L.pick(P.replace(headdim=128), [near, R("a")], "sm90", transfer=False)
    assert m.kind == "default" and m.config == default_config("sm90", P.replace(headdim=128))
    assert m.record is None and "no measured/static record" in m.reason


def test_nearest_bound_is_enforced_and_explained():
    at_bound = R("b", P.replace(seqlen=16384))        # distance 2
    beyond = R("c", P.replace(seqlen=32768))          # distance 3
    assert L.pick(P, [at_bound], "sm90").kind == "nearest"
    m = L.pick(P, [beyond], "sm90", transfer=False)
    assert m.kind == "default" and m.distance == pytest.approx(3.0)
    assert "3.00 > bound 2" in m.reason
    m = L.pick(P, [beyond], "sm90")   # past the bound, the record's config is carried over
    assert (m.kind, m.config, m.distance) == ("transfer", CFG["c"], 3.0) and "3.00 > bound 2" in m.reason
    assert L.pick(P, [beyond], "sm90", max_distance=3.0).kind == "nearest"


def test_nearest_prefers_smaller_distance_within_a_provenance():
    m = L.pick(P, [R("b", P.replace(seqlen=16384)), R("c", P.replace(seqlen=8192))], "sm90")
    assert m.config == CFG["c"] and m.distance == 1.0


def test_nearest_ignores_default_records_and_infeasible_configs():
    assert L.pick(P, [R("b", P.replace(seqlen=8192), provenance="default")], "sm90").kind == "default"
    # a config fit for 8 heads (cumsum_block_h=8) is not feasible for 4 heads: not nearest; the
    # transfer tier shrinks the tile
    small = P.replace(nheads=4, ngroups=2)
    wide = R(BASE.replace(cumsum_block_h=8), P.replace(nheads=8, ngroups=2))
    assert L.pick(small, [wide], "sm90", transfer=False).kind == "default"
    m = L.pick(small, [wide], "sm90")
    assert m.kind == "transfer" and m.config.cumsum_block_h == 4


def test_a_record_tuned_without_z_serves_a_query_with_z_as_nearest():
    with_z = P.replace(has_z=True)
    no_z = R("b")
    m = L.pick(with_z, [no_z], "sm90")
    assert (m.kind, m.config, m.record) == ("nearest", CFG["b"], no_z)
    assert m.distance == L.FLAG_PENALTY == 0.5
    assert "tuned with has_z=False" in m.reason and "distance 0.50 <= bound 2" in m.reason
    # a flag costs less than doubling a size: the no-z record at the query's size beats the z
    # record at twice the length, which beats the no-z one at twice the length
    z_long = R("c", with_z.replace(seqlen=8192))
    assert L.pick(with_z, [z_long, no_z], "sm90").config == CFG["b"]
    m = L.pick(with_z, [z_long, R("d", P.replace(seqlen=8192))], "sm90")
    assert (m.config, m.distance) == (CFG["c"], 1.0) and "tuned with" not in m.reason
    # through the public lookup, from the user database
    add_records(dbengine.to_url(L.user_db_url()), [no_z])
    m = L.choose(with_z, "sm90")
    assert (m.kind, m.config, m.distance) == ("nearest", CFG["b"], 0.5)


def test_a_flag_difference_past_the_bound_falls_to_the_default():
    with_z = P.replace(has_z=True)
    far = R("b", P.replace(seqlen=16384))             # 2 in size (at the bound) + 0.5 for z
    assert L.pick(P, [far], "sm90").kind == "nearest"
    m = L.pick(with_z, [far], "sm90", transfer=False)
    assert m.kind == "default" and m.config == default_config("sm90", with_z)
    assert m.distance == pytest.approx(2.5) and "2.50 > bound 2" in m.reason
    assert L.pick(with_z, [far], "sm90", max_distance=2.5).kind == "nearest"


def test_exact_still_requires_every_field():
    with_z = P.replace(has_z=True)
    # at the query's size, differing in a soft flag only: nearest, never exact
    assert L.pick(with_z, [R("b")], "sm90").kind == "nearest"
    assert L.pick(with_z, [R("b")], "sm90", max_distance=0.0).kind == "transfer"
    assert L.pick(with_z, [R("b", P.replace(chunk_size=None))], "sm90").kind == "nearest"
    # the record with the query's own flags is exact and wins over a faster one without z
    m = L.pick(with_z, [R("b", time_ms=0.1), R("a", with_z, time_ms=5.0)], "sm90")
    assert (m.kind, m.config, m.distance) == ("exact", CFG["a"], 0.0)


@pytest.mark.parametrize("change", [dict(dtype="bf16"), dict(headdim=128), dict(dstate=64),
                                    dict(chunk_size=128), dict(has_seq_idx=True)])
def test_a_hard_field_never_matches_whatever_the_flags(change):
    with_z = P.replace(has_z=True)
    for rec in (R("b"), R("b", with_z)):
        m = L.pick(with_z.replace(**change), [rec], "sm90", max_distance=100.0, transfer=False)
        assert m.kind == "default" and m.distance == math.inf
        assert "no measured/static record" in m.reason


def test_a_flag_difference_does_not_skip_the_feasibility_check():
    # a config fit for 8 heads (cumsum_block_h=8) is not feasible for 4 heads, with z or without
    small = P.replace(nheads=4, ngroups=2, has_z=True)
    wide = R(BASE.replace(cumsum_block_h=8), P.replace(nheads=8, ngroups=2))
    assert L.distance(small, wide.problem) == pytest.approx(1.5)
    assert L.pick(small, [wide], "sm90", transfer=False).kind == "default"


def test_the_backward_keeps_every_flag_exact():
    from autossd.ops.registry import get_op
    bwd = get_op("ssd_bwd")
    rec = make_record(P, bwd.fn("default_config")("sm90", P), "sm90", provenance="static", op="ssd_bwd")
    assert L.pick(P, [rec], "sm90", op="ssd_bwd").kind == "exact"
    m = L.pick(P.replace(has_z=True), [rec], "sm90", op="ssd_bwd", transfer=False)
    assert m.kind == "default" and m.distance == math.inf


def test_measured_beats_static_beats_default():
    m = L.pick(P, [R("c", provenance="default"), R("b", provenance="static"), R("a", time_ms=5.0)], "sm90")
    assert m.config == CFG["a"] and m.record.provenance == "measured"
    m = L.pick(P, [R("c", provenance="default"), R("b", provenance="static")], "sm90")
    assert m.config == CFG["b"]


def test_fastest_measured_record_wins():
    assert L.pick(P, [R("a", time_ms=2.0), R("b", time_ms=1.0), R("c", time_ms=3.0)], "sm90").config == CFG["b"]


def test_user_database_beats_shipped():
    m = L.pick(P, [R("a", origin="shipped", time_ms=0.1), R("b", origin="user", time_ms=9.0)], "sm90")
    assert m.config == CFG["b"] and "user db" in m.reason


def test_stale_records_rank_below_fresh_and_are_flagged():
    fresh, stale = R("a", time_ms=2.0), R("b", time_ms=1.0, stale=True)
    m = L.pick(P, [stale, fresh], "sm90")
    assert m.config == CFG["a"] and not m.stale
    m = L.pick(P, [stale], "sm90")           # still used when it is all there is ...
    assert m.config == CFG["b"] and m.stale  # ... and flagged, with the reason
    assert "STALE" in m.reason and "triton 0.0.1" in m.reason
    # a stale record of another template is stale too
    m = L.pick(P, [replace(R("c"), template_hash="0123abcd")], "sm90")
    assert m.stale and "kernel hash" in m.reason
    # an exact stale record beats a fresh nearest one: the shape is the stronger signal
    m = L.pick(P, [stale, R("c", P.replace(seqlen=8192))], "sm90")
    assert m.kind == "exact" and m.config == CFG["b"]


def test_pick_is_deterministic_under_any_record_order():
    recs = [R(c, P.replace(seqlen=s), time_ms=1.0) for c in "abcde" for s in (2048, 8192)]
    picks = set()
    rng = random.Random(0)
    for _ in range(20):
        rng.shuffle(recs)
        m = L.pick(P, recs, "sm90")
        picks.add((m.kind, m.config.key()))
    assert len(picks) == 1  # all at distance 1, same time: the config key breaks the tie


def test_other_arch_records_are_ignored():
    assert L.pick(P, [R("a", arch="sm80")], "sm90").kind == "default"


def test_user_database_from_env_and_argument(tmp_path, monkeypatch):
    add_records(str(tmp_path / "user.sqlite"), [R("a")])
    other = tmp_path / "other.sqlite"
    add_records(str(other), [R("b")])
    assert L.choose(P, "sm90").config == CFG["a"]            # AUTOSSD_DB
    assert L.choose(P, "sm90", db=other).config == CFG["b"]  # argument
    monkeypatch.delenv("AUTOSSD_DB")
    monkeypatch.setenv("AUTOSSD_CACHE_DIR", str(tmp_path / "cache"))
    assert L.user_db_url() == dbengine.to_url(tmp_path / "cache" / "tuning.sqlite")


def _shipped_measured():
    shipped = [r for r in L.load_records("sm90", "ssd_fwd") if r.origin == "shipped" and r.provenance == "measured"
               and r.launch_mode == "eager"]
    assert shipped, "the shipped sm90 database has measured records"
    return shipped[0]


def test_user_database_overrides_the_shipped_one():
    target = _shipped_measured().problem
    assert L.choose(target, "sm90").record.origin == "shipped"
    tuned = default_config("sm90", target).replace(scan_warps=8)
    add_records(dbengine.to_url(L.user_db_url()), [make_record(target, tuned, "sm90", provenance="measured",
                                                               time_ms=9.0)])
    m = L.choose(target, "sm90")   # the write invalidated the loaded records
    assert m.kind == "exact" and m.config == tuned and m.record.origin == "user"
    assert "preferred over" not in m.reason


def test_a_shipped_measurement_beats_a_user_prediction_of_the_same_shape():
    """A static tune on a machine without the GPU fills the user database with predictions: the
    shipped database's measured record of the same shape still wins, and the reason says why."""
    import autossd
    from autossd import runtime
    shipped = _shipped_measured()
    target = shipped.problem
    before = L.choose(target, "sm90")
    assert before.record.origin == "shipped" and before.record.provenance == "measured"
    predicted = default_config("sm90", target)
    add_records(dbengine.to_url(L.user_db_url()),
                [make_record(target, predicted, "sm90", provenance="static", predicted_ms=1e-4),
                 make_record(target, predicted, "sm90", provenance="default")])
    assert {(r.origin, r.provenance) for r in L.load_records("sm90", "ssd_fwd") if r.problem == target} >= {
        ("user", "static"), ("user", "default"), ("shipped", "measured")}
    m = L.choose(target, "sm90")
    assert m.kind == "exact" and m.config == before.config
    assert (m.record.origin, m.record.provenance) == ("shipped", "measured")
    assert "measured record from the shipped db" in m.reason
    assert "preferred over a static record from the user db" in m.reason, m.reason
    runtime.clear_cache()
    k = autossd.get_kernel(target, "sm90")          # the public lookup agrees
    assert k.config == before.config and k.match.record.origin == "shipped"
    # captured in a CUDA graph: the shipped graph-replay measurement, not the user's prediction
    g = L.choose(target, "sm90", launch_mode="graph")
    assert g.record.provenance == "measured" and g.record.origin == "shipped"


def test_measured_beats_static_in_either_database_and_in_the_nearest_tier():
    for user, shipped in (("static", "measured"), ("measured", "static")):
        recs = [R("a", provenance=user, origin="user"), R("b", provenance=shipped, origin="shipped")]
        m = L.pick(P, recs, "sm90")
        assert m.record.provenance == "measured", (user, shipped)
        assert ("preferred over a static record from the user db" in m.reason) == (user == "static")
    near = [R("a", P.replace(seqlen=8192), provenance="static", origin="user"),
            R("b", P.replace(seqlen=16384), origin="shipped")]
    m = L.pick(P, near, "sm90")
    assert m.kind == "nearest" and m.config == CFG["b"] and "preferred over a static record" in m.reason
    # a stale measurement still ranks below a fresh prediction of its tier (the timing no longer holds)
    m = L.pick(P, [R("a", provenance="static", origin="user"), R("b", origin="shipped", stale=True)], "sm90")
    assert m.record.provenance == "static" and not m.stale


def test_static_records_rank_by_their_predicted_time():
    slow = replace(R("a", provenance="static"), predicted_ms=2.0)
    fast = replace(R("b", provenance="static"), predicted_ms=1.0)
    assert L.pick(P, [slow, fast], "sm90").config == CFG["b"]


def test_record_tuned_with_free_chunk_answers_any_requested_chunk():
    from autossd.db.lookup import distance
    q = Problem(batch=4, seqlen=16384, nheads=80, headdim=64, dstate=128, ngroups=1, dtype="fp16",
                chunk_size=256, has_D=True)
    free = q.replace(chunk_size=None)
    assert distance(q, free) == 0.0
    assert distance(q, q.replace(chunk_size=128)) == float("inf")  # a pinned chunk is a different key
    assert distance(free, q) == float("inf")  # a pinned record does not answer an unpinned query


def test_each_launch_mode_gets_the_record_timed_that_way():
    recs = [R("a", time_ms=0.10, launch_mode="eager"), R("b", time_ms=0.08, launch_mode="graph")]
    for order in (recs, recs[::-1]):
        assert L.pick(P, order, "sm90").config == CFG["a"]                       # eager by default
        g = L.pick(P, order, "sm90", launch_mode="graph")
        assert g.config == CFG["b"] and "CUDA-graph replay" in g.reason
    # nearest tier too: the graph record two sizes away beats the eager one one size away
    near = [R("a", P.replace(seqlen=8192), launch_mode="eager"),
            R("b", P.replace(seqlen=16384), launch_mode="graph")]
    assert L.pick(P, near, "sm90", launch_mode="graph").config == CFG["b"]
    assert L.pick(P, near, "sm90").config == CFG["a"]


def test_a_mode_without_its_own_record_takes_the_other_measurement_before_a_prediction():
    recs = [R("a", launch_mode="eager"), R("c", provenance="static"), R("d", provenance="default")]
    m = L.pick(P, recs, "sm90", launch_mode="graph")
    assert m.kind == "exact" and m.config == CFG["a"]
    assert L.pick(P, recs[1:], "sm90", launch_mode="graph").config == CFG["c"]   # static: "any"


def test_unknown_launch_mode_is_refused():
    with pytest.raises(ValueError, match="launch_mode"):
        L.pick(P, [R()], "sm90", launch_mode="captured")


# --- the transfer tier -----------------------------------------------------------------------
def test_transfer_carries_a_far_record_over_and_sets_back_what_the_query_cannot_run():
    """A record of another dstate, far in size: its config serves, except the knob the query's
    dstate rules out (the Gluon scans take dstate 64 or 128), which takes the default's value."""
    fam = BASE.replace(state_walk=1, walk_weights=1, scan_gluon=3)
    rec = R(fam, P.replace(batch=64, seqlen=32768))
    m = L.pick(P, [rec], "sm90")
    assert (m.kind, m.config, m.record) == ("transfer", fam, rec)
    assert m.distance == pytest.approx(8.0) and "its config as it is" in m.reason   # 32x batch, 8x length
    q = P.replace(dstate=256)
    m = L.pick(q, [rec], "sm90")
    assert m.kind == "transfer" and m.distance == pytest.approx(9.0)
    assert m.config == fam.replace(scan_gluon=0) and "carried over" in m.reason
    from autossd.ops.registry import get_op
    assert not get_op("ssd_fwd").fn("violations")(m.config, "sm90", q)


def test_transfer_serves_the_other_half_dtype_and_a_requested_chunk_size_but_not_fp32():
    fam = BASE.replace(state_walk=1, scan_gluon=3)
    rec = R(fam, P.replace(seqlen=131072))
    m = L.pick(P.replace(dtype="bf16", chunk_size=128), [rec], "sm90")
    assert m.kind == "transfer" and m.config.chunk_size == 128
    assert m.config.state_dtype == "bf16"   # the Gluon paths keep states in the input dtype
    m = L.pick(P.replace(dtype="fp32"), [rec], "sm90")
    assert m.kind == "default" and m.config == default_config("sm90", P.replace(dtype="fp32"))


@pytest.mark.parametrize("op", ["ssd_fwd", "ssd_bwd"])
def test_transfer_keeps_states_in_the_querys_half_type_where_the_record_kept_them_in_its_own(op):
    """A record whose states follow its 16-bit inputs (fp16 states of an fp16 call) serves a
    bf16 call with bf16 states (fp16's range is narrower), and back; fp32 states stay fp32."""
    from autossd.ops.registry import get_op
    o = get_op(op)
    src = P.replace(seqlen=131072) if op == "ssd_fwd" else Problem(8, 2048, 80, 64, 128, 1, "fp16", has_z=True)
    base = o.fn("default_config")("sm90", src)
    for rec_states, src_dtype, query_dtype, want in [("fp16", "fp16", "bf16", "bf16"), ("bf16", "bf16", "fp16", "fp16"),
                                                     ("fp32", "fp16", "bf16", "fp32")]:
        rec = make_record(src.replace(dtype=src_dtype), base.replace(state_dtype=rec_states), "sm90",
                          provenance="measured", time_ms=1.0, op=op)
        q = src.replace(dtype=query_dtype, seqlen=src.seqlen // 4)
        m = L.pick(q, [rec], "sm90", op=op)
        assert m.kind == "transfer" and m.config.state_dtype == want, (rec_states, query_dtype, m.reason)


def test_transfer_ranks_like_the_other_tiers_and_prefers_the_closer_record():
    far, farther = R("b", P.replace(seqlen=65536)), R("c", P.replace(seqlen=131072))
    assert L.pick(P, [farther, far], "sm90").config == CFG["b"]
    assert L.pick(P, [far, R("c", P.replace(seqlen=131072), provenance="static")], "sm90").config == CFG["b"]
    m = L.pick(P, [far, R("d", P.replace(seqlen=131072), time_ms=0.1)], "sm90")
    assert m.config == CFG["b"]   # measured both: the closer, not the faster


def test_transfer_through_the_public_lookup_and_the_runtime():
    import autossd
    fam = BASE.replace(state_walk=1, walk_weights=1, scan_gluon=3)
    add_records(dbengine.to_url(L.user_db_url()), [R(fam, P.replace(seqlen=131072, batch=1))])
    q = P.replace(batch=32, nheads=48, ngroups=1)
    m = L.choose(q, "sm90")
    assert m.kind == "transfer" and m.config == fam
    k = autossd.get_kernel(q, "sm90")
    assert k.source == "transfer" and k.config == fam


def test_measurements_on_the_callers_device_rank_first():
    """An H200 picks the H200's record of a shape over a faster H100 one of the same arch, in every
    tier; without a device (an arch asked for by name) the faster one wins."""
    h100 = replace(make_record(P, CFG["a"], "sm90", provenance="measured", time_ms=1.0,
                               device="NVIDIA H100 80GB HBM3"), origin="user")
    h200 = replace(make_record(P, CFG["b"], "sm90", provenance="measured", time_ms=1.5, device="NVIDIA H200"),
                   origin="user")
    assert L.pick(P, [h100, h200], "sm90").config == CFG["a"]
    assert L.pick(P, [h100, h200], "sm90", device="NVIDIA H200").config == CFG["b"]
    assert L.pick(P, [h100, h200], "sm90", device="NVIDIA H100 80GB HBM3").config == CFG["a"]
    near = P.replace(seqlen=8192)
    assert L.pick(near, [h100, h200], "sm90", device="NVIDIA H200").config == CFG["b"]
    far = P.replace(seqlen=131072)
    m = L.pick(far, [h100, h200], "sm90", device="NVIDIA H200")
    assert m.kind == "transfer" and m.config == CFG["b"]
    # a prediction names no device: a measurement from another device still beats it
    static = replace(make_record(P, CFG["c"], "sm90", provenance="static"), origin="user")
    assert L.pick(P, [h100, static], "sm90", device="NVIDIA H200").config == CFG["a"]


def test_a_prediction_does_not_hide_the_arch_measurements_at_other_sizes():
    """A static record at the query's very shape (a static sm90 tune, which leaves out the Gluon
    paths) against a measured record far away: the measured config is carried over; without any
    fresh measured record the static one serves."""
    fam = BASE.replace(state_walk=1, walk_weights=1, scan_gluon=3)
    static = R("a", provenance="static", origin="user")
    far = R(fam, P.replace(batch=64, seqlen=65536), origin="shipped")
    m = L.pick(P, [static, far], "sm90")
    assert (m.kind, m.config, m.record) == ("transfer", fam, far)
    assert "a measurement beats a prediction: the exact record is static" in m.reason
    assert L.pick(P, [static, far], "sm90", transfer=False).record == static
    stale = replace(far, triton_version="0.0.1")
    assert L.pick(P, [static, stale], "sm90").record == static
    assert L.pick(P, [static], "sm90").record == static
