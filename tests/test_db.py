"""autossd.db: schema derived from the declarations, migrations, concurrent writers, validation
of tampered or corrupt data, export and merge."""
from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import sqlite3
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from autossd import render
from autossd.db import (HEAD, RecordError, TuningDBError, add_records, export_db, load_records,
                        make_record, merge_dbs, migrate, read_records, to_url, validate_row)
from autossd.db import engine as dbengine
from autossd.db import lookup as dblookup
from autossd.db.models import Base, tuned_records
from autossd.db.records import read_rows, row_count
from autossd.problem import Problem
from autossd.ops.ssd.fwd_knobs import KNOB_BY_NAME, KNOBS, Config, default_config, fit

PROB = Problem(1, 2048, 8, 64, 128, 1, "bf16", 256, has_D=True, has_dt_bias=True, dt_softplus=True)
# (pass_stages 1: what every row before schema 12 ran, so the older-schema tests can hold it)
TUNED = default_config("sm90", PROB).replace(scan_block_m=32, bmm_warps=8, pass_stages=1)


def rec(problem=PROB, config=None, arch="sm90", provenance="measured", time_ms=0.5, **kw):
    config = config if config is not None else default_config(arch, problem)
    return make_record(problem, config, arch, provenance=provenance,
                       time_ms=time_ms if provenance == "measured" else None, **kw)


pytestmark = pytest.mark.usefixtures("isolated_db")  # conftest: a fresh user DB per test


# --- schema --------------------------------------------------------------------------------
def test_the_schema_names_no_knob_and_no_problem_field():
    """The problem and the config are JSON validated by the op's own types: a new knob or a new
    op needs no column. dtype alone is repeated, for the lookup index."""
    cols = set(tuned_records.c.keys())
    assert not {c for c in cols if c.startswith("cfg_")}
    assert set(Problem.field_names()) & cols == {"dtype"}
    assert {"problem_json", "config_json", "op", "arch", "device", "launch_mode", "provenance"} <= cols
    row = rec(config=TUNED).to_row()
    assert row["config_json"] == TUNED.key() and json.loads(row["problem_json"]) == PROB.key()
    assert row["problem_json"] == json.dumps(PROB.key(), sort_keys=True) and row["dtype"] == "bf16"


def test_record_roundtrip_keeps_every_field(tmp_path):
    r = rec(device="NVIDIA H100 80GB HBM3", predicted_ms=0.45, notes="tuned run 3")
    db = str(tmp_path / "a.sqlite")
    add_records(db, [r])
    (back,) = read_records(db)
    assert back == r and back.config == r.config and back.problem == PROB
    assert back.tflops == pytest.approx(PROB.flops(256) / 0.5e-3 / 1e12)
    assert back.gbps == pytest.approx(PROB.min_bytes() / 0.5e-3 / 1e9)
    assert 0 < back.pct_of_floor < 100
    assert back.template_hash == render.kernel_hash(r.config, "cuda")


def test_freshness_is_the_hash_of_the_kernels_a_config_launches(monkeypatch):
    import triton
    now = triton.__version__
    r = rec()
    assert r.template_hash == render.kernel_hash(r.config, "cuda") != render.template_hash()
    assert r.stale_reasons(now, render.template_hash()) == []
    # a record from before kernel hashes stored the hash of every template: fresh while it matches
    legacy = replace(r, template_hash=render.template_hash())
    assert legacy.stale_reasons(now, render.template_hash()) == []
    assert any("kernel hash" in w for w in legacy.stale_reasons(now, "0123abcd"))
    # an edit to a kernel the config launches stales it; an edit to one it does not, does not
    five, one = rec(), rec(config=default_config("sm90", PROB, launches=1))
    real = render.render

    def edited(kernel, new):
        def fake(config, backend="cuda"):
            src = real(config, backend)
            return src.replace(f"def {kernel}(", new, 1)
        return fake

    def clear():
        render.kernel_hash.cache_clear()
        render.legacy_kernel_hash.cache_clear()
    clear()
    # a comment or a blank line is not code: the hash is of the tokens the compiler sees
    monkeypatch.setattr(render, "render", edited("ssd_state_passing", "# reworded\n\ndef ssd_state_passing("))
    try:
        assert not five.stale_reasons(now, "x") and not one.stale_reasons(now, "x")
    finally:
        clear()
    monkeypatch.setattr(render, "render", edited("ssd_state_passing", "def ssd_state_passing_v2("))
    try:   # a five-launch kernel's code changed
        assert five.stale_reasons(now, "x") and not one.stale_reasons(now, "x")
    finally:
        clear()


def test_records_from_before_comment_free_hashes_stay_fresh_while_their_text_is_unchanged():
    import triton
    r = rec()
    old = replace(r, template_hash=render.legacy_kernel_hash(r.config, "cuda"))
    assert old.template_hash != r.template_hash
    assert old.stale_reasons(triton.__version__, "x") == []
    assert replace(r, template_hash="0123456789abcdef").stale_reasons(triton.__version__, "x")


def test_head_constant_matches_alembic_scripts():
    from alembic.script import ScriptDirectory
    script = ScriptDirectory.from_config(dbengine.alembic_config())
    assert script.get_current_head() == HEAD
    assert [s.revision for s in script.walk_revisions()][::-1] == list(dbengine.REVISIONS)


