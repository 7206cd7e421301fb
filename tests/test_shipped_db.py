"""The shipped static databases (tuning_db/sm80, gfx90a, gfx942.sqlite): every shape of the model
grid (autossd/tuner/shapes.py) resolves to an exact, fresh, static record of the shipped file, and
the files open read-only (no write-ahead log left in them)."""
from __future__ import annotations

import sqlite3

import pytest

import autossd
from autossd.db import lookup
from autossd.db.records import read_records
from autossd.tuner.shapes import grid

STATIC_ARCHS = ("sm80", "gfx90a", "gfx942")

pytestmark = pytest.mark.usefixtures("isolated_db")   # conftest: an empty user DB, caches reset


@pytest.mark.parametrize("arch", STATIC_ARCHS)
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
    missing = [p for p in grid() if p not in by_problem]
    assert not missing, f"{len(missing)} grid shapes have no record, e.g. {missing[0]}"
    # fresh: made by the triton and the kernel code running now (a change to a template the
    # records' configs launch makes them stale: the grid is then re-tuned and the file rebuilt)
    now = lookup._freshness()
    stale = [(r.problem, why) for r in recs if (why := r.stale_reasons(*now))]
    assert not stale, f"{len(stale)} stale records, e.g. {stale[0]}"


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_get_kernel_at_every_grid_shape_returns_the_exact_fresh_static_record(arch):
    for p in grid():   # ~10 ms a lookup
        k = autossd.get_kernel(p, arch)
        assert k.source == "exact", (p, k.match.reason)
        rec = k.match.record
        assert rec.provenance == "static" and rec.origin == "shipped" and not k.match.stale, k.match.reason
        assert rec.problem == p
