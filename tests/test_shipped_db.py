"""The shipped static databases (tuning_db/sm80, gfx90a, gfx942.sqlite): every shape of the model
grid (autossd/tuner/shapes.py) resolves to an exact, fresh, static forward record of the shipped
file, the backward to one at every grid shape and at the training shapes, and the files open
read-only (no write-ahead log left in them). The measured sm90 file: the H200's records over the
grids of the forward, the decode step and packed prefill, and an H100's and an H200's records of
the benchmark's shapes side by side, each GPU's lookup taking its own."""
from __future__ import annotations

import sqlite3

import pytest

import autossd
from autossd.db import lookup
from autossd.db.records import read_records
from autossd.tuner.shapes import grid, parse_shapes

STATIC_ARCHS = ("sm80", "gfx90a", "gfx942")

pytestmark = pytest.mark.usefixtures("isolated_db")   # conftest: an empty user DB, caches reset


@pytest.mark.parametrize("arch", ("sm90",) + STATIC_ARCHS)
def test_the_file_is_a_single_read_only_friendly_database(arch):
    path = lookup.shipped_db_path(arch)
    assert path is not None, f"tuning_db/{arch}.sqlite is missing"
    assert not path.with_name(path.name + "-wal").exists()
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal"


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_the_file_holds_one_static_record_per_grid_shape(arch):
    recs = read_records(str(lookup.shipped_db_path(arch)), arch, "ssd_fwd", immutable=True)
    assert {r.provenance for r in recs} == {"static"}
    by_problem = {r.problem: r for r in recs}
    missing = [p for p in grid(op="ssd_fwd") if p not in by_problem]
    assert not missing, f"{len(missing)} grid shapes have no record, e.g. {missing[0]}"
    # fresh: made by the triton and the kernel code running now (a change to a template the
    # records' configs launch makes them stale: the grid is then re-tuned and the file rebuilt)
    now = lookup._freshness()
    stale = [(r.problem, why) for r in recs if (why := r.stale_reasons(*now))]
    assert not stale, f"{len(stale)} stale records, e.g. {stale[0]}"


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_get_kernel_at_every_grid_shape_returns_the_exact_fresh_static_record(arch):
    for p in grid(op="ssd_fwd"):   # ~10 ms a lookup
        k = autossd.get_kernel(p, arch)
        assert k.source == "exact", (p, k.match.reason)
        rec = k.match.record
        assert rec.provenance == "static" and rec.origin == "shipped" and not k.match.stale, k.match.reason
        assert rec.problem == p


# the decode step's static records over its grid, whole-dstate tiles only (the layout the model
# was checked on against the H200's sweeps); packed prefill ships none (its model's top-1 ran
# 1.15x the best there, the default 1.05x), so its calls on these arches take the default
@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_the_decode_step_at_every_grid_shape_takes_its_exact_fresh_static_record(arch):
    from autossd.ops.ssd import decode
    recs = read_records(str(lookup.shipped_db_path(arch)), arch, "ssd_decode", immutable=True)
    assert {r.provenance for r in recs} == {"static"} and {r.config.layout for r in recs} == {"whole"}
    by_problem = {r.problem: r for r in recs}
    now = lookup._freshness()
    for p in grid(op="ssd_decode"):
        r = by_problem[p]
        assert not r.stale_reasons(*now), (p, r.stale_reasons(*now))
        config, why = decode.choose(p, arch)
        assert why.startswith("exact match: static record from the shipped db") and config == r.config, (p, why)
    assert not read_records(str(lookup.shipped_db_path(arch)), arch, "ssd_varlen", immutable=True)


# each static file holds the backward's records over the whole model grid too (a static tune of
# the grid's 476 shapes takes 35-49 min an arch on a 2-core host)
@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_the_backward_at_every_grid_shape_finds_its_exact_fresh_static_record(arch):
    from autossd.ops.ssd.backward import config_for
    recs = lookup.load_records(arch, "ssd_bwd")
    for p in grid(op="ssd_bwd"):
        m = lookup.pick(p, recs, arch, op="ssd_bwd")
        assert m.kind == "exact" and not m.stale, (p, m.reason)
        assert m.record.provenance == "static" and m.record.origin == "shipped" and m.record.problem == p
        assert config_for(p, arch) == m.config