def test_migrated_schema_matches_the_model(tmp_path):
    """A knob or Problem field added without a migration fails here."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    url = to_url(tmp_path / "m.sqlite")
    assert migrate(url) == HEAD
    with dbengine.get_engine(url).connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


# --- older schemas -------------------------------------------------------------------------
# what a row of every schema holds beside the problem and the config (the later ones only where
# the schema had them)
RECORD_COLUMNS = ("op", "arch", "device", "time_ms", "provenance", "triton_version", "autossd_version",
                  "template_hash", "created_at", "host", "tflops", "gbps", "pct_of_floor", "predicted_ms",
                  "notes", "launch_mode")


def _columns(url) -> set[str]:
    with dbengine.get_engine(url).connect() as conn:
        return {c["name"] for c in sa.inspect(conn).get_columns("tuned_records")}


def _old_row(r, cols) -> dict:
    """Record r as the writer of an older schema, whose columns are `cols`, stored it: a column per
    problem field and per knob it knew (cfg_<knob>), and config_json holding those knobs only."""
    knobs = sorted(c[4:] for c in cols if c.startswith("cfg_"))
    row = {k: getattr(r, k) for k in RECORD_COLUMNS if k in cols}
    row.update(r.problem.key())
    row.update({f"cfg_{k}": r.config[k] for k in knobs})
    row["config_json"] = json.dumps({k: r.config[k] for k in knobs}, sort_keys=True)
    return row


def _insert_old(url, rows) -> None:
    """Plain SQL, as an older autossd's writer issued it: nothing of today's model in the way."""
    con = sqlite3.connect(str(dbengine.sqlite_path(url)))
    for row in rows:
        names = list(row)
        quoted = ", ".join(f'"{n}"' for n in names)
        con.execute(f"INSERT INTO tuned_records ({quoted}) VALUES ({', '.join('?' * len(names))})",
                    [row[n] for n in names])
    con.commit()
    con.close()


def _at_schema(cfg, cols):
    """What a schema with columns `cols` could hold of cfg: the knobs it had not yet at their
    defaults (every knob's schema gave the older rows its default)."""
    known = {c[4:] for c in cols if c.startswith("cfg_")}
    return cfg.replace(**{k.name: k.default for k in KNOBS if k.name not in known})


@pytest.mark.parametrize("rev", dbengine.REVISIONS[:dbengine.REVISIONS.index("0014") + 1])
def test_every_record_of_an_older_schema_survives_the_upgrade(tmp_path, rev):
    """A database at each schema before the JSON one, written as that schema's writer wrote it
    (its own columns, config_json with the knobs of its time), keeps every record through the
    upgrade: the same problem, the same config as the current Config reads it (knobs it lacked
    at their defaults), times, hash and dates."""
    url = to_url(tmp_path / f"v{rev}.sqlite")
    assert migrate(url, rev) == rev
    cols = _columns(url)
    assert "problem_json" not in cols
    p2 = PROB.replace(seqlen=8192, chunk_size=None, has_z=True)
    p3 = PROB.replace(dtype="fp16", nheads=16, ngroups=2, return_final_states=True)
    recs = [rec(config=_at_schema(TUNED, cols), time_ms=0.42, device="NVIDIA H100 80GB HBM3", notes="run 1"),
            rec(p2, config=_at_schema(TUNED.replace(scan_warps=8), cols), provenance="static",
                predicted_ms=0.7),
            rec(p3, config=_at_schema(default_config("sm90", p3), cols), provenance="default"),
            rec(config=_at_schema(TUNED.replace(bmm_warps=4), cols), time_ms=0.5, arch="sm80")]
    _insert_old(url, [_old_row(r, cols) for r in recs])
    assert migrate(url) == HEAD
    back = read_records(url)
    assert len(back) == len(recs)
    for r, b in zip(recs, back):
        if "notes" not in cols:   # schema 1 had no figures, prediction or notes
            r = replace(r, tflops=None, gbps=None, pct_of_floor=None, predicted_ms=None, notes="")
        assert b == r and b.problem == r.problem and b.config == r.config
        assert (b.time_ms, b.template_hash, b.created_at) == (r.time_ms, r.template_hash, r.created_at)
    with dbengine.get_engine(url).connect() as conn:
        texts = conn.execute(sa.text("SELECT problem_json, config_json FROM tuned_records ORDER BY id")).all()
    # the config text is kept as the older writer (and the knob schemas after it) left it
    assert [c for _, c in texts] == [r.config.key() for r in recs]
    assert [json.loads(p) for p, _ in texts] == [r.problem.key() for r in recs]


def test_schema_v1_database_opens_after_migration(tmp_path, caplog):
    path = tmp_path / "user.sqlite"
    url = to_url(path)
    assert migrate(url, "0001") == "0001"
    v1_cols = _columns(url)
    assert "notes" not in v1_cols and "tflops" not in v1_cols
    v1_config = _at_schema(TUNED, v1_cols)
    _insert_old(url, [_old_row(rec(config=v1_config), v1_cols)])   # only schema 1's columns
    with caplog.at_level(logging.INFO, logger="autossd.db"):
        (r,) = [r for r in load_records("sm90", "ssd_fwd") if r.origin == "user"]  # migrated on open
    assert r.config == v1_config and r.notes == "" and r.tflops is None
    with dbengine.get_engine(url).connect() as conn:
        assert dbengine.current_revision(conn) == HEAD
    assert dblookup.choose(PROB, "sm90").kind == "exact"


def test_a_knob_added_to_a_space_reads_older_records_without_a_migration(tmp_path, monkeypatch):
    """A knob declared after records were stored is no column: their config JSON lacks it, and
    reading gives it its default. Records of its other values are stored beside them in the same
    schema; a reader that does not know the knob refuses those (an unknown knob is no config)."""
    from autossd.knobs import Knob, KnobSpace
    path = tmp_path / "a.sqlite"
    add_records(str(path), [rec(config=TUNED)])
    space = Config.space
    wider = KnobSpace(space.op, space.knobs + (Knob("extra_knob", (0, 2), 0, "a knob added later"),),
                      space.mode_knob)
    monkeypatch.setattr(Config, "space", wider)
    (r,) = read_records(str(path))
    assert r.config.as_dict() == {**TUNED.as_dict(), "extra_knob": 0}
    add_records(str(path), [replace(r, config=r.config.replace(extra_knob=2), time_ms=0.4)])
    assert sorted(x.config["extra_knob"] for x in read_records(str(path))) == [0, 2]
    with dbengine.get_engine(to_url(path)).connect() as conn:
        assert dbengine.current_revision(conn) == HEAD
    monkeypatch.undo()
    with pytest.raises(RecordError, match="unknown knob"):
        read_records(str(path))
    assert [x.config for x in read_records(str(path), strict=False)] == [TUNED]


def test_one_damaged_row_never_costs_an_older_database_its_other_records(tmp_path):
    # the migrations rewrite every row's config_json (and the JSON schema every row's problem):
    # a row that is not JSON (or not an object) once failed the whole migration, and the lookup
    # then ignored the whole user database
    url = to_url(tmp_path / "v2.sqlite")
    assert migrate(url, "0002") == "0002"
    v2_cols = _columns(url)
    # a config schema 2 could hold: the later knobs at the values their migrations give old rows
    old = _at_schema(TUNED, v2_cols)
    good = _old_row(rec(config=old), v2_cols)
    v2_cfg = json.loads(good["config_json"])
    bad = [{**good, "config_json": "{not json"}, {**good, "config_json": "[1, 2]"},
           {**good, "seqlen": 4096, "config_json": json.dumps({**v2_cfg, "fold_prep": "x"})},
           {**good, "seqlen": 8192, "config_json": json.dumps({**v2_cfg, "fold_prep": float("inf")})},
           {**good, "seqlen": 16384, "config_json": json.dumps({**v2_cfg, "scan_maxnreg": float("inf")})},
           {**good, "seqlen": 32768, "batch": "one"}, {**good, "seqlen": 65536, "has_z": 7},
           {**good, "seqlen": 1024, "time_ms": "fast"}]
    _insert_old(url, [good] + bad)
    assert migrate(url) == HEAD
    recs = read_records(url, strict=False)
    assert [r.config for r in recs] == [old]        # the good row, migrated; the others skipped
    assert len(read_rows(url)) == 1 + len(bad)      # ... but kept, for the reader to refuse


def _downgrade(url, rev):
    from alembic import command
    cfg = dbengine.alembic_config()
    with dbengine.get_engine(url).begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, rev)


def test_schema_6_labels_older_rows_by_how_they_were_timed(tmp_path):
    """Before launch modes the tuner timed eager calls: measured rows become "eager", static and
    default rows (predictions of GPU time) "any"; a downgrade drops the graph rows, whose time
    would otherwise read as an eager one."""
    url = to_url(tmp_path / "v5.sqlite")
    assert migrate(url, "0005") == "0005"
    v5_cols = _columns(url)
    assert "launch_mode" not in v5_cols
    _insert_old(url, [_old_row(r, v5_cols)
                      for r in (rec(config=TUNED), rec(provenance="static", config=TUNED),
                                rec(PROB.replace(seqlen=8192), provenance="default", config=TUNED))])
    assert migrate(url) == HEAD
    assert sorted((r.provenance, r.launch_mode) for r in read_records(url)) == [
        ("default", "any"), ("measured", "eager"), ("static", "any")]
    add_records(url, [rec(config=TUNED, launch_mode="graph", time_ms=0.3)])
    _downgrade(url, "0005")
    with dbengine.get_engine(url).connect() as conn:
        assert dbengine.current_revision(conn) == "0005"
        assert conn.execute(sa.text("SELECT count(*) FROM tuned_records")).scalar_one() == 3
        assert "launch_mode" not in {c["name"] for c in sa.inspect(conn).get_columns("tuned_records")}


def test_the_json_schema_downgrades_to_columns_where_it_can(tmp_path):
    """Back to schema 14: a row's problem and knobs return to their columns; a row with a knob
    schema 14 had no column for cannot be said there and is dropped."""
    url = to_url(tmp_path / "d.sqlite")
    add_records(url, [rec(config=TUNED), rec(PROB.replace(seqlen=8192), config=TUNED, time_ms=0.3)])
    with dbengine.get_engine(url).begin() as conn:
        conn.execute(sa.text("UPDATE tuned_records SET config_json = :j WHERE id = 2"),
                     {"j": json.dumps({**json.loads(TUNED.key()), "later_knob": 1}, sort_keys=True)})
    _downgrade(url, "0014")
    with dbengine.get_engine(url).connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM tuned_records"))]
    assert len(rows) == 1 and rows[0]["seqlen"] == PROB.seqlen and rows[0]["cfg_bmm_warps"] == TUNED.bmm_warps
    assert rows[0]["config_json"] == TUNED.key() and rows[0]["has_D"] == 1
    assert migrate(url) == HEAD
    assert [r.config for r in read_records(url)] == [TUNED]


