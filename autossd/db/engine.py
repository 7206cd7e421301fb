"""The one place where tuning-database engines are made, locked, retried and migrated.

SQLite (the default) is set up for several processes writing one file, the case Optuna's RDB
storage fails at ("database is locked"): WAL journaling, switched on by the first write (readers
never block the writer; a file that is only read keeps its journal mode),
`busy_timeout` (a writer waits for the lock instead of failing), `BEGIN IMMEDIATE` for write
transactions (`write_transaction`: the write lock is taken up front, so a read-then-write
transaction cannot hit SQLITE_BUSY half-way, which busy_timeout does not cover; reads stay
deferred), and `with_retries` on top for the rare
lock error that still escapes. Read-only engines (shipped databases inside the package) open the
file with `mode=ro` and never write, not even the WAL switch.

Migrations are alembic's, shipped in `autossd/db/migrations` and run through its command API
with `script_location` set here; there is no alembic.ini. Alembic is imported only when a
database actually needs upgrading, so the read path stays fast.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine

log = logging.getLogger("autossd.db")

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# The newest revision in migrations/versions (tests/test_db.py checks it against alembic's view);
# kept as a constant so reading a database needs no alembic import.
REVISIONS = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010", "0011", "0012", "0013", "0014", "0015", "0016")
HEAD = REVISIONS[-1]
BUSY_TIMEOUT_MS = 60_000
T = TypeVar("T")


class TuningDBError(RuntimeError):
    """A tuning database cannot be opened or read (corrupt file, foreign schema, ...)."""


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def to_url(db: str | os.PathLike) -> str:
    """An SQLAlchemy URL for a URL or a filesystem path (taken as an SQLite file)."""
    s = os.fspath(db)
    if "://" in s:
        return s
    return f"sqlite:///{Path(s).expanduser().resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file behind an SQLite URL (None for in-memory or other backends)."""
    if not is_sqlite(url):
        return None
    db = sa.engine.make_url(url).database
    return Path(db) if db and db != ":memory:" else None


_engines: dict[tuple[str, bool], Engine] = {}
_engines_lock = threading.Lock()


def get_engine(url: str, readonly: bool = False) -> Engine:
    """A cached engine per (url, readonly) in this process."""
    key = (url, readonly)
    eng = _engines.get(key)
    if eng is None:
        with _engines_lock:
            eng = _engines.get(key)
            if eng is None:
                eng = _make_engine(url, readonly)
                _engines[key] = eng
    return eng


def dispose_engines(url: str | None = None) -> None:
    """Close every cached engine (tests, before a fork, and at exit), or only those of `url`.
    Closing the last connection to an SQLite file in WAL mode folds the -wal file back into it."""
    with _engines_lock:
        for key in [k for k in _engines if url is None or k[0] == url]:
            _engines.pop(key).dispose()


def checkpoint(eng: Engine) -> None:
    """Copy what the -wal file holds into the database file (PASSIVE: waits on nobody), so the
    .sqlite file alone holds the records written so far: a user who copies or ships just that
    file loses nothing. A checkpoint that other connections hold back completes at their close."""
    if is_sqlite(str(eng.url)) and sqlite_path(str(eng.url)) is not None:
        with eng.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")


# the pool's connections would otherwise stay open until the interpreter tears them down,
# too late for SQLite to checkpoint and remove the -wal file
atexit.register(dispose_engines)