# the backward's shipped shapes: training steps of Mamba-2 2.7b and 130m and of Codestral
TRAINING = ["mamba2-2.7b:b=8,l=2048", "mamba2-2.7b:b=4,l=16384", "mamba2-2.7b:b=1,l=65536",
            "mamba2-130m:b=4,l=8192", "codestral-7b:b=1,l=65536"]


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_the_backward_at_training_shapes_finds_its_exact_fresh_static_record(arch):
    from autossd.ops.ssd.backward import config_for
    probs = parse_shapes(TRAINING, "fp16", op="ssd_bwd") + parse_shapes(TRAINING, "bf16", op="ssd_bwd")
    recs = lookup.load_records(arch, "ssd_bwd")
    for p in probs:
        m = lookup.pick(p, recs, arch, op="ssd_bwd")
        assert m.kind == "exact" and not m.stale, (p, m.reason)
        assert m.record.provenance == "static" and m.record.origin == "shipped"
        assert config_for(p, arch) == m.config   # what the training path's backward runs



# the measured sm90 grid: the H200's records at the grid shapes its 4-GPU tunes finished, per op
# (the forward: three candidates each, the default, the stored records' pick and the first seed
# family; the decode step eight, packed prefill four). The decode step's grid (the Mamba-1 layers'
# dense-A steps included) is measured whole.
SM90_GRID_MEASURED = {"ssd_fwd": 476, "ssd_decode": 240, "ssd_varlen": 56}


def _sm90_choice(op, p, mode):
    """(config, whether it is the H200's own measured record of exactly p) of each op's choice."""
    if op == "ssd_fwd":
        k = autossd.get_kernel(p, "sm90", launch_mode=mode, device="NVIDIA H200")
        return k.config, k.source == "exact" and k.match.record.device == "NVIDIA H200"
    from autossd.ops.ssd import decode, varlen
    config, why = (decode if op == "ssd_decode" else varlen).choose(p, "sm90", device="NVIDIA H200")
    return config, why.startswith("exact match: measured") and "on NVIDIA H200" in why


@pytest.mark.parametrize("op", sorted(SM90_GRID_MEASURED))
def test_sm90_grid_records_are_fresh_measurements_each_found_exactly_on_its_gpu(op):
    recs = read_records(str(lookup.shipped_db_path("sm90")), "sm90", op, immutable=True)
    h200 = {(r.problem, r.launch_mode): r for r in recs if r.device == "NVIDIA H200"}
    shapes = [p for p in grid(op=op) if (p, "graph") in h200 and (p, "eager") in h200]
    assert len(shapes) >= SM90_GRID_MEASURED[op], len(shapes)
    assert {p.dtype for p in shapes} == {"fp16", "bf16"}
    now = lookup._freshness()
    for (p, mode), r in h200.items():
        assert r.provenance == "measured" and r.time_ms > 0 and not r.stale_reasons(*now), (p, mode)
    # the forward's lookup takes the caller's launch mode; the decode step ranks the records timed
    # by graph replay first (its eager timings add the host's launch cost), packed prefill the
    # eager ones (engines run prefills eagerly)
    modes = {"ssd_fwd": ("eager", "graph"), "ssd_decode": ("graph",), "ssd_varlen": ("eager",)}[op]
    for p in shapes:
        for mode in modes:
            config, exact = _sm90_choice(op, p, mode)
            assert exact and config == h200[(p, mode)].config, (op, p, mode)


# the benchmark's forward shapes, measured on both sm90 GPUs (the H200 at 5 of 7 in fp16)
BENCH = ["mamba2-2.7b:b=8,l=2048", "mamba2-2.7b:b=4,l=16384", "mamba2-2.7b:b=1,l=131072",
         "codestral-7b:b=1,l=131072", "mamba2-130m:b=1,l=131072"]