# Knobs each added by a schema whose older rows all ran the knob's default: (revision that adds
# it, knob, a config with another value, what that value stands for). Later knobs come later.
KNOB_SCHEMAS = [
    ("0007", "fold_prep", TUNED.replace(fold_prep=1), "the five separate launches"),
    ("0008", "scan_gluon", TUNED.replace(scan_gluon=1, scan_block_m=64), "the tl chunk scan"),
    ("0009", "state_walk", TUNED.replace(launches=5, state_walk=1), "the two state stages"),
    ("0010", "pdl", TUNED.replace(launches=5, pdl=1), "launches one after another"),
    ("0011", "walk_weights", TUNED.replace(launches=5, state_walk=1, walk_weights=1), "the walk computing its weights"),
    ("0012", "pass_stages", TUNED.replace(launches=5, pass_stages=3), "the one-chunk prefetch in registers"),
    ("0013", "walk_split", TUNED.replace(launches=5, state_walk=1, scan_gluon=3, scan_block_m=64, walk_split=2),
     "the whole sequence in one walk"),
    ("0014", "walk_block", TUNED.replace(launches=5, state_walk=1, walk_block=64), "the 128-token ring"),
]


@pytest.mark.parametrize("rev,knob,other,meaning", KNOB_SCHEMAS, ids=[k[1] for k in KNOB_SCHEMAS])
def test_a_knob_schema_gives_older_rows_the_knob_default(tmp_path, rev, knob, other, meaning):
    """Before the knob every record ran its default (`meaning`): an older row gains the default
    in its canonical config_json and in its cfg_ column (the JSON schema then keeps that text); a
    downgrade drops the rows of any other value, whose time would otherwise read as the
    default's, and the key."""
    before = f"{int(rev) - 1:04d}"
    url = to_url(tmp_path / f"v{before}.sqlite")
    assert migrate(url, before) == before
    old_cols = _columns(url)
    assert f"cfg_{knob}" not in old_cols
    row = _old_row(rec(config=TUNED), old_cols)   # as the older schema wrote it: no such knob
    old_cfg = json.loads(row["config_json"])
    assert knob not in old_cfg
    _insert_old(url, [row])
    assert migrate(url, rev) == rev
    default = KNOB_BY_NAME[knob].default
    with dbengine.get_engine(url).connect() as conn:
        (text, col), = conn.execute(sa.text(f"SELECT config_json, cfg_{knob} FROM tuned_records")).fetchall()
    assert json.loads(text)[knob] == default and col == default
    assert migrate(url) == HEAD
    with dbengine.get_engine(url).connect() as conn:
        (text,) = conn.execute(sa.text("SELECT config_json FROM tuned_records")).scalars().all()
    assert text == TUNED.key()   # canonical, as Config.key() writes it
    (r,) = read_records(url)
    assert r.config == TUNED and r.config[knob] == default
    assert other[knob] != default
    add_records(url, [rec(config=other, time_ms=0.3)])
    assert {r.config[knob] for r in read_records(url)} == {default, other[knob]}
    _downgrade(url, before)
    with dbengine.get_engine(url).connect() as conn:
        assert dbengine.current_revision(conn) == before
        assert f"cfg_{knob}" not in {c["name"] for c in sa.inspect(conn).get_columns("tuned_records")}
        (text,) = conn.execute(sa.text("SELECT config_json FROM tuned_records")).scalars().all()
    assert json.loads(text) == old_cfg   # the other value's row is gone, the older one lost only the key


def test_lookup_does_not_create_the_user_database(tmp_path, no_shipped_db):
    assert dblookup.choose(PROB, "sm90").kind == "default"
    assert not (tmp_path / "user.sqlite").exists()


# --- concurrent writers --------------------------------------------------------------------
def _writer(url: str, worker: int, n: int, q) -> None:
    try:
        dbengine.dispose_engines()  # never share a parent's connection across fork
        base = rec(provenance="static")
        # distinct records (the device is part of a record's key), each noted with its writer
        recs = [replace(base, device=f"gpu {worker}-{i}", notes=f"w{worker}-{i}") for i in range(n)]
        add_records(url, recs, batch_size=50)
        q.put((worker, "ok"))
    except BaseException as e:  # report, the parent asserts
        q.put((worker, f"{type(e).__name__}: {e}"))


def test_four_processes_write_4000_records_none_lost(tmp_path):
    url = to_url(tmp_path / "shared.sqlite")   # fresh: the 4 workers also race to create it
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, w, 1000, q)) for w in range(4)]
    for p in procs:
        p.start()
    # generous waits (a loaded machine is slow, not wrong); no wall-clock bound: a lost or
    # refused write shows in the results and the count below, on any machine
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {w: "ok" for w in range(4)}, results
    assert row_count(url) == 4000
    notes = {r.notes for r in read_records(url)}
    assert notes == {f"w{w}-{i}" for w in range(4) for i in range(1000)}


def _same_writer(url: str, worker: int, recs, q) -> None:
    try:
        dbengine.dispose_engines()  # never share a parent's connection across fork
        for r in recs:   # one record per transaction: the writers interleave
            add_records(url, [r])
        q.put((worker, "ok"))
    except BaseException as e:  # report, the parent asserts
        q.put((worker, f"{type(e).__name__}: {e}"))


def _dup_records(n=12):
    base = rec(provenance="static", predicted_ms=0.5)
    return [replace(base, problem=PROB.replace(seqlen=64 * (i + 1))) for i in range(n)]


def test_the_same_record_added_again_is_stored_once_with_the_better_figure(tmp_path):
    url = to_url(tmp_path / "d.sqlite")
    r = rec(time_ms=0.5)
    assert add_records(url, [r, r]) == 2 and row_count(url) == 1     # a batch holding it twice
    add_records(url, [r])                                             # a finished tune run again
    add_records(url, [replace(r, time_ms=0.7, notes="slower")])      # same code, slower: kept out
    assert [(x.time_ms, x.notes) for x in read_records(url)] == [(0.5, "")]
    add_records(url, [replace(r, time_ms=0.4, notes="faster")])      # same code, faster: replaces
    assert [(x.time_ms, x.notes) for x in read_records(url)] == [(0.4, "faster")]
    # made by other code (a re-tune after the kernels changed): the newer replaces, even if slower
    add_records(url, [replace(r, time_ms=0.6, triton_version="9.9.9", created_at="2099-01-01T00:00:00+00:00")])
    assert [(x.time_ms, x.triton_version) for x in read_records(url)] == [(0.6, "9.9.9")]
    add_records(url, [replace(r, time_ms=0.1, created_at="2000-01-01T00:00:00+00:00")])   # older code, older
    assert [x.time_ms for x in read_records(url)] == [0.6]
    # another launch mode, provenance, device, problem or config is another record
    add_records(url, [replace(r, launch_mode="graph"), replace(r, provenance="static", time_ms=None,
                      predicted_ms=0.3, launch_mode="any"), replace(r, device="H100 PCIe"),
                      rec(PROB.replace(seqlen=4096)), rec(config=TUNED)])
    assert row_count(url) == 6
    with dbengine.get_engine(url).begin() as conn, pytest.raises(sa.exc.IntegrityError):
        conn.execute(tuned_records.insert(), [r.to_row()])   # the index itself refuses a copy


def test_two_threads_writing_the_same_records_leave_one_copy_each(tmp_path):
    import threading
    url = to_url(tmp_path / "t.sqlite")
    recs = _dup_records()
    errors = []

    def write():
        try:
            for r in recs:
                add_records(url, [r])
        except BaseException as e:  # noqa: BLE001 - the test asserts
            errors.append(e)
    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert row_count(url) == len(recs)
    assert sorted(r.problem.seqlen for r in read_records(url)) == sorted(r.problem.seqlen for r in recs)


def test_two_processes_writing_the_same_records_leave_one_copy_each(tmp_path):
    url = to_url(tmp_path / "p.sqlite")   # fresh: both also race to create it
    recs = _dup_records()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_same_writer, args=(url, w, recs, q)) for w in range(2)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: "ok", 1: "ok"}, results
    assert row_count(url) == len(recs)


def test_the_unique_schema_reduces_copies_an_older_writer_stored(tmp_path):
    url = to_url(tmp_path / "v15.sqlite")
    assert migrate(url, "0015") == "0015"
    r = rec(time_ms=0.5)
    copies = [r, replace(r, time_ms=0.3, notes="best"), replace(r, time_ms=0.4), rec(PROB.replace(seqlen=4096))]
    with dbengine.get_engine(url).begin() as conn:   # schema 15 had no unique index
        conn.execute(sa.text(f"INSERT INTO tuned_records ({', '.join(copies[0].to_row())}) VALUES "
                             f"({', '.join(':' + c for c in copies[0].to_row())})"), [c.to_row() for c in copies])
    assert row_count(url) == 4
    assert migrate(url) == HEAD
    assert sorted((x.problem.seqlen, x.time_ms, x.notes) for x in read_records(url)) == [
        (2048, 0.3, "best"), (4096, 0.5, "")]


