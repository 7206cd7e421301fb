"""A fleet of tuning workers sharing one PostgreSQL database, as the studies' Optuna storage and as
the record store: the migrations on PostgreSQL, and several `autossd tune` processes (static mode)
started at once against one empty database, which must end with exactly the studies' budget of
evaluated trials, no trial number twice, and one record per tuned shape that the lookup finds.

The server is a throwaway one started here (initdb, pg_ctl) in a temporary folder, reached over
its Unix socket only. Without PostgreSQL or psycopg the tests are skipped, saying which is missing.
"""
from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install '.[fleet]')")

import optuna  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from autossd.cli import main  # noqa: E402
from autossd.db import HEAD, add_records, migrate, read_records  # noqa: E402
from autossd.db import engine as dbengine  # noqa: E402
from autossd.db.models import KEY_COLUMNS  # noqa: E402
from autossd.tuner import parse_shape  # noqa: E402

SHAPES = ("b=1,l=512,h=4,p=32,n=32,g=1", "b=2,l=256,h=4,p=32,n=32,g=1")
WORKERS = 3
TRIALS = 4   # the budget of each study, which the workers share


# --- the server -------------------------------------------------------------------------------
def _version(bindir: str) -> int:
    try:
        return int(Path(bindir).parent.name)
    except ValueError:
        return 0


def pg_bindir() -> Path | None:
    """Where initdb and pg_ctl are: AUTOSSD_PG_BIN, else `pg_config --bindir`, else the newest
    /usr/lib/postgresql/*/bin (Debian and Ubuntu keep the server off PATH), else PATH."""
    found = [os.environ.get("AUTOSSD_PG_BIN", "")]
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True)
        found.append(out.stdout.strip())
    found += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    if shutil.which("initdb"):
        found.append(os.path.dirname(shutil.which("initdb")))
    for d in filter(None, found):
        if os.access(Path(d) / "initdb", os.X_OK) and os.access(Path(d) / "pg_ctl", os.X_OK):
            return Path(d)
    return None


class PgServer:
    def __init__(self, base: Path, port: int) -> None:
        self.base, self.port = base, port

    def new_database(self) -> str:
        """A fresh, empty database; its SQLAlchemy URL."""
        name = f"t{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host=str(self.base), port=self.port, user="autossd", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://autossd@/{name}?host={self.base}&port={self.port}"


@pytest.fixture(scope="module")
def pg_server():
    bindir = pg_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server found (initdb and pg_ctl; .ci/run installs it): set "
                    "AUTOSSD_PG_BIN to the folder that holds them")
    as_user: list[str] = []
    # a short path: the server's socket file goes in it, and socket paths are limited to ~100 bytes
    base = Path(tempfile.mkdtemp(prefix="autossd-pg-", dir="/tmp" if os.path.isdir("/tmp") else None))
    if os.geteuid() == 0:   # initdb refuses to run as root: the server runs as the postgres user
        try:
            pg = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(base)
            pytest.skip("running as root, and there is no 'postgres' user to run the PostgreSQL server as")
        os.chown(base, pg.pw_uid, pg.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"] if shutil.which("runuser") else \
            ["su", "postgres", "-s", "/bin/sh", "-c", 'exec "$0" "$@"']
    data, log = base / "data", base / "server.log"
    with socket.socket() as s:   # the port only names the socket file: no TCP listener is opened
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def run(*args):
        r = subprocess.run(as_user + [str(a) for a in args], capture_output=True, text=True)
        if r.returncode:
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{args[0]} failed ({r.returncode}): {r.stdout}{r.stderr}{tail}")

    try:
        run(bindir / "initdb", "-D", data, "-U", "autossd", "--auth=trust", "--no-sync", "-E", "UTF8",
            "--locale=C")
        run(bindir / "pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "start",
            "-o", f"-k {base} -p {port} -c listen_addresses='' -c fsync=off -c max_connections=200")
    except Exception:
        subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
        raise
    try:
        yield PgServer(base, port)
    finally:
        dbengine.dispose_engines()
        subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server):
    url = pg_server.new_database()
    yield url
    dbengine.dispose_engines(url)


