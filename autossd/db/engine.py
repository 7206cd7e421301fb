"""The one place where tuning-database engines are made, locked, retried and migrated.

SQLite (the default) is set up for several processes writing one file, the case Optuna's RDB
storage fails at ("database is locked"): WAL journaling while writes go on (readers never block
the writer), `busy_timeout` (a writer waits for the lock instead of failing), `BEGIN IMMEDIATE`
for write transactions (`write_transaction`: the write lock is taken up front, so a
read-then-write transaction cannot hit SQLITE_BUSY half-way, which busy_timeout does not cover;
reads stay deferred), and `with_retries` on top for the rare lock error that still escapes.

A writer that is done (`add_records`, a migration, an export or merge, and every engine at
dispose and at exit) puts the file back in rollback-journal mode (`leave_wal`; the last of
several concurrent writers manages it, the others find the file in use and leave it): a file in
WAL mode can be read only where SQLite may create its -wal and -shm files beside it, so a tuned
database copied to, or mounted in, a read-only place would otherwise be unreadable.

Readers open SQLite files read-only (`mode=ro`, `reader_uri`) with no pooled connection kept, and
never write, not even the journal switch: reading needs no write access to the file or its
folder. The shipped databases are opened `immutable=1` (never written: no locking at all). A file
left in WAL mode in a folder this process cannot write is read whole from the file when no -wal
file is beside it (no one can be writing there), and otherwise refused with `ReadOnlyWALError`
saying what to do.

A server database (PostgreSQL through psycopg, for a fleet of tuning workers on several hosts)
needs none of that: its engine pools connections (pre-pinged), concurrent migrators serialize on
an advisory lock, and writers rely on the upsert of `records.add_records`; its deadlock and
serialization failures are retried like SQLite's lock errors.

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
import urllib.parse
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


class ReadOnlyWALError(TuningDBError):
    """An SQLite file in WAL mode, with a -wal file beside it, in a folder this process cannot
    write: SQLite cannot read it there. Not a damaged database: the lookup does not skip it."""


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def to_url(db: str | os.PathLike) -> str:
    """An SQLAlchemy URL for a URL or a filesystem path (taken as an SQLite file). A PostgreSQL
    URL naming no driver gets psycopg (v3) when psycopg2, SQLAlchemy's default, is absent."""
    s = os.fspath(db)
    if "://" in s:
        return _pg_driver(s)
    return f"sqlite:///{Path(s).expanduser().resolve()}"


def _pg_driver(url: str) -> str:
    scheme, rest = url.split("://", 1)
    if scheme not in ("postgresql", "postgres"):
        return url
    import importlib.util
    if importlib.util.find_spec("psycopg2") is None and importlib.util.find_spec("psycopg") is not None:
        return f"postgresql+psycopg://{rest}"
    return f"postgresql://{rest}"


def is_server(url: str) -> bool:
    """Whether `url` names a database server (PostgreSQL, MySQL, ...): a store that workers on
    several hosts can share, unlike an SQLite file or a JSON-lines file."""
    return "://" in url and not is_sqlite(url)


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql", "postgres:"))


def shown(url: str) -> str:
    """A URL as messages print it: without its password."""
    if not is_server(url):
        return url
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return url


def sqlite_path(url: str) -> Path | None:
    """The file behind an SQLite URL (None for in-memory or other backends)."""
    if not is_sqlite(url):
        return None
    db = sa.engine.make_url(url).database
    return Path(db) if db and db != ":memory:" else None


_engines: dict[tuple[str, bool, bool], Engine] = {}
_engines_lock = threading.Lock()


def get_engine(url: str, readonly: bool = False, immutable: bool = False) -> Engine:
    """A cached engine per (url, readonly, immutable) in this process. readonly: an SQLite file
    is opened read-only (`reader_uri`); immutable (with readonly): a file nothing ever writes,
    such as a shipped database, read with no locking."""
    key = (url, readonly, readonly and immutable)
    eng = _engines.get(key)
    if eng is None:
        with _engines_lock:
            eng = _engines.get(key)
            if eng is None:
                eng = _make_engine(url, readonly, readonly and immutable)
                _engines[key] = eng
    return eng