def _journal_mode(path) -> str:
    """From the file's header, not through a connection (opening a WAL file, even read-only,
    creates its -wal and -shm files)."""
    return "wal" if dbengine.is_wal_file(Path(path)) else "delete"


def _beside(path) -> list[str]:
    return sorted(p.name for p in Path(path).parent.iterdir() if p.name.startswith(Path(path).name + "-"))


def test_sqlite_engine_uses_wal_while_writing_and_busy_timeout(tmp_path):
    url = to_url(tmp_path / "w.sqlite")
    migrate(url)
    eng = dbengine.get_engine(url)
    with dbengine.write_transaction(eng) as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == dbengine.BUSY_TIMEOUT_MS
    dbengine.dispose_engines(url)
    assert _journal_mode(tmp_path / "w.sqlite") == "delete"


def test_a_finished_write_leaves_the_file_in_rollback_journal_mode(tmp_path):
    """A tune (add_records), a migration, an export and a merge each leave a single file in
    rollback-journal mode: a file left in WAL mode cannot be read where SQLite may not create
    its -wal and -shm files (a read-only mount or copy of a tuned database)."""
    path = tmp_path / "t.sqlite"
    add_records(to_url(path), [rec()])
    assert _journal_mode(path) == "delete" and _beside(path) == []
    old = tmp_path / "old.sqlite"
    migrate(to_url(old), "0014")
    assert migrate(to_url(old)) == HEAD and _journal_mode(old) == "delete" and _beside(old) == []
    export_db(path, tmp_path / "e.sqlite")
    merge_dbs([path, tmp_path / "e.sqlite"], tmp_path / "m.sqlite")
    for p in ("e.sqlite", "m.sqlite"):
        assert _journal_mode(tmp_path / p) == "delete" and _beside(tmp_path / p) == []
    # a writer still at work elsewhere keeps WAL on; the last one done switches it back
    other = sqlite3.connect(str(path), isolation_level=None)
    other.execute("PRAGMA journal_mode=WAL")
    other.execute("SELECT count(*) FROM tuned_records").fetchone()
    add_records(to_url(path), [rec(PROB.replace(seqlen=4096))])
    assert _journal_mode(path) == "wal"
    other.close()
    add_records(to_url(path), [rec(PROB.replace(seqlen=8192))])
    assert _journal_mode(path) == "delete" and row_count(to_url(path)) == 3


def test_reads_open_the_file_read_only_and_create_nothing_beside_it(tmp_path, monkeypatch):
    """Reading needs no write access: every read of an SQLite file (records, lookup, show, the
    schema check) opens it `mode=ro` (the shipped one `immutable=1`) and creates no -wal, -shm
    or -journal file, and a connection that tried to write would be refused."""
    from autossd.tuner.sinks import DbSink
    path = tmp_path / "user.sqlite"
    add_records(to_url(path), [rec()])
    dbengine.dispose_engines()
    uris = []
    real = dbengine.reader_uri
    monkeypatch.setattr(dbengine, "reader_uri", lambda p, immutable=False: uris.append(real(p, immutable)) or uris[-1])
    dblookup.clear_cache()
    assert dblookup.choose(PROB, "sm90").record.origin == "user"
    assert len(read_records(str(path))) == 1 and row_count(to_url(path)) == 1
    assert len(DbSink(str(path)).load()) == 1
    mine = [u for u in uris if str(path) in u]
    assert mine and all(u.endswith("?mode=ro") for u in mine), uris
    shipped = [u for u in uris if "tuning_db" in u]
    assert shipped and all(u.endswith("?immutable=1") for u in shipped), uris
    assert _beside(path) == [] and _journal_mode(path) == "delete"
    with dbengine.get_engine(to_url(path), readonly=True).connect() as conn:
        with pytest.raises(sa.exc.OperationalError, match="readonly"):
            conn.exec_driver_sql("DELETE FROM tuned_records")
    assert row_count(to_url(path)) == 1