# --- migrations -------------------------------------------------------------------------------
def test_migrations_run_on_postgresql_from_empty_to_head_and_back(pg_url):
    """Every schema, up from an empty database and down again, on PostgreSQL; the migrated schema
    is the model's; a row stored at schema 14 (a column per knob) survives the JSON schema, and
    the id sequence goes on after the ids the JSON schema copied."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from autossd.db.models import Base
    from test_db import PROB, TUNED, _at_schema, _columns, _downgrade, _old_row, rec

    assert migrate(pg_url) == HEAD
    with dbengine.get_engine(pg_url).connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    _downgrade(pg_url, "base")
    with dbengine.get_engine(pg_url).connect() as conn:
        assert dbengine.current_revision(conn) is None
        assert not sa.inspect(conn).has_table("tuned_records")

    assert migrate(pg_url, "0014") == "0014"
    cols = _columns(pg_url)
    old = [rec(config=_at_schema(TUNED, cols), time_ms=0.42, device="NVIDIA H100 80GB HBM3", notes="run 1"),
           rec(PROB.replace(seqlen=8192, has_z=True), config=_at_schema(TUNED.replace(scan_warps=8), cols),
               provenance="static", predicted_ms=0.7)]
    rows = [_old_row(r, cols) for r in old]
    with dbengine.get_engine(pg_url).begin() as conn:   # as schema 14's writer stored them
        conn.execute(sa.text(f"INSERT INTO tuned_records ({', '.join(f'{chr(34)}{c}{chr(34)}' for c in rows[0])}) "
                             f"VALUES ({', '.join(':' + c for c in rows[0])})"), rows)
    assert migrate(pg_url) == HEAD
    back = read_records(pg_url)
    assert [(b.problem, b.config, b.time_ms, b.predicted_ms) for b in back] == [
        (r.problem, r.config, r.time_ms, r.predicted_ms) for r in old]
    new = rec(PROB.replace(seqlen=4096), time_ms=0.3)
    add_records(pg_url, [new, replace(new, time_ms=0.2)])   # one key: the better figure, once
    add_records(pg_url, [replace(new, time_ms=0.25)])
    got = read_records(pg_url)
    assert len(got) == 3 and got[-1].id > max(b.id for b in back) and got[-1].time_ms == 0.2


def _migrator(url: str, barrier, q) -> None:
    try:
        barrier.wait(60)
        q.put(migrate(url))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which asserts
        q.put(f"{type(e).__name__}: {e}")


def test_processes_migrating_one_empty_database_at_once_all_end_at_the_newest_schema(pg_url):
    """Workers starting together all create the schema: without the migrators' advisory lock the
    second CREATE TABLE fails (a duplicate key in PostgreSQL's catalog)."""
    import multiprocessing as mp
    n = 4
    dbengine.dispose_engines()   # forked children must not inherit an open connection
    ctx = mp.get_context("fork")   # no re-import of torch per process, unlike spawn
    barrier, q = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_migrator, args=(pg_url, barrier, q)) for _ in range(n)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert got == [HEAD] * n
    with dbengine.get_engine(pg_url).connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar_one() == 1