DEVICES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sm90_ships_each_gpus_measurements_and_each_gpu_takes_its_own(dtype):
    recs = lookup.load_records("sm90", "ssd_fwd")
    now = lookup._freshness()
    for p in parse_shapes(BENCH, dtype, op="ssd_fwd"):
        mine = {d: [r for r in recs if r.problem == p and r.device == d] for d in DEVICES}
        for device, own in mine.items():
            assert own and all(r.provenance == "measured" and not r.stale_reasons(*now) for r in own), (p, device)
            for mode in ("eager", "graph"):
                m = lookup.pick(p, recs, "sm90", launch_mode=mode, device=device)
                assert m.kind == "exact" and m.record.device == device, (p, device, mode, m.reason)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_get_kernel_takes_the_gpus_own_records_and_one_cards_where_it_has_none(monkeypatch, dtype):
    """Through the public entry: the device named, or the current GPU's name when none is named;
    a GPU none of the records was measured on (or no GPU) takes the card with the most records
    throughout, never a mix chosen by which card timed faster."""
    from dataclasses import replace

    from autossd import runtime
    from autossd.db.records import make_record
    from autossd.ops.ssd.fwd_knobs import default_config
    autossd.clear_cache()
    monkeypatch.setattr(runtime, "_current_device", lambda: None)   # no GPU to ask, on any host
    recs = lookup.load_records("sm90", "ssd_fwd")
    counts = {d: sum(r.device == d for r in recs) for d in DEVICES}
    most = max(DEVICES, key=lambda d: counts[d])
    # an H800 whose user database holds one record of its own, at another shape
    p0 = parse_shapes(["mamba2-2.7b:b=3,l=1000"], dtype, op="ssd_fwd")[0]
    own = replace(make_record(p0, default_config("sm90", p0), "sm90", provenance="measured", time_ms=1.0,
                              device="NVIDIA H800"), origin="user")
    for p in parse_shapes(BENCH, dtype, op="ssd_fwd"):
        for mode in ("eager", "graph"):
            m = lookup.pick(p, recs + [own], "sm90", launch_mode=mode, device="NVIDIA H800")
            assert m.kind == "exact" and m.record.device == most, (p, mode, m.reason)
        for mode in ("eager", "graph"):
            for device in DEVICES:
                k = autossd.get_kernel(p, "sm90", launch_mode=mode, device=device)
                assert k.match.record.device == device, (p, device, mode, k.reason)
            for other in (None, "NVIDIA H800"):
                k = autossd.get_kernel(p, "sm90", launch_mode=mode, device=other)
                assert k.match.record.device == most, (p, other, mode, k.reason)
    # no device named: the current GPU's name decides (here faked)
    autossd.clear_cache()
    monkeypatch.setattr(runtime, "_current_device", lambda: 0)
    monkeypatch.setattr(runtime, "device_name", lambda dev: "NVIDIA H200")
    p = parse_shapes(BENCH[:1], dtype, op="ssd_fwd")[0]
    assert autossd.get_kernel(p, "sm90", launch_mode="graph").match.record.device == "NVIDIA H200"
    autossd.clear_cache()


def test_the_decode_step_takes_the_gpus_own_records():
    """Layers no decode record was measured at (a headdim no model of the grid has) are served by
    the transfer tier, where both cards' records compete: each card's call takes its own."""
    from autossd.ops.ssd import decode
    recs = lookup.load_records("sm90", "ssd_decode")
    assert {r.device for r in recs} == set(DEVICES)
    assert 48 not in {p.headdim for p in grid(op="ssd_decode")}
    for r in recs:
        q = r.problem.replace(headdim=48)
        for device in DEVICES:
            config, why = decode.choose(q, "sm90", device=device)
            assert why.startswith("transfer") and f"on {device}" in why, (q, device, why)


def test_the_backward_takes_each_gpus_own_measured_records_at_the_training_shapes():
    """Both sm90 cards' backward records ship at the gated call (with z); the H200's also at
    Mamba2's own call without z. Each card's call takes its own exact record, fresh."""
    from autossd.ops.ssd import backward as bw
    recs = lookup.load_records("sm90", "ssd_bwd")
    now = lookup._freshness()
    problems = {r.problem for r in recs}
    gated = {p for p in problems if p.has_z}
    assert len(gated) == 10 and {r.device for r in recs} == set(DEVICES)
    # every ungated record restates a gated one (same sizes and dtype), measured on the H200
    ungated = problems - gated
    assert len(ungated) == 10
    assert all(p.replace(has_z=True) in gated for p in ungated)
    for p in ungated:
        m = lookup.pick(p, recs, "sm90", op="ssd_bwd", device="NVIDIA H200")
        assert m.kind == "exact" and m.record.device == "NVIDIA H200", (p, m.reason)
        assert not m.record.stale_reasons(*now) and m.record.provenance == "measured"
    for p in gated:
        for device in DEVICES:
            own = [r for r in recs if r.problem == p and r.device == device]
            assert own and all(r.provenance == "measured" and not r.stale_reasons(*now) for r in own), (p, device)
            m = lookup.pick(p, recs, "sm90", op="ssd_bwd", device=device)
            assert m.kind == "exact" and m.record.device == device, (p, device, m.reason)
            assert bw.config_for(p, "sm90", device) == m.config