def _wal_db(path, keep_wal: bool):
    """A database in WAL mode, as a writer that did not finish leaves it: with its -wal file
    beside it (keep_wal; no -shm, as after a copy), or with the WAL folded in and removed."""
    add_records(to_url(path), [rec()])
    dbengine.dispose_engines()
    con = sqlite3.connect(str(path), isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    if keep_wal:
        con.execute("PRAGMA wal_autocheckpoint=0")
        con.execute("UPDATE tuned_records SET notes = 'in the wal'")
        import shutil
        shutil.copy(f"{path}-wal", f"{path}-wal.keep")
    con.close()
    if keep_wal:
        Path(f"{path}-wal.keep").rename(f"{path}-wal")
        Path(f"{path}-shm").unlink(missing_ok=True)
    assert _journal_mode(path) == "wal" if not keep_wal else True


def test_a_wal_file_in_a_folder_that_cannot_be_written_still_reads(tmp_path, monkeypatch, no_shipped_db):
    """Left in WAL mode with no -wal file beside it, the file alone is the whole database, and no
    writer can start in a folder no one can write: it reads (as immutable), with nothing created."""
    path = tmp_path / "user.sqlite"
    _wal_db(path, keep_wal=False)
    assert dbengine.is_wal_file(path) and _beside(path) == []
    monkeypatch.setattr(dbengine, "_dir_writable", lambda folder: folder != tmp_path)
    assert [r.config for r in read_records(str(path))] == [default_config("sm90", PROB)]
    m = dblookup.choose(PROB, "sm90")
    assert m.kind == "exact" and m.record.origin == "user"
    assert _beside(path) == []


def test_a_wal_file_with_its_log_in_a_read_only_folder_is_an_error_saying_what_to_do(
        tmp_path, monkeypatch, no_shipped_db):
    """With a -wal file beside it SQLite must create -shm to read it: not possible there. The
    error names the file and what to do; the lookup does not fall back to defaults in silence."""
    path = tmp_path / "user.sqlite"
    _wal_db(path, keep_wal=True)
    monkeypatch.setattr(dbengine, "_dir_writable", lambda folder: folder != tmp_path)
    for read in (lambda: read_records(str(path)), lambda: dblookup.choose(PROB, "sm90")):
        with pytest.raises(dbengine.ReadOnlyWALError) as e:
            read()
        msg = str(e.value)
        assert str(path) in msg and "autossd export" in msg and "writable" in msg, msg
    monkeypatch.undo()   # where it is writable, it reads, with what the -wal file held
    assert [r.notes for r in read_records(str(path))] == ["in the wal"]


def test_an_older_schema_in_a_read_only_folder_is_read_through_a_temporary_copy(
        tmp_path, monkeypatch, no_shipped_db):
    path = tmp_path / "user.sqlite"
    url = to_url(path)
    assert migrate(url, "0014") == "0014"
    cols = _columns(url)
    _insert_old(url, [_old_row(rec(config=TUNED), cols)])
    dbengine.finalize_sqlite(path)
    monkeypatch.setattr(dbengine, "_dir_writable", lambda folder: folder != tmp_path)
    m = dblookup.choose(PROB, "sm90")
    assert m.kind == "exact" and m.config == TUNED and m.record.origin == "user"
    with pytest.raises(TuningDBError, match="autossd export"):
        dbengine.upgrade_if_older(url)    # `show` and the tuner, which would upgrade it, say what to do
    with dbengine.get_engine(url, readonly=True).connect() as conn:
        assert dbengine.current_revision(conn) == "0014"   # left as it was
    assert _beside(path) == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes read-only folders")
def test_a_tuned_database_reads_from_a_really_read_only_folder(tmp_path, no_shipped_db):
    folder = tmp_path / "ro"
    folder.mkdir()
    path = folder / "user.sqlite"
    add_records(to_url(path), [rec()])
    dbengine.dispose_engines()
    os.chmod(path, 0o444)
    os.chmod(folder, 0o555)
    try:
        assert len(read_records(str(path))) == 1
        assert dblookup.choose(PROB, "sm90", db=path).record.origin == "user"
        assert _beside(path) == []
    finally:
        os.chmod(folder, 0o755)
        os.chmod(path, 0o644)


def test_reading_leaves_a_rollback_journal_database_as_it_is(tmp_path):
    """Only a write switches a file to WAL: `autossd show --db`, a lookup or a read of a
    database kept in rollback-journal mode (as shipped ones are) must not change it."""
    from autossd.tuner.sinks import DbSink
    path = tmp_path / "ro.sqlite"
    add_records(to_url(path), [rec()])
    dbengine.finalize_sqlite(path)          # journal_mode=DELETE, as a shipped file is
    dbengine.dispose_engines()

    def mode():
        con = sqlite3.connect(str(path))
        try:
            return con.execute("PRAGMA journal_mode").fetchone()[0]
        finally:
            con.close()
    assert mode() == "delete"
    assert len(DbSink(str(path)).load()) == 1 and len(read_records(str(path))) == 1
    dbengine.dispose_engines()
    assert mode() == "delete" and not Path(f"{path}-wal").exists()
    add_records(to_url(path), [rec(time_ms=0.2)])   # a write switches it while it writes, and back
    assert mode() == "delete" and not Path(f"{path}-wal").exists()


def test_the_first_write_waits_out_a_reader_before_switching_to_wal(tmp_path, monkeypatch):
    """Switching a file to WAL needs it to itself for a moment: a reader holding a rollback-mode
    file (another process's open read) makes the switch report a lock, which is retried like
    any other lock error, not raised at the caller."""
    path = tmp_path / "busy.sqlite"
    add_records(to_url(path), [rec()])
    dbengine.finalize_sqlite(path)
    dbengine.dispose_engines()
    monkeypatch.setattr(dbengine, "BUSY_TIMEOUT_MS", 20)   # give up waiting at once: retry instead
    reader = sqlite3.connect(str(path), isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM tuned_records").fetchone()   # holds a shared lock
    # the reader lets go during the writer's first back-off, whatever the machine's speed (a
    # timer thread would race the retries' total wait)
    waits = []
    real_sleep = time.sleep

    def sleep(s):
        if not waits:
            reader.execute("COMMIT")
        waits.append(s)
        real_sleep(s)
    monkeypatch.setattr(dbengine.time, "sleep", sleep)
    try:
        add_records(to_url(path), [rec(PROB.replace(seqlen=4096), time_ms=0.2)])
    finally:
        monkeypatch.setattr(dbengine.time, "sleep", real_sleep)
        reader.close()
    dbengine.dispose_engines()
    assert waits, "the reader's lock never made the writer wait: the check was empty"
    assert len(read_records(str(path))) == 2
    assert _journal_mode(path) == "delete"   # and back when the writer was done


def test_readers_are_not_blocked_by_an_open_write_transaction(tmp_path, monkeypatch):
    url = to_url(tmp_path / "r.sqlite")
    # a read that the lock blocked would fail with a lock error (the writer is this thread, so
    # waiting cannot help), not pass slowly: no clock needed, and no retry waits either
    monkeypatch.setattr(dbengine, "BUSY_TIMEOUT_MS", 20)
    monkeypatch.setattr(dbengine.time, "sleep", lambda s: None)
    add_records(url, [rec()])
    eng = dbengine.get_engine(url)
    with dbengine.write_transaction(eng) as w:   # holds SQLite's write lock
        w.execute(tuned_records.insert(), [rec(PROB.replace(seqlen=4096), time_ms=0.1).to_row()])
        assert len(read_records(url)) == 1       # the committed state, at once
    assert len(read_records(url)) == 2


def test_with_retries_retries_only_lock_errors():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
        return "done"
    assert dbengine.with_retries(flaky) == "done" and len(calls) == 3

    def broken():
        raise sa.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("no such table: x"))
    with pytest.raises(sa.exc.OperationalError, match="no such table"):
        dbengine.with_retries(broken)


# --- tampering and corruption --------------------------------------------------------------
_PROBLEM_TEXT = json.dumps(PROB.replace(chunk_size=64).key(), sort_keys=True)
# (column, or "column:key" for one key of a JSON column rewritten in canonical form; value; what
# the error names)
TAMPER = [
    ("config_json:bmm_block_m", 48, "config"),                  # not in the knob's set
    ("config_json:scan_block_m", 128, "config"),                # in the set, exceeds chunk 64
    ("config_json:state_dtype", "fp32'); import os; os.system('x", "config"),
    ("config_json:bmm_warps", "four", "config"),                # wrong types: text, float, bool
    ("config_json:bmm_warps", 4.0, "config"),
    ("config_json:decay_split", 0, "config"),
    ("config_json:no_such_knob", 1, "unknown knob"),
    ("config_json:launches", None, "config"),
    ("problem_json:batch", "one", "batch"),
    ("problem_json:batch", 2.5, "batch"),
    ("problem_json:batch", True, "batch"),
    ("problem_json:has_D", 7, "has_D"),
    ("problem_json:has_D", 1, "has_D"),
    ("problem_json:dtype", "__import__('os')", "problem"),
    ("problem_json:evil", "x", "unknown field"),
    ("problem_json", '{"batch": 1}', "problem"),                # required fields missing
    ("problem_json", _PROBLEM_TEXT.replace('"batch": 1', '"batch": NaN'), "problem_json"),
    ("problem_json", _PROBLEM_TEXT.replace(": ", ":"), "canonical"),   # parses, but edited
    ("problem_json", 42, "problem_json"),
    ("dtype", "fp32", "dtype"),                                 # not the problem's dtype
    ("config_json", '{"chunk_size":64}', "canonical"),          # a valid config, but the text was edited
    ("config_json", '{"chunk_size": 64, "chunk_size": 64}', "twice"),
    ("config_json", '{"chunk_size": Infinity}', "config_json"),
    ("config_json", "[64]", "JSON object"),
    ("config_json", "{not json", "config_json"),
    ("config_json", "{}" + " " * 9000, "config_json"),
    ("op", "ssd_nope", "op"),
    ("device", "H100\"); __import__('os').system('rm -rf ~'); (\"", "device"),
    ("host", "h$(reboot)", "host"),
    ("notes", "{{ cycler.__init__.__globals__.os.popen('id') }}", "notes"),
    ("triton_version", "3.6.0\nimport os", "triton_version"),
    ("template_hash", "ZZZ", "template_hash"),
    ("provenance", "trusted", "provenance"),
    ("arch", "sm99", "arch"),
    ("time_ms", -1.0, "time_ms"),
    ("time_ms", float("nan"), "time_ms"),
    ("time_ms", "fast", "time_ms"),
    ("created_at", "yesterday", "created_at"),
    ("launch_mode", "fastest", "launch_mode"),
]


def _tamper(path: Path, column: str, value) -> None:
    con = sqlite3.connect(str(path))
    column, _, key = column.partition(":")
    if key:   # one key of a JSON column, the text rewritten as the writer would have
        for rid, text in con.execute(f'SELECT id, "{column}" FROM tuned_records').fetchall():
            con.execute(f'UPDATE tuned_records SET "{column}" = ? WHERE id = ?',
                        (json.dumps({**json.loads(text), key: value}, sort_keys=True), rid))
    else:
        con.execute(f'UPDATE tuned_records SET "{column}" = ?', (value,))
    con.commit()
    con.close()


@pytest.mark.parametrize("column,value,field", TAMPER, ids=[f"{c}={str(v)[:12]}" for c, v, _ in TAMPER])
def test_tampered_record_is_rejected_and_lookup_falls_back(tmp_path, monkeypatch, caplog, column, value, field,
                                                         no_shipped_db):
    prob = PROB.replace(chunk_size=64)
    tuned = default_config("sm90", prob).replace(scan_block_m=32, bmm_warps=8)
    path = tmp_path / "user.sqlite"
    add_records(str(path), [rec(prob, tuned)])
    dbengine.dispose_engines()
    _tamper(path, column, value)
    with pytest.raises(RecordError, match=field):
        read_records(str(path))
    # the loader: warning, record skipped, default chosen, nothing rendered on the way
    monkeypatch.setattr(render, "render", lambda *a, **k: pytest.fail("rendered during lookup"))
    with caplog.at_level(logging.WARNING, logger="autossd.db"):
        m = dblookup.choose(prob, "sm90")
    assert m.kind == "default" and m.config == default_config("sm90", prob)
    if column not in ("arch", "op"):  # a row moved to another arch or op is not even read for sm90's forward
        assert any(field in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)


def test_validate_row_accepts_what_make_record_writes():
    r = rec(config=TUNED)
    assert validate_row({**r.to_row(), "id": 5}).config == TUNED


def test_corrupt_file_is_rejected_clearly_and_lookup_goes_on(tmp_path, caplog, no_shipped_db):
    path = tmp_path / "user.sqlite"
    path.write_bytes(b"this is not an sqlite database, just some bytes" * 100)
    with pytest.raises(TuningDBError, match="cannot be read|not an autossd"):
        read_records(str(path))
    with caplog.at_level(logging.WARNING, logger="autossd.db"):
        m = dblookup.choose(PROB, "sm90")
    assert m.kind == "default"  # the lookup still answers
    assert any("ignoring the user tuning database" in r.getMessage() for r in caplog.records)


def test_foreign_sqlite_file_is_rejected(tmp_path, caplog):
    path = tmp_path / "user.sqlite"
    con = sqlite3.connect(str(path))
    con.execute("CREATE TABLE tuned_records (x TEXT)")
    con.close()
    with pytest.raises(TuningDBError, match="not an autossd tuning database"):
        read_records(str(path))
    with caplog.at_level(logging.WARNING, logger="autossd.db"):
        dblookup.choose(PROB, "sm90")
    assert any("ignoring the user" in r.getMessage() for r in caplog.records)


def test_make_record_refuses_invalid_input():
    with pytest.raises(RecordError, match="device"):
        rec(device="x'); drop table tuned_records; --")
    with pytest.raises(RecordError, match="time_ms"):
        make_record(PROB, TUNED, "sm90", provenance="measured", time_ms=None)
    with pytest.raises(RecordError, match="config"):
        make_record(PROB.replace(chunk_size=64), Config(chunk_size=64, scan_block_m=128), "sm90",
                    provenance="static")


# --- export and merge ----------------------------------------------------------------------
def test_export_filters_by_arch_and_writes_a_self_contained_file(tmp_path):
    src = str(tmp_path / "src.sqlite")
    add_records(src, [rec(), rec(arch="sm80"), rec(PROB.replace(seqlen=4096))])
    out = tmp_path / "out" / "sm90.sqlite"
    assert export_db(src, out, arch="sm90") == 2
    assert {r.arch for r in read_records(str(out), readonly=True)} == {"sm90"}
    assert not Path(f"{out}-wal").exists()
    con = sqlite3.connect(str(out))
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    con.close()
    with pytest.raises(FileExistsError):
        export_db(src, out)


def test_merge_keeps_the_best_measurement_of_each_launch_mode(tmp_path):
    a, b = str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite")
    eager, graph = TUNED, TUNED.replace(launches=5, scan_warps=8)
    add_records(a, [rec(config=eager, time_ms=0.10), rec(config=graph, time_ms=0.12),
                    rec(config=graph, time_ms=0.08, launch_mode="graph"), rec(provenance="static")])
    add_records(b, [rec(config=eager, time_ms=0.09, launch_mode="graph")])
    out = tmp_path / "merged.sqlite"
    res = merge_dbs([a, b], out)
    got = {r.launch_mode: r for r in read_records(str(out))}
    assert (res.kept, res.dropped, res.conflicts) == (2, 3, 1)
    assert got["eager"].config == eager and got["eager"].time_ms == 0.10
    assert got["graph"].config == graph and got["graph"].time_ms == 0.08


def test_merge_keeps_each_devices_best_measurement_and_the_lookup_prefers_the_callers(tmp_path):
    """An arch's shipped file holds an H100's and an H200's records of one problem side by side:
    the faster GPU's time must not evict the other's record."""
    h100, h200 = str(tmp_path / "h100.sqlite"), str(tmp_path / "h200.sqlite")
    cfg_a, cfg_b = TUNED, TUNED.replace(scan_warps=8)
    add_records(h100, [rec(config=cfg_a, time_ms=0.50, device="NVIDIA H100 80GB HBM3"),
                       rec(config=cfg_b, time_ms=0.60, device="NVIDIA H100 80GB HBM3")])
    add_records(h200, [rec(config=cfg_b, time_ms=0.35, device="NVIDIA H200")])
    out = tmp_path / "sm90.sqlite"
    res = merge_dbs([h100, h200], out)
    got = {r.device: r for r in read_records(str(out))}
    assert (res.kept, res.dropped) == (2, 1)
    assert got["NVIDIA H100 80GB HBM3"].config == cfg_a and got["NVIDIA H100 80GB HBM3"].time_ms == 0.50
    assert got["NVIDIA H200"].config == cfg_b
    recs = read_records(str(out))
    assert dblookup.pick(PROB, recs, "sm90", device="NVIDIA H100 80GB HBM3").config == cfg_a
    assert dblookup.pick(PROB, recs, "sm90", device="NVIDIA H200").config == cfg_b


def test_merge_keeps_one_record_per_key_by_the_conflict_rule(tmp_path):
    a, b = str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite")
    p2 = PROB.replace(seqlen=8192)
    cfg_fast = TUNED
    cfg_slow = TUNED.replace(scan_warps=8)
    cfg_static = TUNED.replace(state_warps=8)
    add_records(a, [rec(config=cfg_slow, time_ms=0.6), rec(config=cfg_static, provenance="static"),
                    rec(p2, provenance="default")])
    add_records(b, [rec(config=cfg_fast, time_ms=0.4),
                    replace(rec(config=cfg_slow, time_ms=0.1), triton_version="2.0.0"),  # stale
                    rec(p2, config=cfg_static, provenance="static")])
    out = tmp_path / "merged.sqlite"
    res = merge_dbs([a, b], out)
    assert (res.kept, res.dropped, res.conflicts) == (2, 4, 2)
    got = {r.problem: r for r in read_records(str(out))}
    assert got[PROB].config == cfg_fast and got[PROB].time_ms == 0.4   # best fresh measured time
    assert got[p2].provenance == "static"                               # static beats default


def test_merge_into_one_of_its_sources(tmp_path):
    a = tmp_path / "a.sqlite"
    add_records(str(a), [rec(time_ms=0.5), rec(time_ms=0.3)])
    res = merge_dbs([str(a)], a, overwrite=True)
    assert res.kept == 1
    assert [r.time_ms for r in read_records(str(a))] == [0.3]


def test_shipped_database_is_valid_and_found():
    path = dblookup.shipped_db_path("sm90")
    assert path is not None and path.name == dblookup.db_filename("sm90")
    recs = read_records(str(path), readonly=True)   # strict: every row validates
    assert recs and all(r.arch == "sm90" for r in recs)
    assert {r.op for r in recs} == {"ssd_fwd", "ssd_decode", "ssd_bwd", "ssd_varlen", "sscan_fwd", "sscan_bwd"}   # every op
    # the backward's: measured at the five training shapes, fp16 and bf16, calls passing z
    bwd = {(r.problem.batch, r.problem.seqlen, r.problem.nheads, r.problem.dtype)
           for r in recs if r.op == "ssd_bwd" and r.provenance == "measured" and r.problem.has_z}
    assert bwd == {(b, l, h, d) for b, l, h in ((8, 2048, 80), (4, 16384, 80), (1, 65536, 80), (4, 8192, 24),
                                                (1, 65536, 128)) for d in ("fp16", "bf16")}
    assert all(math.isfinite(r.time_ms) for r in recs if r.provenance == "measured")


def test_shipped_records_are_fresh_for_the_code_that_ships_them():
    """A record is fresh while its config's rendering hashes as when it was timed. Anything
    rendered into every module (render.STAGE_LAUNCH's table, a shared helper) changes every
    config's hash: then the shipped picks go stale at once. This fails at that edit, not after a
    user finds stale picks: re-measure (scripts/remeasure_records.py) or, where the launched
    kernels are unchanged, rehash (scripts/build_shipped_db.py --rehash-from REV)."""
    from autossd.db.records import current_kernel_hash
    recs = read_records(to_url(dblookup.shipped_db_path("sm90")), readonly=True)
    stale = [r.problem.key() for r in recs if r.template_hash != current_kernel_hash(r.config, r.arch)]
    assert recs and not stale, f"{len(stale)} of {len(recs)} shipped records stale, e.g. {stale[:2]}"


def _build_script():
    import importlib.util
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("build_shipped_db", root / "scripts" / "build_shipped_db.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    return b, root


def test_a_decode_sweep_ships_each_shapes_fastest_config_as_a_measured_record(monkeypatch, tmp_path):
    """scripts/build_shipped_db.py --decode-sweep: per (state dtype, batch) the fastest row of an
    scripts/sweep_decode.py file, measured, graph-timed, on the file's device, dated and
    hashed as the file says (a kernel changed since makes it stale); the decode step picks it."""
    from autossd.db.records import current_kernel_hash
    from autossd.ops.ssd import decode
    from autossd.ops.ssd.decode_knobs import DecodeConfig, DecodeProblem
    monkeypatch.setattr(sys, "path", list(sys.path))   # the script puts the repo first
    b, _ = _build_script()
    call = dict(nheads=4, headdim=16, dstate=16, ngroups=1, dtype="bf16", has_D=True, has_z=True,
                has_dt_bias=True, dt_softplus=True, tokens=1)
    fast, slow = DecodeConfig(block_p=4, warps=1), DecodeConfig(block_p=8, warps=2)

    def row(state, batch, cfg, us, kh=None):
        return {"state": state, "batch": batch, "config": cfg.as_dict(), "graph_us": us, "pct_copy": 50.0,
                "kernel_hash": kh or render.kernel_hash(cfg, "cuda")}
    sweep = {"device": "NVIDIA H200", "copy_gbps": 4000.0, "triton": "3.6.0", "date": "2026-11-26T10:00:00+00:00",
             "call": call, "rows": [row("fp32", 2, slow, 9.0), row("fp32", 2, fast, 4.0),
                                    row("bf16", 2, slow, 3.0, kh="0123456789abcdef")]}
    src, out = tmp_path / "sweep.json", tmp_path / "sm90.sqlite"
    src.write_text(json.dumps(sweep))
    assert b.main(["--out", str(out), "--decode-sweep", str(src)]) == 0
    recs = {r.problem.state_dtype: r for r in read_records(str(out), "sm90", "ssd_decode")}
    fp32 = recs["fp32"]
    assert fp32.problem == DecodeProblem(batch=2, state_dtype="fp32", **call) and fp32.config == fast
    assert (fp32.provenance, fp32.launch_mode, fp32.device, fp32.time_ms) == ("measured", "graph", "NVIDIA H200", 0.004)
    assert fp32.created_at.startswith("2026-11-26T10:00") and fp32.triton_version == "3.6.0"
    assert fp32.template_hash == current_kernel_hash(fast, "sm90")
    assert recs["bf16"].stale_reasons("3.6.0", "x")   # its kernels are not the ones that run now
    monkeypatch.setattr(dblookup, "shipped_db_path", lambda arch: out)
    dblookup.clear_cache()
    try:
        assert decode.choose(fp32.problem, "sm90")[0] == fast
        # a call without z: no record within the nearest tier (the decode step's flags are all
        # hard), the record's config carried over by the transfer tier
        cfg, why = decode.choose(fp32.problem.replace(has_z=False), "sm90")
        assert cfg == fast and why.startswith("transfer")
    finally:
        dblookup.clear_cache()
    # a file from before the sweep wrote its code's hashes: refused unless stamped as current
    del sweep["triton"]
    src.write_text(json.dumps(sweep))
    with pytest.raises(SystemExit, match="assume-current-code"):
        b.main(["--out", str(out), "--decode-sweep", str(src)])
    assert b.main(["--out", str(out), "--decode-sweep", str(src), "--assume-current-code"]) == 0
    assert {r.template_hash for r in read_records(str(out), "sm90", "ssd_decode")} == \
        {current_kernel_hash(fast, "sm90"), current_kernel_hash(slow, "sm90")}


def test_remeasure_jobs_measure_each_stored_config_and_each_feasible_variant(monkeypatch):
    """scripts/remeasure_records.py: every stored config as it is, then once per set of knob
    changes where the changed config is feasible for its problem, each (shape, dtype, config) once."""
    import importlib.util
    monkeypatch.setattr(sys, "path", list(sys.path))   # the script puts the repo first
    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("remeasure_records", root / "scripts" / "remeasure_records.py")
    rm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rm)
    prob = Problem(batch=1, seqlen=2048, nheads=8, headdim=64, dstate=128, ngroups=1, dtype="fp16",
                   has_D=True, has_dt_bias=True, dt_softplus=True)
    base = default_config("sm90", prob)
    folded = base.replace(fold_prep=1)
    recs = [{"problem": prob.key(), "config": c.as_dict()} for c in (base, folded, base)]
    alts = [{"state_walk": 1}, {"state_walk": 1, "fold_prep": 2}]
    todo = rm.jobs(recs, "small", alts, "sm90")
    pinned = [dict(kv.split("=") for kv in j.fix.split(",")) for j in todo]
    got = [(d["fold_prep"], d["state_walk"]) for d in pinned]
    # base; base + walk; base + walk + prep; folded, whose walk variant is infeasible (the walk
    # replaces the launch fold_prep=1 folds into) and whose walk + prep variant is base's; the
    # repeated base record adds nothing
    assert got == [("0", "0"), ("0", "1"), ("2", "1"), ("1", "0")]
    assert rm.jobs(recs, "large", alts, "sm90") == []                       # 2048 tokens: small
    assert rm.jobs(recs, "small", alts, "sm80") == rm.jobs(recs, "small", [], "sm80")   # sm90 knobs
    assert rm.jobs(recs, "small", alts, "sm90", where={"nheads": 8}) == todo     # --where nheads=8
    assert rm.jobs(recs, "small", alts, "sm90", where={"nheads": 80}) == []
    assert rm.jobs(recs, "small", alts, "sm90", op="ssd_bwd") == []           # --op: another op's records
    dev = [dict(r, device="NVIDIA H200") for r in recs]
    assert rm.jobs(dev, "small", alts, "sm90", device="NVIDIA H100 80GB HBM3") == []
    assert rm.jobs(dev, "small", alts, "sm90", device="NVIDIA H200") == todo
    assert rm.jobs(recs, "small", alts, "sm90", variants_only=True) == [todo[1], todo[2]]   # --variants-only
    # --restate has_z=true: the same configs at the same shapes with z, each a problem of its own
    zed = rm.jobs(recs, "small", None, "sm90", restate={"has_z": True})
    plain = rm.jobs(recs, "small", None, "sm90")
    assert [j.fix for j in zed] == [j.fix for j in plain] and all("z=0" in j.shape for j in plain)
    assert [j.shape for j in zed] == [j.shape.replace("z=0", "z=1") for j in plain]
    # one `autossd tune` run per (dtype, config), holding each shape it is re-measured at
    other = prob.replace(seqlen=1000)
    two = [{"problem": q.key(), "config": base.as_dict()} for q in (prob, other)]
    (run, shapes), = rm.batches(rm.jobs(two, None, None, "sm90"))
    assert run.shape == ";".join(shapes) and len(shapes) == 2 and "l=1000" in shapes[1]
    # another op's form: packed prefill's shapes (t, s, ...) and its state dtype, read back whole
    from autossd.ops.ssd.varlen_knobs import default_config as varlen_default, problem_for
    vp = problem_for(8192, 16, 80, 64, 128, 1, 256, "bf16", state_dtype="bf16", has_D=True, has_dt_bias=True,
                     dt_softplus=True, has_init=True)
    job, = rm.jobs([{"op": "ssd_varlen", "problem": vp.key(), "config": varlen_default("sm90", vp).as_dict()}],
                   None, None, "sm90", op="ssd_varlen")
    assert job.shape.startswith("t=8192,s=16,") and job.state_dtype == "bf16" and job.dtype == "bf16"
    with pytest.raises(ValueError, match="no --shapes form"):   # a field --shapes cannot state
        rm.jobs([{"problem": prob.replace(has_seq_idx=True).key(), "config": base.as_dict()}], None, None, "sm90")


def test_rehash_only_where_the_launched_kernels_and_their_launch_are_unchanged(monkeypatch, capsys):
    """scripts/build_shipped_db.py --rehash-from: a record stamped by a revision's code gets the
    current kernel hash only when every kernel its config launches is the same code and launches
    the same way there. The revision's side (what its own code renders) is faked here."""
    monkeypatch.setattr(sys, "path", list(sys.path))   # the script puts the repo first
    b, _ = _build_script()

    def at_rev(change=lambda src: src, launch=lambda opts: opts, error=None):
        def fake(rev, todo, tmp):
            out = []
            for cfg_json, backend in todo:
                c = Config.from_json(cfg_json)
                # every function one line lower at the revision: line numbers alone must not matter
                src = render.render(c, backend).replace("import triton\n", "import triton\n# moved\n", 1)
                out.append({"error": error} if error else
                           {"source": change(src), "launch": launch(render.launch_options(c, backend)),
                            "template_hash": "a11a11", "kernel_hash": "b22b22"})
            return out
        return fake
    five = replace(rec(), template_hash="a11a11")                 # rev's all-templates stamp
    one = replace(rec(config=default_config("sm90", PROB, launches=1)), template_hash="b22b22")  # rev's kernel hash
    alien = replace(rec(), template_hash="0123abcd")              # made by no code we can compare with
    fresh = {r.config.launches: render.kernel_hash(r.config, "cuda") for r in (five, one)}
    try:
        monkeypatch.setattr(b, "_at_rev", at_rev())
        out, n = b.rehash([five, one, alien], "REV")
        assert n == 2 and [r.template_hash for r in out] == [fresh[5], fresh[1], "0123abcd"]
        # a kernel only five launches differs at the revision
        monkeypatch.setattr(b, "_at_rev", at_rev(lambda src: src.replace("def ssd_state_passing(",
                                                                         "def ssd_state_passing(  ", 1)))
        out, n = b.rehash([five, one], "REV")
        assert n == 1 and [r.template_hash for r in out] == ["a11a11", fresh[1]]
        # a global the kernels read (not a tl.constexpr, so not in triton's cache key) differs
        monkeypatch.setattr(b, "_at_rev", at_rev(lambda src: src.replace("STATE_DTYPE = tl.bfloat16",
                                                                         "STATE_DTYPE = tl.float32", 1)))
        assert b.rehash([five], "REV")[1] == 0
        # the same kernels launched with other options (the Python, not the templates, changed)
        monkeypatch.setattr(b, "_at_rev", at_rev(launch=lambda o: {**o, "cumsum": {**o["cumsum"], "num_warps": 2}}))
        out, n = b.rehash([five, one], "REV")
        assert n == 1 and [r.template_hash for r in out] == ["a11a11", fresh[1]]
        assert "kept as it was" not in capsys.readouterr().err    # decided by comparison, not by an error
        monkeypatch.setattr(b, "_at_rev", at_rev(error="ValueError: knobs ['x'] did not exist"))
        assert b.rehash([five], "REV")[1] == 0 and "kept as it was" in capsys.readouterr().err
    finally:
        render.kernel_hash.cache_clear()


def test_rehash_runs_the_revisions_own_code(monkeypatch, tmp_path):
    """The real revision side: HEAD's code in a subprocess (a clean checkout: the same code)."""
    import subprocess
    monkeypatch.setattr(sys, "path", list(sys.path))
    b, root = _build_script()
    git = ["git", "-C", str(root)]
    if subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    if subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "templates", "autossd"]).returncode:
        pytest.skip("uncommitted edits: HEAD's code is not the working tree's")
    r = rec()
    (then,) = b._at_rev("HEAD", [(r.config.key(), "cuda")], tmp_path)
    assert then["kernel_hash"] == render.kernel_hash(r.config, "cuda")
    assert then["launch"] == json.loads(json.dumps(render.launch_options(r.config, "cuda")))
    old = replace(r, template_hash=then["template_hash"])       # a legacy stamp made at HEAD
    out, n = b.rehash([old], "HEAD")
    assert n == 1 and out[0].template_hash == render.kernel_hash(r.config, "cuda")


