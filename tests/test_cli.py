"""The `autossd` command: a static-mode tune end to end into a temporary database that the
runtime then resolves from; argument errors; show / export / merge / plot / doctor / bench."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from autossd.cli import main
from autossd.tuner import parse_shape

SHAPE = "b=1,l=512,h=4,p=32,n=32,g=1"


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSSD_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("AUTOSSD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOSSD_DB", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return tmp_path


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_static_tune_end_to_end_then_the_runtime_uses_the_record(env, monkeypatch):
    db, journal, plots = env / "tuning.sqlite", env / "studies.journal", env / "plots"
    r = invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 6, "--seed", 0,
               "--db", db, "--storage", journal, "--compile-workers", 2, "--no-progress",
               "--plot-dir", plots)
    assert r.exit_code == 0, r.output
    assert "STATIC tuning for gfx942" in r.output and "PREDICTIONS" in r.output
    assert "predicted ms" in r.output and "b=1,l=512,h=4,p=32,n=32,g=1 fp16" in r.output
    assert sorted(p.name.split("_")[0] for p in plots.iterdir()) == ["history", "roofline.png"]

    shown = invoke("show", "--db", db, "--json")
    recs = json.loads(shown.output)
    assert len(recs) == 1 and recs[0]["provenance"] == "static" and recs[0]["arch"] == "gfx942"
    assert "(pred.)" in invoke("show", "--db", db).output

    from autossd.runtime import get_kernel
    kernel = get_kernel(parse_shape(SHAPE, op="ssd_fwd"), arch="gfx942", db=str(db))
    assert kernel.provenance == "static"
    assert kernel.config.as_dict() == recs[0]["config"]

    # the study resumes: asking for 7 evaluations adds one (compiled in this process, which goes
    # through the spawned compiler: this one imported Triton interpreted)
    _interpreted(monkeypatch)
    r = invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 7, "--seed", 0,
               "--db", db, "--storage", journal, "--compile-workers", 0, "--no-progress")
    assert r.exit_code == 0, r.output
    row = [ln for ln in r.output.splitlines() if ln.startswith("b=1,l=512")][0].split()
    assert int(row[2]) + int(row[3]) == 7      # ok + failed across both runs

    # the .sqlite file alone holds the records (a user copies or ships just that file; under
    # WAL they would sit in the -wal file until every connection closed)
    alone = env / "copied" / "alone.sqlite"
    alone.parent.mkdir()
    shutil.copyfile(db, alone)
    assert len(json.loads(invoke("show", "--db", alone, "--json").output)) == 1

    out = env / "gfx942.sqlite"
    assert invoke("export", "--db", db, "--out", out, "--arch", "gfx942").exit_code == 0
    again = CliRunner().invoke(main, ["export", "--db", str(db), "--out", str(out)])
    assert again.exit_code == 2 and "use --overwrite" in again.output
    merged = env / "merged.sqlite"
    assert invoke("merge", out, db, "--into", merged).exit_code == 0
    assert len(json.loads(invoke("show", "--db", merged, "--json").output)) == 1


def _interpreted(monkeypatch):
    """Kernels of this process on the CPU interpreter: the runtime's calls run there, and the
    tune's in-process compiles go to autossd.compile's spawned compiler (a process whose Triton
    was imported interpreted cannot compile)."""
    import triton
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)


def _tune(env, monkeypatch, *args):
    _interpreted(monkeypatch)
    r = invoke("tune", "--arch", "sm90", "--trials", 3, "--seed", 0, "--db", env / "tuning.sqlite",
               "--storage", env / "studies.journal", "--compile-workers", 0, "--no-progress", *args)
    assert r.exit_code == 0, r.output
    assert "STATIC tuning for sm90" in r.output
    return r


def test_static_tune_of_the_decode_step_is_stored_and_the_step_runs_its_record(env, monkeypatch, no_shipped_db):
    from autossd.db import lookup, read_records
    from autossd.ops.ssd import decode
    db = env / "tuning.sqlite"
    r = _tune(env, monkeypatch, "--op", "ssd_decode", "--shapes", "b=2,h=4,p=16,n=16,g=1", "--dtype", "bf16",
              "--state-dtype", "bf16")
    assert "b=2,t=1,h=4,p=16,n=16,g=1 bf16 state bf16" in r.output
    recs = json.loads(invoke("show", "--db", db, "--op", "ssd_decode", "--json").output)
    assert len(recs) == 1 and recs[0]["op"] == "ssd_decode" and recs[0]["provenance"] == "static"
    assert recs[0]["problem"] == {"batch": 2, "tokens": 1, "nheads": 4, "headdim": 16, "dstate": 16,
                                  "ngroups": 1, "dtype": "bf16", "state_dtype": "bf16", "has_D": True,
                                  "has_z": False, "has_dt_bias": True, "dt_softplus": True}
    [rec] = read_records(str(db), "sm90", "ssd_decode")   # strict: the store's validation passes
    assert rec.config.as_dict() == recs[0]["config"]
    table = invoke("show", "--db", db).output           # every op's records, the op named
    assert "ssd_decode" in table and "b=2,t=1,h=4,p=16,n=16,g=1 bf16 state bf16" in table
    assert invoke("show", "--db", db, "--op", "ssd_varlen").output.strip() == "no records"

    # a call of that shape (the interpreter emulates sm90) runs the stored config
    monkeypatch.setenv("AUTOSSD_DB", str(db))
    lookup.clear_cache()
    t = decode.tune_inputs(rec.problem)
    prob, cfg, why = decode.kernel_for(t["state"], t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"],
                                       dt_bias=t["dt_bias"], dt_softplus=True)
    assert prob == rec.problem and cfg == rec.config and why.startswith("exact match: static record")
    # another state dtype is another problem: no record applies
    st = t["state"].float()
    assert "default" in decode.kernel_for(st, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"],
                                          dt_bias=t["dt_bias"], dt_softplus=True)[2]


def test_static_tune_of_packed_prefill_is_stored_and_picked_for_nearby_batches(env, monkeypatch, no_shipped_db):
    from autossd.db import read_records
    from autossd.ops.ssd import varlen
    db = env / "tuning.sqlite"
    r = _tune(env, monkeypatch, "--op", "ssd_varlen", "--shapes", "t=100,s=3,q=32,h=4,p=16,n=16,g=1", "--dtype", "bf16")
    assert "t=100,s=3,q=32,h=4,p=16,n=16,g=1 bf16 state fp32" in r.output
    recs = json.loads(invoke("show", "--db", db, "--op", "ssd_varlen", "--json").output)
    want = varlen.problem_for(100, 3, 4, 16, 16, 1, 32, "bf16", has_D=True, has_dt_bias=True, dt_softplus=True,
                              has_init=True)
    assert len(recs) == 1 and recs[0]["op"] == "ssd_varlen" and recs[0]["problem"] == want.key()
    [rec] = read_records(str(db), "sm90", "ssd_varlen")
    cfg, why = varlen.choose(want, "sm90", db=str(db))
    assert cfg == varlen.fit(rec.config, want) and why.startswith("exact match: static record")
    near = varlen.problem_for(120, 3, 4, 16, 16, 1, 32, "bf16", has_D=True, has_dt_bias=True, dt_softplus=True,
                              has_init=True)
    assert varlen.choose(near, "sm90", db=str(db))[1].startswith("nearest match: static record")
    # another flag: the record's config carried over (the lookup's transfer tier), not the record as is
    assert varlen.choose(near.replace(has_init=False), "sm90", db=str(db))[1].startswith("transfer")


def test_a_measured_packed_prefill_record_merges_with_its_figures_and_plots(env):
    from autossd.db import read_records
    from autossd.ops.ssd import varlen
    from autossd.tuner.sinks import JsonlSink, make_result
    p = varlen.problem_for(100, 3, 4, 16, 16, 1, 32, "bf16", has_D=True)
    src, db = env / "a.jsonl", env / "m.sqlite"
    JsonlSink(src).save(make_result("sm90", "NVIDIA H100", p, varlen.default_config("sm90", p), 0.05, "measured"))
    assert invoke("merge", src, "--into", db).exit_code == 0
    [rec] = read_records(str(db), "sm90", "ssd_varlen")
    assert rec.problem == p and rec.time_ms == 0.05 and rec.tflops > 0 and rec.gbps > 0 and rec.pct_of_floor > 0
    r = invoke("plot", "--db", db, "--storage", env / "none.journal", "--out-dir", env / "p")
    assert r.exit_code == 0 and (env / "p" / "roofline.png").stat().st_size > 1000


def test_state_dtype_is_refused_for_ops_whose_problems_name_none(env):
    r = invoke("tune", "--arch", "sm90", "--shapes", SHAPE, "--state-dtype", "bf16")
    assert r.exit_code == 2 and "'--state-dtype'" in r.output and "no state dtype" in r.output
    r = invoke("tune", "--arch", "sm90", "--op", "ssd_decode", "--shapes", "mamba2-2.7b:l=2048")
    assert r.exit_code == 2 and "'--shapes'" in r.output and "unknown key 'l'" in r.output


@pytest.mark.parametrize("args, option, msg", [
    (["--arch", "gfx9", "--shapes", SHAPE], "'--arch'", "unknown architecture 'gfx9'"),
    (["--arch", "gfx942", "--shapes", "b=1,l=abc,h=4,p=32,n=32,g=1"], "'--shapes'", "not an integer"),
    (["--arch", "gfx942", "--shapes", "b=1,l=512"], "'--shapes'", "missing h, p, n, g"),
    (["--arch", "gfx942", "--preset", "mamba3"], "'--preset'", "mamba3"),
    (["--arch", "gfx942", "--shapes", SHAPE, "--sampler", "annealing"], "'--sampler'", "annealing"),
    (["--arch", "gfx942", "--shapes", SHAPE, "--fix", "scan_block_m=7"], "'--fix'", "scan_block_m=7"),
    (["--arch", "gfx942", "--shapes", SHAPE, "--fix", "tile=64"], "'--fix'", "knob=value"),
    (["--arch", "gfx942", "--shapes", SHAPE, "--fix", "decay_split=maybe"], "'--fix'", "not a bool"),
    (["--arch", "gfx942", "--shapes", SHAPE, "--mode", "measured"], "'--mode'", "needs a local gfx942"),
])
def test_bad_arguments_name_the_option(env, args, option, msg):
    r = invoke("tune", *args)
    assert r.exit_code == 2
    assert option in r.output and msg in r.output


def test_preset_grid_tunes_the_whole_grid_in_order_with_progress(env, monkeypatch):
    # the tune itself is the library's (tested on its own); here: which shapes, in which order,
    # and a line per shape saying where the run is
    import autossd.tuner
    from autossd.tuner.shapes import grid
    seen = []
    monkeypatch.setattr(autossd.tuner, "tune", lambda arch, probs, *a, **kw: seen.extend(probs) or [])
    r = invoke("tune", "--arch", "gfx942", "--preset", "grid", "--db", env / "g.sqlite")
    assert seen == grid(op="ssd_fwd") and {p.dtype for p in seen} == {"fp16", "bf16"}
    assert f"[1/{len(seen)}] " in r.output and f"[{len(seen)}/{len(seen)}] " in r.output
    seen.clear()
    invoke("tune", "--arch", "gfx942", "--preset", "grid", "--dtype", "bf16", "--db", env / "g.sqlite")
    assert seen == grid(("bf16",), op="ssd_fwd")
    seen.clear()
    r = invoke("tune", "--arch", "gfx942", "--preset", "grid", "--op", "ssd_decode", "--db", env / "g.sqlite")
    assert seen == grid(op="ssd_decode")   # the decode step's grid: both cache types unless named
    assert "Caveat for ssd_decode" in r.output and "slower than the default" in r.output
    seen.clear()
    invoke("tune", "--arch", "gfx942", "--preset", "grid", "--op", "ssd_decode", "--state-dtype", "fp32",
           "--db", env / "g.sqlite")
    assert seen == grid(op="ssd_decode", state_dtype="fp32")


def test_a_shape_that_cannot_be_tuned_leaves_the_others_to_run_and_fails_the_exit_status(env, monkeypatch):
    """An evaluation worker that dies (a float64 reference out of GPU memory, say) at one shape:
    the next shapes are still tuned, the failure is said with the shape, the exit status is 1."""
    import autossd.tuner
    seen = []

    def fake(arch, probs, *a, **kw):
        seen.extend(probs)
        if probs[0].seqlen == 512:
            raise RuntimeError("evaluation worker died while starting (exit 1)")
        return []
    monkeypatch.setattr(autossd.tuner, "tune", fake)
    r = CliRunner().invoke(main, ["tune", "--arch", "gfx942", "--shapes", f"{SHAPE};b=1,l=1024,h=4,p=32,n=32,g=1",
                                  "--db", str(env / "f.sqlite"), "--no-progress"])
    assert [p.seqlen for p in seen] == [512, 1024]
    assert r.exit_code == 1
    assert "not tuned: RuntimeError: evaluation worker died" in r.output and "1 of 2 shapes not tuned" in r.output


@pytest.mark.parametrize("raw, value", [("False", False), ("0", False), ("no", False),
                                        ("True", True), ("1", True), ("yes", True)])
def test_fix_reads_a_bool_knob_by_its_word(raw, value):
    # bool("False") is True: --fix decay_split=False once pinned the factored decay on
    from autossd.cli import _knob_settings
    assert _knob_settings(None, None, (f"decay_split={raw}",)) == {"decay_split": value}


def test_brute_force_on_a_huge_space_says_how_to_shrink_it(env):
    r = invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--sampler", "brute",
               "--db", env / "x.jsonl", "--storage", env / "j.journal", "--no-progress")
    assert r.exit_code == 1 and "--fix" in r.output


def test_jsonl_store_show_export_merge_and_plot(env):
    from autossd.problem import Problem
    from autossd.ops.ssd.fwd_knobs import default_config
    from autossd.tuner.sinks import JsonlSink, make_result
    p = parse_shape(SHAPE, op="ssd_fwd")
    a, b = env / "a.jsonl", env / "b.jsonl"
    cfg = default_config("sm90", p)
    JsonlSink(a).save(make_result("sm90", "H100 model", p, cfg, 0.5, "static"))
    JsonlSink(b).save(make_result("sm90", "NVIDIA H100", p, cfg.replace(scan_warps=8), 0.7, "measured"))
    JsonlSink(b).save(make_result("sm90", "NVIDIA H100", Problem(**{**p.key(), "seqlen": 1024}),
                                  cfg, 0.9, "measured"))
    assert invoke("merge", a, b, "--into", env / "m.jsonl").exit_code == 0
    recs = json.loads(invoke("show", "--db", env / "m.jsonl", "--json").output)
    assert len(recs) == 2
    mine = [r for r in recs if r["problem"]["seqlen"] == 512][0]
    assert mine["provenance"] == "measured"           # measured beats a faster static prediction
    r = invoke("export", "--db", env / "m.jsonl", "--out", env / "e.jsonl", "--arch", "sm90")
    assert r.exit_code == 0 and "2 records" in r.output
    r = invoke("plot", "--db", env / "m.jsonl", "--storage", env / "none.journal", "--out-dir", env / "p")
    assert r.exit_code == 0 and (env / "p" / "roofline.png").stat().st_size > 1000


def test_doctor_and_bench_without_gpu(env):
    r = invoke("doctor")
    assert r.exit_code == 0 and "triton" in r.output and "local arch" in r.output
    from autossd.db.lookup import shipped_dir     # where an installed package keeps them
    assert "sm90.sqlite" in r.output and str(shipped_dir()) in r.output
    r = invoke("bench", "--shapes", SHAPE)
    assert r.exit_code == 1 and "needs a GPU" in r.output


def test_two_workers_share_each_study_and_budget_across_shapes(env, monkeypatch):
    """Two worker processes, started once, go through both shapes: each shape's study gets one
    shared budget and one stored record, and no more than those two processes evaluated any
    trial (workers started per shape made four). The workers also finish the shapes (summary
    and re-timing): the parent makes a runner only to seed each study, none after. And the tune
    ends: each worker, with a compile pool of its own, shuts it down (a multiprocessing child
    joins its live children on its way out, and the pool's workers wait for work forever). Each
    shape is stored as it is finished, not after the last one."""
    import optuna
    from autossd.tuner import api
    from autossd.tuner.storage import open_storage
    import multiprocessing
    made = []
    real = api.make_runner
    monkeypatch.setattr(api, "make_runner", lambda *a, **kw: made.append(a[2]) or real(*a, **kw))
    # each shape's record stored as its result arrives (a tune stopped at a time limit keeps the
    # shapes it finished): the first store happens while a worker is still on the other shape
    alive_at_store = []
    save = api.save_best
    monkeypatch.setattr(api, "save_best", lambda *a, **kw: alive_at_store.append(
        len(multiprocessing.active_children())) or save(*a, **kw))
    other = "b=2,l=256,h=4,p=32,n=32,g=1"
    # a compile worker in each: a worker process must shut its compile pool down to end
    r = invoke("tune", "--arch", "sm80", "--shapes", f"{SHAPE};{other}", "--trials", 4, "--workers", 2,
               "--compile-workers", 1, "--db", env / "w.jsonl", "--storage", env / "w.journal",
               "--no-progress")
    assert r.exit_code == 0, r.output
    for start in ("b=1,l=512", "b=2,l=256"):
        row = [ln for ln in r.output.splitlines() if ln.startswith(start)][0].split()
        assert 4 <= int(row[2]) + int(row[3]) <= 5     # one shared budget (a last concurrent one may land)
    assert len(json.loads(invoke("show", "--db", env / "w.jsonl", "--json").output)) == 2
    assert len(made) == 2, made   # the seeding of each study; the workers finished both
    assert len(alive_at_store) == 2 and alive_at_store[0] >= 1, alive_at_store
    storage = open_storage(str(env / "w.journal"))
    pids = set()
    for s in optuna.get_all_study_summaries(storage):
        trials = optuna.load_study(study_name=s.study_name, storage=storage).trials
        pids |= {t.user_attrs["pid"] for t in trials if t.user_attrs.get("evaluated")}
    assert 1 <= len(pids) <= 2, pids


def test_show_migrates_a_store_from_an_earlier_autossd(env, tmp_path):
    """A database written by an earlier autossd (older schema) is upgraded on read, as the runtime
    lookup does, and keeps its rows; `show` used to fail on the missing knob columns."""
    import sqlalchemy as sa

    from autossd.db import HEAD, engine, migrate, to_url
    from autossd.db.records import make_record
    from autossd.problem import Problem
    from autossd.ops.ssd.fwd_knobs import Config
    from test_db import _insert_old, _old_row   # a row as schema 4's writer stored it
    url = to_url(tmp_path / "old.sqlite")
    assert migrate(url, "0004") == "0004"
    with engine.get_engine(url).connect() as conn:
        cols = {c["name"] for c in sa.inspect(conn).get_columns("tuned_records")}
    assert "cfg_scan_maxnreg" not in cols
    prob = Problem(batch=1, seqlen=2048, nheads=80, headdim=64, dstate=128, ngroups=1, dtype="fp16")
    rec = make_record(prob, Config(scan_block_k=32), "sm90", provenance="measured", time_ms=0.1)
    engine.dispose_engines(url)
    _insert_old(url, [_old_row(rec, cols)])
    r = invoke("show", "--db", str(tmp_path / "old.sqlite"), "--json")
    assert r.exit_code == 0, r.output
    (shown,) = json.loads(r.output)
    assert shown["config"]["scan_block_k"] == 32 and shown["config"]["scan_maxnreg"] == 0
    with engine.get_engine(url).connect() as conn:
        assert engine.current_revision(conn) == HEAD


def test_tune_refuses_a_store_that_is_no_database_before_any_trial(env, monkeypatch):
    bad = env / "notes.sqlite"
    bad.write_text("not a database\n")
    r = CliRunner().invoke(main, ["tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 2,
                                  "--db", str(bad), "--storage", str(env / "j.journal"), "--no-progress"])
    assert r.exit_code == 2 and "'--db'" in r.output and "file is not a database" in r.output
    assert "STATIC tuning" not in r.output and bad.read_text() == "not a database\n"
    monkeypatch.setenv("AUTOSSD_DB", str(bad))      # the same, named by the environment
    r = CliRunner().invoke(main, ["tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 2,
                                  "--storage", str(env / "j.journal"), "--no-progress"])
    assert r.exit_code == 2 and "AUTOSSD_DB" in r.output




def test_export_of_a_jsonl_store_never_writes_lines_into_a_database_name(env, monkeypatch):
    src = env / "recs.jsonl"
    _interpreted(monkeypatch)   # the in-process compiles through the spawned compiler, a cold Triton cache too
    r = invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 4, "--seed", 0, "--db", src,
               "--storage", env / "j.journal", "--compile-workers", 0, "--no-progress")
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["export", "--db", str(src), "--out", str(env / "out.sqlite")])
    assert r.exit_code == 2 and "autossd merge" in r.output and not (env / "out.sqlite").exists()
    assert invoke("export", "--db", src, "--out", env / "out.jsonl").exit_code == 0


def test_a_jsonl_file_that_is_no_record_store_is_never_read_as_one_or_overwritten(env):
    notes = env / "notes.jsonl"
    notes.write_text("shopping: eggs, milk\n{\"x\": 1}\n")
    before = notes.read_text()
    for args in (["show", "--db", str(notes)],
                 ["merge", str(env / "none.jsonl"), "--into", str(notes)],
                 ["tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 1, "--db", str(notes),
                  "--storage", str(env / "j.journal"), "--no-progress"]):
        if args[0] == "merge":
            (env / "none.jsonl").write_text("")
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert r.exit_code == 2 and "notes.jsonl:1: not an autossd tuning record" in r.output, (args, r.output)
    assert notes.read_text() == before
    # a torn last line (a kill mid-write) is still skipped, not refused
    good = env / "recs.jsonl"
    assert invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 4, "--seed", 0, "--db", good,
                  "--storage", env / "j2.journal", "--no-progress").exit_code == 0
    with open(good, "a") as f:
        f.write('{"arch": "gfx9')
    assert len(json.loads(invoke("show", "--db", good, "--json").output)) == 1


def test_merging_a_jsonl_store_into_a_database_keeps_dates_and_staleness_and_adds_no_duplicates(env):
    src = env / "recs.jsonl"
    assert invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", 4, "--seed", 0, "--db", src,
                  "--storage", env / "j.journal", "--no-progress").exit_code == 0
    (rec,) = [json.loads(ln) for ln in src.read_text().splitlines()]
    old = {**rec, "template_hash": "0123456789abcdef", "date": "2026-01-02T03:04:05+00:00"}
    aged = env / "aged.jsonl"
    aged.write_text(json.dumps(old) + "\n")
    db = env / "merged.sqlite"
    for _ in range(2):     # merging the same store twice adds nothing
        assert invoke("merge", aged, "--into", db).exit_code == 0
    from autossd.db import read_records
    (r,) = read_records(str(db))
    assert r.template_hash == "0123456789abcdef" and r.created_at == "2026-01-02T03:04:05+00:00"
    from autossd.arch import get_arch
    from autossd.render import kernel_hash
    now = kernel_hash(r.config, get_arch(r.arch).backend)
    assert r.stale_reasons(r.triton_version, now)      # stays stale: a merge relabels nothing
    (fresh,) = read_records(str(env / "fresh.sqlite")) if invoke(
        "merge", src, "--into", env / "fresh.sqlite").exit_code == 0 else (None,)
    assert not fresh.stale_reasons(fresh.triton_version, now) and fresh.created_at == rec["date"]



def test_plot_of_a_corrupt_journal_names_the_file(env):
    journal = env / "studies.journal"
    journal.write_bytes(b'{"op_code":0,"worker_id":"0-1","study_name":"s","directions":[1]}\n'
                        b'{"op_code":5,"worker_id"{"op_code":0}\n'
                        b'{"op_code":0,"worker_id":"0-1","study_name":"t","directions":[1]}\n')
    r = CliRunner().invoke(main, ["plot", "--storage", str(journal), "--out-dir", str(env / "p")])
    assert r.exit_code != 0 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    assert f"Error: {journal}: " in r.output and "line 2" in r.output and "Traceback" not in r.output


def test_tune_summary_names_each_failure_cause_once_and_keeps_dumps_in_a_log(env, monkeypatch):
    from autossd.tuner import api
    from autossd.tuner.runners.base import Outcome
    dump = "\n".join(f"  %{i} = tt.load %ptr{i} : tensor<64x64x!tt.ptr<f16>, #shared>" for i in range(600))
    crash = (f"chunk_state: compile error: // -----// IR Dump Before ConvertTritonGPUToLLVM //----- //\n"
             f"{dump}\nLLVM ERROR: operation destroyed but still has uses\nRuntimeError: PassManager::run failed")
    smem = "chunk_state: shared memory 300000 B exceeds gfx90a's 65536 B per block"

    class Fake:
        mode, provenance, device = "static", "static", "fake"

        def __init__(self):
            self.n = 0

        def prepare(self, configs):
            return [None] * len(configs)

        def evaluate(self, config, prepared):
            self.n += 1
            return [Outcome(False, why=crash), Outcome(False, why=smem), Outcome(True, 1.0 + self.n)][self.n % 3]

        def close(self):
            pass

    monkeypatch.setattr(api, "make_runner", lambda *a, **k: Fake())
    r = invoke("tune", "--arch", "gfx90a", "--mode", "static", "--shapes", SHAPE, "--trials", 9,
               "--seed", 0, "--db", env / "t.sqlite", "--storage", env / "s.journal", "--no-progress")
    assert r.exit_code == 0, r.output[-3000:]
    out = r.output
    assert "tt.load" not in out and len(out.splitlines()) < 30, out
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("failed ")]
    assert any(ln.endswith("compiler crash: RuntimeError: PassManager::run failed") for ln in lines), lines
    assert any("out of shared memory: chunk_state: shared memory 300000 B" in ln for ln in lines), lines
    assert len(lines) == 2
    log = next(ln.split(": ", 1)[1] for ln in out.splitlines() if "full failure texts:" in ln)
    text = open(log).read()
    assert dump in text and "[compiler crash]" in text and "[out of shared memory]" in text


def test_show_of_a_missing_store_is_an_error_naming_it(env):
    for path in (env / "nonexistent.sqlite", env / "nonexistent.jsonl"):
        r = CliRunner().invoke(main, ["show", "--db", str(path)])
        assert r.exit_code != 0 and str(path) in r.output and "no records" not in r.output, r.output


def test_errors_of_a_store_from_autossd_db_name_autossd_db(env, monkeypatch):
    bad = env / "garbage.sqlite"
    bad.write_text("this is no database\n" * 100)
    monkeypatch.setenv("AUTOSSD_DB", str(bad))
    r = CliRunner().invoke(main, ["show"])
    assert r.exit_code != 0 and "AUTOSSD_DB" in r.output and "--db" not in r.output, r.output
    assert str(bad) in r.output


def test_export_refuses_an_unknown_extension_and_names_the_formats(env):
    r = CliRunner().invoke(main, ["export", "--out", str(env / "e.txt")])
    assert r.exit_code != 0 and not (env / "e.txt").exists()
    assert "e.txt" in r.output and ".sqlite" in r.output and ".jsonl" in r.output, r.output


def test_merge_prints_a_summary_in_words(env):
    from autossd.db import add_records, make_record
    p = parse_shape(SHAPE, "fp16", op="ssd_fwd")
    from autossd.ops.ssd.fwd_knobs import default_config
    a, b = env / "a.sqlite", env / "b.sqlite"
    add_records(str(a), [make_record(p, default_config("sm90", p), "sm90", provenance="static", predicted_ms=0.2)])
    add_records(str(b), [make_record(p, default_config("sm90", p), "sm90", provenance="static", predicted_ms=0.1)])
    r = invoke("merge", a, b, "--into", env / "m.sqlite")
    assert r.exit_code == 0 and "MergeResult" not in r.output, r.output
    assert "1 record kept" in r.output and "1 dropped" in r.output, r.output


def test_start_configs_are_evaluated_early_and_bad_ones_name_the_option(env, no_shipped_db):
    """--start: each given config (the rest of its knobs the default's) is evaluated right after
    the default (no stored record here to come between), marked as a known seed; a knob the op
    lacks is refused by name."""
    import optuna
    from autossd.tuner.storage import open_storage
    journal = env / "s.journal"
    r = invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", "4", "--db", env / "s.jsonl",
               "--storage", journal, "--sampler", "random", "--seed", "0", "--no-progress",
               "--start", "scan_warps=2", "--start", "scan_warps=8,chunk_size=128")
    assert r.exit_code == 0, r.output
    storage = open_storage(str(journal))
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    seeded = [t.user_attrs["config"] for t in trials[1:3]]
    assert all(t.user_attrs.get("seed") == "known" for t in trials[1:3])
    assert seeded[0]["scan_warps"] == 2
    assert seeded[1]["scan_warps"] == 8 and seeded[1]["chunk_size"] == 128
    r = invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--db", env / "s.jsonl", "--no-progress",
               "--start", "no_such_knob=1")
    assert r.exit_code == 2 and "no_such_knob" in r.output and "--start" in r.output
    r = invoke("tune", "--arch", "gfx942", "--shapes", SHAPE, "--db", env / "s.jsonl", "--no-progress",
               "--fix", "chunk_size=256", "--start", "chunk_size=128")
    assert r.exit_code == 2 and "--fix pins chunk_size=256" in r.output


def test_a_start_the_space_cannot_run_is_said_and_left_out(no_shipped_db, capsys):
    """A start whose knob its mode does not use, or whose value the space leaves out, is named
    in a message and not enqueued as something else (the default again, say)."""
    import optuna
    from autossd.tuner import study as st
    from autossd.tuner.search_space import build_space
    from autossd.problem import Problem
    prob = Problem(1, 512, 4, 32, 32, 1, "fp32", has_z=True)
    space = build_space("sm90", prob, op="ssd_bwd", fixed={"cb": "inline"})
    got = st.starts("sm90", prob, space, [{"cb_dtype": "input"}, {"dx_warps": 8}, {"save_states": 1}])
    said = capsys.readouterr().err.splitlines()
    assert [c.dx_warps for c in got] == [8]
    assert any("cb_dtype unused at cb=inline" in m for m in said)
    assert any("save_states=1" in m and "outside the search space" in m for m in said)
    s = optuna.create_study()
    st.seed(s, "sm90", prob, space, [{"dx_warps": 8}])
    assert [t.user_attrs["seed"] for t in s.trials] == ["default", "known"]


# --- stores that cannot be written ---------------------------------------------------------------
def _can_write(path) -> bool:
    """Whether this process can write `path` (a file: open it for writing; a folder: make a file
    in it), tried, as the one check that also holds for root."""
    import tempfile
    try:
        if path.is_dir():
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            with open(path, "r+b"):
                pass
    except OSError:
        return False
    return True


@pytest.fixture
def read_only():
    """read_only(path): make a file or folder unwritable for this process: chmod 0444 / 0555,
    and where that does not stop the writes (root), the immutable attribute (chattr +i). Skips,
    saying why, only where neither does; every change is undone at the end (pytest must be able
    to delete the folders)."""
    import os
    import subprocess
    done = []

    def make(path):
        mode = path.stat().st_mode
        os.chmod(path, 0o555 if path.is_dir() else 0o444)
        done.append(("chmod", path, mode))
        if _can_write(path) and shutil.which("chattr"):
            if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0:
                done.append(("chattr", path, None))
        if _can_write(path):
            pytest.skip(f"cannot make {path} unwritable here: chmod does not stop this process's writes "
                        "(running as root) and the file system refuses the immutable attribute")
        return path
    yield make
    for kind, path, mode in reversed(done):
        if kind == "chattr":
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            os.chmod(path, mode)


def _static_record(path):
    from autossd.db import add_records, make_record
    from autossd.ops.ssd.fwd_knobs import default_config
    p = parse_shape(SHAPE, "fp16", op="ssd_fwd")
    add_records(str(path), [make_record(p, default_config("gfx942", p), "gfx942", provenance="static",
                                        predicted_ms=0.2)])


def _tune_into(db, env, *extra):
    return CliRunner().invoke(main, ["tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", "2",
                                     "--storage", str(env / "j.journal"), "--no-progress", "--compile-workers",
                                     "0", *extra] + (["--db", str(db)] if db else []))


def _refused_before_the_search(r, where, path):
    out = r.output
    assert r.exit_code == 2, out
    assert where in out and str(path) in out and "cannot write records there" in out, out
    assert "STATIC tuning" not in out and "Traceback" not in out, out   # nothing searched
    assert [ln for ln in out.splitlines() if ln.startswith("Error:")] == [out.strip().splitlines()[-1]]


def test_a_store_that_cannot_be_written_is_refused_before_the_search(env, read_only):
    # an existing database file that cannot be written, then one whose folder takes no new file
    # (SQLite writes its journal beside it)
    locked = env / "locked.sqlite"
    _static_record(locked)
    before = locked.read_bytes()
    read_only(locked)
    _refused_before_the_search(_tune_into(locked, env), "'--db'", locked)
    assert locked.read_bytes() == before
    assert len(json.loads(invoke("show", "--db", locked, "--json").output)) == 1   # reading still works

    shut = env / "shut"
    shut.mkdir()
    _static_record(shut / "in.sqlite")
    _static_record(shut / "in2.sqlite")
    (shut / "r.jsonl").write_text(json.dumps({"arch": "gfx942", "op": "ssd_fwd", "problem": {},
                                              "config": {}, "provenance": "static"}) + "\n")
    read_only(shut)
    for db in (shut / "in.sqlite", shut / "new.sqlite", shut / "new.jsonl", env / "shut" / "sub" / "new.jsonl"):
        _refused_before_the_search(_tune_into(db, env), "'--db'", db)
        assert not db.exists() or db.name == "in.sqlite"


def test_a_jsonl_store_that_cannot_be_written_is_refused_before_the_search(env, read_only):
    good = env / "recs.jsonl"
    _static_record(env / "src.sqlite")
    assert invoke("export", "--db", env / "src.sqlite", "--out", good).exit_code == 0
    before = good.read_bytes()
    read_only(good)
    _refused_before_the_search(_tune_into(good, env), "'--db'", good)
    assert good.read_bytes() == before


def test_an_autossd_db_that_cannot_be_written_names_autossd_db(env, read_only, monkeypatch):
    locked = env / "env.sqlite"
    _static_record(locked)
    read_only(locked)
    monkeypatch.setenv("AUTOSSD_DB", str(locked))
    _refused_before_the_search(_tune_into(None, env), "AUTOSSD_DB", locked)


def test_a_one_line_jsonl_file_that_is_no_record_is_refused_not_taken_for_a_torn_write(env):
    """A torn write can only be the start of a record's line (what a kill mid-append leaves);
    a file whose only line is something else is not a record store, and a tune must not append
    to it (every later show or tune would then fail on its first line)."""
    for text in ("hello\n", "hello", "[1, 2\n", '{"x": 1\n'):
        one = env / "one.jsonl"
        one.write_text(text)
        for args in (["show", "--db", str(one)],
                     ["tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", "1", "--db", str(one),
                      "--storage", str(env / "j.journal"), "--no-progress"]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code == 2 and "one.jsonl:1: not an autossd tuning record" in r.output, (text, args, r.output)
            assert "STATIC tuning" not in r.output
        assert one.read_text() == text
    # the start of a record's line, alone: a kill during the first record's write
    one.write_text('{"arch": "gfx9')
    r = invoke("show", "--db", one, "--json")
    assert r.exit_code == 0 and json.loads(r.output) == [], r.output


# --- errors that name their cause ----------------------------------------------------------------
def test_merge_names_a_corrupt_source_or_destination_and_refuses_a_folder(env):
    good, bad = env / "good.sqlite", env / "bad.sqlite"
    _static_record(good)
    bad.write_bytes(b"\x00garbage, no database" * 300)
    r = CliRunner().invoke(main, ["merge", str(bad), str(good), "--into", str(env / "m.sqlite")])
    assert r.exit_code == 1 and str(bad) in r.output and "Traceback" not in r.output, r.output
    assert "--into" not in r.output and not (env / "m.sqlite").exists()
    r = CliRunner().invoke(main, ["merge", str(good), "--into", str(bad)])
    assert r.exit_code == 1 and str(bad) in r.output and "--into" in r.output, r.output
    folder = env / "out"
    folder.mkdir()
    r = CliRunner().invoke(main, ["merge", str(good), "--into", str(folder)])
    assert r.exit_code == 2 and "--into" in r.output and "is a directory" in r.output, r.output
    assert list(folder.iterdir()) == []
    r = CliRunner().invoke(main, ["merge", str(folder), "--into", str(env / "m.sqlite")])
    assert r.exit_code == 2 and "is a directory" in r.output and str(folder) in r.output, r.output


def test_plot_and_tune_refuse_an_unwritable_plot_folder_by_its_option(env, read_only):
    good = env / "good.sqlite"
    _static_record(good)
    (env / "plots").mkdir()
    shut = read_only(env / "plots")
    for out in (shut, shut / "sub"):
        r = CliRunner().invoke(main, ["plot", "--db", str(good), "--storage", str(env / "none.journal"),
                                      "--out-dir", str(out)])
        assert r.exit_code == 2 and "'--out-dir'" in r.output and str(out) in r.output, r.output
        assert "Traceback" not in r.output
    r = _tune_into(env / "t.sqlite", env, "--plot-dir", str(shut))
    assert r.exit_code == 2 and "'--plot-dir'" in r.output and "STATIC tuning" not in r.output, r.output


def test_doctor_shows_the_environment_it_runs_under_and_an_unknown_arch(env, monkeypatch):
    monkeypatch.setenv("AUTOSSD_ARCH", "sm100")
    monkeypatch.setenv("AUTOSSD_DB", str(env / "mine.sqlite"))
    r = invoke("doctor")
    assert r.exit_code == 0, r.output
    lines = {ln.split("  ")[0]: ln for ln in r.output.splitlines()}
    assert "sm100" in lines["AUTOSSD_ARCH"] and str(env / "mine.sqlite") in lines["AUTOSSD_DB"], r.output
    assert "AUTOSSD_ARCH='sm100': unknown architecture" in lines["runtime uses"]
    assert "sm90" in lines["runtime uses"] and "gfx942" in lines["runtime uses"]
    monkeypatch.setenv("AUTOSSD_ARCH", "sm80")
    assert "sm80's records (AUTOSSD_ARCH)" in invoke("doctor").output
    monkeypatch.delenv("AUTOSSD_ARCH")
    monkeypatch.delenv("AUTOSSD_DB")
    out = invoke("doctor").output
    assert "AUTOSSD_ARCH" not in out.replace("AUTOSSD_ARCH picks", "") and "AUTOSSD_DB" not in out


def test_doctor_and_get_kernel_say_alike_whose_records_a_machine_without_a_gpu_uses(env, monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the runtime uses its own arch")
    import autossd
    from autossd.arch import implicit_arch
    said = implicit_arch()[1]
    assert said.startswith("sm90's records (no GPU")
    line = next(ln for ln in invoke("doctor").output.splitlines() if ln.startswith("runtime uses"))
    assert line.split("  ", 1)[1].strip() == said
    autossd.clear_cache()
    k = autossd.get_kernel((1, 64, 2, 16, 16, 1, "fp32"))
    assert k.arch == "sm90" and k.reason.endswith("; " + said), k.reason
    assert said not in autossd.get_kernel((1, 64, 2, 16, 16, 1, "fp32"), "gfx942").reason


# --- small things -----------------------------------------------------------------------------
def test_ctrl_c_exits_130_with_one_line(env, monkeypatch):
    import autossd.cli as cli

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_load_records", interrupted)
    r = CliRunner().invoke(main, ["show"])
    assert r.exit_code == 130 and r.output.strip() == "autossd: interrupted (Ctrl-C)", (r.exit_code, r.output)


def test_an_error_in_the_clean_up_after_ctrl_c_still_exits_130(env, monkeypatch):
    """Ctrl-C half-way through taking Optuna's journal lock makes the lock's clean-up fail with
    FileNotFoundError; the user still stopped the command: 130, one line, no traceback."""
    import autossd.cli as cli

    def interrupted(*a, **kw):
        try:
            raise KeyboardInterrupt
        finally:
            raise FileNotFoundError("c.journal.lock...rename")
    monkeypatch.setattr(cli, "_load_records", interrupted)
    r = CliRunner().invoke(main, ["show"])
    assert r.exit_code == 130 and r.output.strip() == "autossd: interrupted (Ctrl-C)", (r.exit_code, r.output)

    def broken(*a, **kw):   # an error with no Ctrl-C behind it is not taken for one
        raise FileNotFoundError("gone")
    monkeypatch.setattr(cli, "_load_records", broken)
    assert CliRunner().invoke(main, ["show"]).exit_code not in (0, 130)


def test_ctrl_c_during_a_tune_exits_130(env):
    """A real SIGINT, sent once the tune has started searching (its storage line is printed)."""
    import os
    import signal
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "autossd.cli", "tune", "--arch", "gfx942", "--shapes", SHAPE, "--trials", "10000",
           "--db", str(env / "c.sqlite"), "--storage", str(env / "c.journal"), "--no-progress",
           "--compile-workers", "0"]
    # SIGINT as a terminal gives it, whoever started the suite: a shell's background job (nohup
    # ... &) ignores SIGINT, the children inherit that, and Python then installs no handler
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if line.startswith("storage:"):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert err.strip().splitlines()[-1] == "autossd: interrupted (Ctrl-C)", err[-3000:]
    assert "Traceback" not in err


def test_show_prints_configs_whole(env):
    from autossd.db import add_records, make_record
    from autossd.ops.ssd.fwd_knobs import default_config
    p = parse_shape(SHAPE, "fp16", op="ssd_fwd")
    cfg = default_config("sm90", p).replace(chunk_size=64, scan_warps=2, bmm_warps=2, state_block_m=16,
                                            state_block_n=16)
    whole = repr(cfg)
    whole = whole[whole.index("(") + 1:-1]
    assert len(whole) > 100
    add_records(str(env / "s.sqlite"), [make_record(p, cfg, "sm90", provenance="static", predicted_ms=0.2)])
    r = invoke("show", "--db", env / "s.sqlite")
    assert r.exit_code == 0 and whole in r.output, r.output


def test_tune_help_names_the_ops_from_the_registry():
    from autossd.tuner.shapes import shaped_ops
    text = " ".join(invoke("tune", "--help").output.split())
    line = text[text.index("--op TEXT"):][:200]
    assert shaped_ops() and all(op in line for op in shaped_ops()), line


@pytest.mark.parametrize("sampler,package", [("gp", "scipy"), ("cmaes", "cmaes")])
def test_a_sampler_whose_package_is_missing_names_the_tune_extra(env, monkeypatch, sampler, package):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    r = _tune_into(env / "s.sqlite", env, "--sampler", sampler)
    assert r.exit_code == 2 and "--sampler" in r.output and package in r.output, r.output
    assert 'pip install "autossd[tune]"' in r.output and "STATIC tuning" not in r.output