def dispose_engines(url: str | None = None) -> None:
    """Close every cached engine (tests, before a fork, and at exit), or only those of `url`,
    and put each SQLite file this process wrote back in rollback-journal mode (`leave_wal`)."""
    with _engines_lock:
        keys = [k for k in _engines if url is None or k[0] == url]
        engines = [(k, _engines.pop(k)) for k in keys]
    for (u, readonly, _), eng in engines:
        eng.dispose()
        if not readonly:
            leave_wal(u)


def leave_wal(url: str) -> bool:
    """Put an SQLite file back in rollback-journal mode, folding its -wal file in, when no other
    connection has it open (the switch needs the file to itself: a concurrent writer keeps WAL
    on, and switches back itself when done). Call after closing this process's connections to it
    (`dispose_engines` does both). Returns whether the file is now in rollback-journal mode."""
    path = sqlite_path(url)
    if path is None or not path.is_file():
        return True
    try:
        con = sqlite3.connect(str(path), timeout=0.2, isolation_level=None)
        try:
            mode = con.execute("PRAGMA journal_mode").fetchone()[0]
            if mode == "wal":
                mode = con.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
            return mode != "wal"
        finally:
            con.close()
    except sqlite3.Error as e:   # in use (or not writable here): left as it is
        log.debug("tuning db %s: stays in WAL mode for now (%s)", path, e)
        return False


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


def _dir_writable(folder: Path) -> bool:
    """Whether this process may create files in `folder` (the -wal and -shm of a WAL file)."""
    return os.access(folder, os.W_OK | os.X_OK)