def test_a_record_refused_by_the_sm90_miscompile_rule_is_never_used(tmp_path, no_shipped_db):
    # a user DB written before the rule: the row is rejected on reading, the default is used
    prob = PROB.replace(chunk_size=64)
    bad = fit(Config(launches=1, chunk_size=64, state_block_m=32, scan_block_m=64), prob)
    path = tmp_path / "user.sqlite"
    add_records(str(path), [rec(prob, bad, arch="sm80")])     # feasible on sm80
    dbengine.dispose_engines()
    _tamper(path, "arch", "sm90")
    with pytest.raises(RecordError, match="miscompiled"):
        read_records(str(path))
    m = dblookup.choose(prob, "sm90")
    assert m.kind == "default" and m.config == default_config("sm90", prob)


def test_merge_reads_an_older_source_without_changing_it(tmp_path):
    """A source with an older schema is migrated in a temporary copy: the file itself (which an
    older autossd may still use) is left byte for byte, with no -wal/-shm beside it."""
    import hashlib
    old = tmp_path / "old.sqlite"
    url = to_url(old)
    assert migrate(url, "0004") == "0004"
    cols = _columns(url)
    base = _at_schema(default_config("sm90", PROB), cols)   # what schema 4 could express
    _insert_old(url, [_old_row(rec(config=base), cols)])
    dbengine.dispose_engines(url)
    dbengine.finalize_sqlite(old)
    before = hashlib.sha256(old.read_bytes()).hexdigest()
    out = tmp_path / "out.sqlite"
    assert merge_dbs([str(old)], out).kept == 1
    assert [r.config for r in read_records(str(out))] == [base]
    assert hashlib.sha256(old.read_bytes()).hexdigest() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("old.sqlite-")]
    with pytest.raises(TuningDBError, match="no such file"):
        merge_dbs([str(tmp_path / "typo.sqlite")], tmp_path / "o2.sqlite")
    assert not (tmp_path / "typo.sqlite").exists()