# --- the fleet --------------------------------------------------------------------------------
def _cli(*args):
    from click.testing import CliRunner
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def test_a_fleet_of_static_tunes_shares_the_studies_and_stores_one_record_per_shape(pg_url, tmp_path):
    env = {**os.environ, "AUTOSSD_DATA_DIR": str(tmp_path / "data"), "AUTOSSD_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("AUTOSSD_DB", None)
    env.pop("TRITON_INTERPRET", None)   # static mode cross-compiles: no kernel runs
    cmd = [sys.executable, "-m", "autossd.cli", "tune", "--arch", "gfx942", "--shapes", ";".join(SHAPES),
           "--trials", str(TRIALS), "--compile-workers", "0", "--no-progress", "--db", pg_url]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(WORKERS)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    wall = time.monotonic() - t0
    assert [p.returncode for p in procs] == [0] * WORKERS, [o + e[-3000:] for o, e in outs]
    print(f"{WORKERS} workers, {len(SHAPES)} shapes x {TRIALS} trials: {wall:.1f} s")
    for out, _ in outs:   # one database for both: the studies live in its "optuna" schema
        assert "storage: postgresql+psycopg://" in out and "(schema optuna)" in out

    # every worker reports the same, final study: ok + failed is the shared budget
    tables = []
    for out, _ in outs:
        rows = {ln.split(" fp16")[0]: ln.split()[2:5] for ln in out.splitlines() if ln.startswith("b=")}
        assert sorted(rows) == sorted(SHAPES)
        assert all(int(ok) + int(failed) == TRIALS for ok, failed, _ in rows.values())
        tables.append(rows)
    assert tables[1:] == tables[:1] * (WORKERS - 1)

    from autossd.tuner.storage import open_storage
    storage = open_storage(pg_url)
    summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
    by_problem = {json.dumps(s.user_attrs["problem"], sort_keys=True): s.study_name for s in summaries}
    problems = {s: parse_shape(s, op="ssd_fwd") for s in SHAPES}
    assert sorted(by_problem) == sorted(json.dumps(p.key(), sort_keys=True) for p in problems.values())

    best = {}
    for shape, prob in problems.items():
        study = optuna.load_study(study_name=by_problem[json.dumps(prob.key(), sort_keys=True)], storage=storage)
        trials = study.get_trials(deepcopy=False)
        assert sorted(t.number for t in trials) == list(range(len(trials)))   # none lost, none twice
        states = {s: sum(t.state == s for t in trials) for s in TrialState}
        assert states[TrialState.RUNNING] == 0
        evaluated = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                     and t.user_attrs.get("evaluated")]
        assert len(evaluated) == TRIALS                        # exactly the budget, across workers
        keys = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in evaluated]
        assert len(set(keys)) == len(keys)                     # no candidate evaluated twice
        ok, failed, pruned = tables[0][shape]
        assert (int(ok), int(failed), int(pruned)) == (
            sum(t.state == TrialState.COMPLETE for t in evaluated),
            sum(t.state == TrialState.FAIL for t in evaluated), states[TrialState.PRUNED])
        top = min((t for t in evaluated if t.state == TrialState.COMPLETE), key=lambda t: t.value)
        best[shape] = (top.user_attrs["config"], top.value)
    with dbengine.get_engine(pg_url).connect() as conn:
        n, distinct = conn.execute(sa.text("SELECT count(*), count(DISTINCT (study_id, number)) "
                                           "FROM optuna.trials")).one()
        assert n == distinct

        # the record store: one row per tuned shape (so one per key), the studies' best
        keys = conn.execute(sa.text(f"SELECT {', '.join(KEY_COLUMNS)} FROM tuned_records")).all()
    assert len(keys) == len(SHAPES) == len(set(keys))
    recs = read_records(pg_url)
    assert sorted(json.dumps(r.problem.key(), sort_keys=True) for r in recs) == sorted(
        json.dumps(p.key(), sort_keys=True) for p in problems.values())

    from autossd.runtime import clear_cache, get_kernel
    for shape, prob in problems.items():
        kernel = get_kernel(prob, arch="gfx942", db=pg_url)   # the runtime's lookup, from the server
        assert kernel.provenance == "static"
        assert kernel.config.as_dict() == best[shape][0]
        rec = next(r for r in recs if r.problem == prob)
        assert rec.predicted_ms == pytest.approx(best[shape][1])
    clear_cache()

    # the CLI reads the server database as it reads a file: show, export, merge
    shown = json.loads(_cli("show", "--db", pg_url, "--json"))
    assert len(shown) == len(SHAPES) and {r["provenance"] for r in shown} == {"static"}
    assert "autossd@" in shown[0]["origin"]
    assert f"exported {len(SHAPES)} records" in _cli("export", "--db", pg_url, "--out", tmp_path / "out.sqlite")
    assert f"{len(SHAPES)} records kept" in _cli("merge", pg_url, "--into", tmp_path / "merged.sqlite")
    assert len(read_records(str(tmp_path / "merged.sqlite"))) == len(SHAPES)