def is_wal_file(path: Path) -> bool:
    """Whether an SQLite file's header says WAL mode (bytes 18-19: 2 for WAL, 1 for rollback)."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return False
    return len(head) == 20 and head[:16] == b"SQLite format 3\x00" and head[18] == 2


def read_only_wal_error(path: Path) -> ReadOnlyWALError:
    return ReadOnlyWALError(
        f"tuning db {path}: cannot be read here: it is in WAL mode with a {path.name}-wal file beside "
        f"it (a writer did not finish with it), and SQLite needs to create {path.name}-shm in "
        f"{path.parent}, which this process cannot write. Where it is writable, run `autossd export "
        f"--db {path} --out COPY.sqlite` (or any autossd write to it), which leaves a database in "
        f"rollback-journal mode that reads anywhere; or copy {path.name} with {path.name}-wal to a "
        f"writable folder and point AUTOSSD_DB (or --db) at the copy.")


def reader_uri(path: Path, immutable: bool = False) -> str:
    """The URI a reader opens an SQLite file with: read-only (`mode=ro`), which needs no write
    access to the file; or `immutable=1` for a file nothing writes. A file in rollback-journal
    mode (as every writer leaves it) is read with no file created beside it. A WAL file in a
    folder this process cannot write: with no -wal file beside it the file alone is the whole
    database and no writer can start there, so it is read as immutable; with one, SQLite could
    read it only by creating -shm there: ReadOnlyWALError says what to do."""
    q = urllib.parse.quote(str(path))
    if immutable:
        return f"file:{q}?immutable=1"
    if is_wal_file(path) and not _dir_writable(path.parent):
        wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
        if not wal.exists() or wal.stat().st_size == 0:
            return f"file:{q}?mode=ro&immutable=1"
        if not shm.exists():
            raise read_only_wal_error(path)
    return f"file:{q}?mode=ro"


def _make_engine(url: str, readonly: bool, immutable: bool = False) -> Engine:
    if not is_sqlite(url):
        return sa.create_engine(url, pool_pre_ping=True)
    path = sqlite_path(url)
    if readonly and path is not None:
        # a connection per use, none kept open (so none holds a file a writer wants to switch
        # back to rollback mode); the URI is chosen at each connect, from the file's state then
        def connect():
            return sqlite3.connect(reader_uri(path, immutable), uri=True,
                                   timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False)
        eng = sa.create_engine("sqlite://", creator=connect, poolclass=sa.pool.NullPool)
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
    """A write transaction: BEGIN IMMEDIATE on SQLite, committed on success. A write switches
    its SQLite file to WAL (persistent in the file) while writes go on: writers then never block
    readers; `leave_wal` switches it back when the writer is done. Only writes do: reading a
    database (`autossd show --db`, a lookup) leaves a file in rollback-journal mode as it was."""
    with eng.connect() as conn:
        _use_wal(eng, conn)
        conn = conn.execution_options(autossd_write=True)
        with conn.begin():
            yield conn


def _use_wal(eng: Engine, conn: sa.Connection) -> None:
    # asked at every write transaction, not once per engine: a writer done with the file (this
    # process's or another's) may have switched it back since
    if not is_sqlite(str(eng.url)) or sqlite_path(str(eng.url)) is None:
        return
    # on the DBAPI connection, in autocommit: the journal mode cannot change inside a transaction
    dbapi = conn.connection.dbapi_connection
    try:
        if dbapi.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            dbapi.execute("PRAGMA journal_mode=WAL")   # needs the file to itself for a moment
    except sqlite3.OperationalError as e:   # as SQLAlchemy raises it, so with_retries sees a lock
        raise sa.exc.OperationalError("PRAGMA journal_mode=WAL", None, e) from e


def is_locked_error(exc: BaseException) -> bool:
    """A transient conflict with another writer, worth running the transaction again: SQLite's
    lock errors, and PostgreSQL's deadlock and serialization failures (the server rolls one of
    the transactions back)."""
    msg = str(getattr(exc, "orig", exc)).lower()
    return any(m in msg for m in ("database is locked", "database is busy", "database table is locked",
                                  "deadlock detected", "could not serialize access"))


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


# The PostgreSQL advisory lock that migrators of one database take (any constant of our own:
# advisory locks are named by a number, per database)
MIGRATION_LOCK = 0x6175746F737364   # "autossd"


def migrate(url: str, revision: str = "head") -> str:
    """Create or upgrade the database at `url` to `revision` (default: the newest schema).
    Safe with concurrent callers: the upgrade runs inside one transaction that takes the write
    lock first (SQLite: BEGIN IMMEDIATE; PostgreSQL: a transaction-scoped advisory lock, since
    its DDL takes no lock that would keep two processes from creating the same table at once),
    so a second process waits, then finds the schema current. Returns the revision now stamped."""
    eng = get_engine(url)
    target = HEAD if revision == "head" else revision
    rev = _revision(eng)
    if rev == target:
        return rev

    def _upgrade() -> str:
        from alembic import command
        cfg = alembic_config()
        with write_transaction(eng) as conn:  # BEGIN IMMEDIATE: migrators serialize here
            if conn.dialect.name == "postgresql":   # held until this transaction ends
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
            cfg.attributes["connection"] = conn
            if current_revision(conn) != target:
                command.upgrade(cfg, revision)
            return current_revision(conn)

    try:
        done = with_retries(_upgrade)
    except sa.exc.DatabaseError as e:
        raise TuningDBError(f"tuning db {shown(url)}: cannot migrate ({e.orig if hasattr(e, 'orig') else e})") from None
    dispose_engines(url)   # done writing the schema: back to rollback-journal mode where possible
    return done


def writable(url: str) -> bool:
    """Whether this process may write an SQLite file and create files beside it (other backends:
    assumed so)."""
    path = sqlite_path(url)
    if path is None:
        return True
    return (not path.exists() or os.access(path, os.W_OK)) and _dir_writable(path.parent)


def upgrade_if_older(url: str) -> str | None:
    """Migrate an existing database whose schema is an older one of ours (a user database from an
    earlier autossd) to HEAD; leave a newer one alone with a warning (its known columns still
    read). Returns the schema revision found. Every reader of a user database goes through here.
    The revision is read through a read-only connection: a current database needs no write
    access. An older one that this process cannot write raises TuningDBError saying what to do
    (the lookup reads such a file through an upgraded temporary copy instead)."""
    path = sqlite_path(url)
    rev = _revision(get_engine(url, readonly=path is not None and path.is_file()))
    if rev in REVISIONS and rev != HEAD and not writable(url):
        raise TuningDBError(
            f"tuning db {path}: schema {rev} is older than this autossd's ({HEAD}), and it cannot be "
            f"upgraded in place because this process cannot write {path} or its folder. Copy it to "
            f"a writable place, or run `autossd export --db {path} --out COPY.sqlite` (which reads it "
            f"through an upgraded temporary copy) and use the copy.")
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
    with _engines_lock:
        engines = [_engines.pop(k) for k in [k for k in _engines if k[0] == url]]
    for eng in engines:
        eng.dispose()
    con = sqlite3.connect(str(path), isolation_level=None)
    try:
        con.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        con.execute("PRAGMA journal_mode=DELETE")
        if vacuum:
            con.execute("VACUUM")
    finally:
        con.close()