def _make_engine(url: str, readonly: bool) -> Engine:
    if not is_sqlite(url):
        return sa.create_engine(url, pool_pre_ping=True)
    path = sqlite_path(url)
    if readonly and path is not None:
        # URI filename: the sqlite3 module opens it read-only; no -wal/-shm files are created
        eng = sa.create_engine(f"sqlite:///file:{path}?mode=ro&uri=true",
                               connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False})
    else:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        eng = sa.create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000,
                                                  "check_same_thread": False})

    @event.listens_for(eng, "connect")
    def _on_connect(dbapi_conn, _record):
        # let SQLAlchemy, not the sqlite3 module, emit BEGIN (see _on_begin)
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        if not readonly and path is not None:
            cur.execute("PRAGMA synchronous=NORMAL")   # (per connection; WAL is set by writers)
        cur.close()

    @event.listens_for(eng, "begin")
    def _on_begin(conn):
        # writers (write_transaction) take the write lock up front; readers stay deferred so
        # they never wait on, or block, a writer under WAL
        write = conn.get_execution_options().get("autossd_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write and not readonly else "BEGIN")

    return eng


@contextlib.contextmanager
def write_transaction(eng: Engine) -> Iterator[sa.Connection]:
    """A write transaction: BEGIN IMMEDIATE on SQLite, committed on success. The first write
    through an engine switches its SQLite file to WAL (persistent in the file): writers then
    never block readers. Only writes do: reading a database (`autossd show --db`, a lookup)
    leaves a file in rollback-journal mode as it was."""
    with eng.connect() as conn:
        _use_wal(eng, conn)
        conn = conn.execution_options(autossd_write=True)
        with conn.begin():
            yield conn


def _use_wal(eng: Engine, conn: sa.Connection) -> None:
    if getattr(eng, "_autossd_wal", False) or not is_sqlite(str(eng.url)) or sqlite_path(str(eng.url)) is None:
        return
    # on the DBAPI connection, in autocommit: the journal mode cannot change inside a transaction
    dbapi = conn.connection.dbapi_connection
    try:
        if dbapi.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            dbapi.execute("PRAGMA journal_mode=WAL")   # needs the file to itself for a moment
    except sqlite3.OperationalError as e:   # as SQLAlchemy raises it, so with_retries sees a lock
        raise sa.exc.OperationalError("PRAGMA journal_mode=WAL", None, e) from e
    eng._autossd_wal = True   # once per engine (the mode stays in the file)


def is_locked_error(exc: BaseException) -> bool:
    msg = str(getattr(exc, "orig", exc)).lower()
    return "database is locked" in msg or "database is busy" in msg or "database table is locked" in msg


def with_retries(fn: Callable[[], T], attempts: int = 8) -> T:
    """Run fn (one whole transaction); retry it when SQLite reports a lock, with jittered
    exponential backoff. Other errors propagate at once."""
    for i in range(attempts):
        try:
            return fn()
        except sa.exc.OperationalError as e:
            if not is_locked_error(e) or i == attempts - 1:
                raise
            delay = min(2.0, 0.05 * 2 ** i) * (0.5 + random.random())
            log.debug("tuning db locked, retry %d in %.2fs", i + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def current_revision(conn: sa.Connection) -> str | None:
    """The alembic revision stamped in the database; None when there is none (new/foreign DB)."""
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()


def _revision(eng: Engine) -> str | None:
    # retried: opening a connection can find a new file locked while other processes create it
    # at the same moment (CI saw it once with 4 writers)
    def read() -> str | None:
        with eng.connect() as conn:
            return current_revision(conn)
    return with_retries(read)


def alembic_config():
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def migrate(url: str, revision: str = "head") -> str:
    """Create or upgrade the database at `url` to `revision` (default: the newest schema).
    Safe with concurrent callers: the upgrade runs inside one BEGIN IMMEDIATE transaction, so a
    second process waits, then finds the schema current. Returns the revision now stamped."""
    eng = get_engine(url)
    target = HEAD if revision == "head" else revision
    rev = _revision(eng)
    if rev == target:
        return rev

    def _upgrade() -> str:
        from alembic import command
        cfg = alembic_config()
        with write_transaction(eng) as conn:  # BEGIN IMMEDIATE: migrators serialize here
            cfg.attributes["connection"] = conn
            if current_revision(conn) != target:
                command.upgrade(cfg, revision)
            return current_revision(conn)

    try:
        return with_retries(_upgrade)
    except sa.exc.DatabaseError as e:
        raise TuningDBError(f"tuning db {url}: cannot migrate ({e.orig if hasattr(e, 'orig') else e})") from None


def upgrade_if_older(url: str) -> str | None:
    """Migrate an existing database whose schema is an older one of ours (a user database from an
    earlier autossd) to HEAD; leave a newer one alone with a warning (its known columns still
    read). Returns the schema revision found. Every reader of a user database goes through here."""
    rev = _revision(get_engine(url))
    if rev in REVISIONS and rev != HEAD:
        log.info("tuning db %s: schema %s, migrating to %s", url, rev, HEAD)
        migrate(url)
    elif rev is not None and rev not in REVISIONS:
        log.warning("tuning db %s: schema %s is newer than this autossd (%s); reading the columns it knows",
                    url, rev, HEAD)
    return rev


def finalize_sqlite(path: Path, vacuum: bool = True) -> None:
    """Make an SQLite file self-contained (rollback journal, no -wal/-shm) and compact, for
    shipping inside the package where it is opened read-only. Closes this process's pooled
    connections to it first."""
    url = to_url(path)
    for ro in (False, True):
        eng = _engines.pop((url, ro), None)
        if eng is not None:
            eng.dispose()
    import sqlite3
    con = sqlite3.connect(str(path), isolation_level=None)
    try:
        con.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        con.execute("PRAGMA journal_mode=DELETE")
        if vacuum:
            con.execute("VACUUM")
    finally:
        con.close()