@pytest.mark.parametrize("arch", ["sm90", "sm80", "gfx90a", "gfx942"])
def test_shipped_records_keep_their_states_in_a_type_a_tune_may_pick(arch):
    # fp16 states overflow where bf16/fp32 inputs would not (knobs.NARROWER_STATES): no tune
    # offers them; a static record (no gate) keeps its states in fp32 or the inputs' own type
    # (knobs.UNGATED_STATES). Both ops' records, every shipped file: the check once read only
    # sm90's forward, and static backward records with fp16 states for bf16 shapes shipped
    from autossd.knobs import NARROWER_STATES, UNGATED_STATES
    path = dblookup.shipped_db_path(arch)
    assert path is not None
    recs = read_records(to_url(path), readonly=True)
    assert {r.op for r in recs} >= {"ssd_fwd", "ssd_bwd"}
    rule = lambda r: UNGATED_STATES if r.provenance == "static" else NARROWER_STATES  # noqa: E731
    bad = [(r.op, r.problem.dtype, r.config.state_dtype, r.provenance) for r in recs
           if r.op in ("ssd_fwd", "ssd_bwd") and r.config.state_dtype in rule(r).get(r.problem.dtype, ())]
    assert not bad, bad


def _set_bmm_warps(path: Path, value) -> None:
    """Store a bmm_warps the knob does not offer, in a knob column or in the config's JSON."""
    con = sqlite3.connect(str(path))
    cols = [c[0] for c in con.execute("SELECT * FROM tuned_records").description]
    col = next((c for c in cols if c.endswith("bmm_warps")), None)
    if col is not None:
        con.execute(f'UPDATE tuned_records SET "{col}" = ?', (value,))
    else:
        for rid, cfg in con.execute("SELECT id, config_json FROM tuned_records").fetchall():
            con.execute("UPDATE tuned_records SET config_json = ? WHERE id = ?",
                        (json.dumps({**json.loads(cfg), "bmm_warps": value}, sort_keys=True), rid))
    con.commit()
    con.close()


def test_an_invalid_knob_value_is_reported_without_a_repeated_prefix(tmp_path):
    prob = PROB.replace(chunk_size=64)
    path = tmp_path / "user.sqlite"
    add_records(str(path), [rec(prob, default_config("sm90", prob))])
    dbengine.dispose_engines()
    _set_bmm_warps(path, 3)
    with pytest.raises(RecordError) as e:
        read_records(str(path))
    assert "=3 is not allowed" in str(e.value) and "config: config:" not in str(e.value), str(e.value)
