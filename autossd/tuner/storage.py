"""Where studies live. Default: an Optuna JournalStorage file (append-only log; a study killed
with SIGKILL reloads with every finished trial). An RDB URL (postgresql://, mysql://) shares a
study across hosts; SQLite is accepted but is not for parallel workers ("database is locked").

PostgreSQL is the fleet's storage: one database URL serves as the Optuna storage and as the
record store (autossd.db). Optuna's tables live in a schema of their own (`PG_SCHEMA`), because
both stores keep their schema version in an `alembic_version` table. Workers claim trials of a
study one at a time (`study_lock`: an advisory lock on PostgreSQL, a file lock beside a journal),
so a fleet evaluates exactly the study's budget and no candidate twice. The lock must exclude
every worker of the study: a journal serves the processes of one host (an flock on a network
filesystem may bind one node only), and PostgreSQL needs a direct connection (a pooler in
transaction mode drops session advisory locks). A trial found unnamed while it is held is taken
for one whose worker died between its ask and its naming.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

# A journal write holds the file lock for milliseconds; a process SIGKILLed while holding it
# leaves the lock behind, and the next opener waits this long before breaking it (Optuna's
# default is 30 s). AUTOSSD_JOURNAL_LOCK_GRACE overrides it (e.g. slow network filesystems).
LOCK_GRACE_S = 10


def default_journal_path() -> Path:
    env = os.environ.get("AUTOSSD_DATA_DIR")
    if env:
        return Path(env) / "studies.journal"
    import platformdirs
    return Path(platformdirs.user_data_dir("autossd")) / "studies.journal"


# The schema of a PostgreSQL database that holds the studies (unless the URL sets a search_path
# of its own through `options`): optuna-dashboard and friends reach them with
# `?options=-csearch_path%3Doptuna` on the same URL.
PG_SCHEMA = "optuna"
# advisory-lock number under which processes create the study tables of a database one at a time
_SETUP_LOCK = 0x6175746F737375   # any constant of our own


def describe(spec: str | None) -> str:
    """The storage in words, without a password."""
    if spec and "://" in spec:
        scheme, rest = spec.split("://", 1)
        shown = f"{scheme}://***@{rest.rsplit('@', 1)[1]}" if "@" in rest else spec
        if scheme.startswith("postgres") and not _own_search_path(spec):
            shown += f" (schema {PG_SCHEMA})"
        return shown
    return f"journal:{spec.removeprefix('journal:') if spec else default_journal_path()}"


def open_storage(spec: str | None) -> optuna.storages.BaseStorage:
    """`spec`: None (default journal file), a path or "journal:PATH" (journal file), an RDB URL,
    or ":memory:" (in-process only: replays and tests)."""
    if spec == ":memory:":
        return optuna.storages.InMemoryStorage()
    if spec and "://" in spec:
        return _rdb_storage(spec)
    path = Path(spec.removeprefix("journal:")) if spec else default_journal_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    grace = int(os.environ.get("AUTOSSD_JOURNAL_LOCK_GRACE", LOCK_GRACE_S))
    lock = JournalFileSymlinkLock(str(path), grace_period=grace)
    # under the lock that appends take: a tail being written now is not mistaken for a torn one
    lock.acquire()
    try:
        cut = _cut_torn_tail(path)
    finally:
        lock.release()
    if cut:
        logging.getLogger("autossd").warning(
            "autossd: %s ended in a torn line (a process killed while writing it); dropped its %d "
            "bytes, every finished trial is kept", path, cut)
    if _kept is None:
        return JournalStorage(_Backend(str(path), lock_obj=lock))
    # inside kept_journals(): one JournalStorage per file, which reads only what was appended
    # since its last read (by any process). A file replaced by another (a new inode) is replayed.
    path.open("ab").close()   # as the backend does first: the file has its inode from here on
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino)
    with _kept_lock:
        storage = _kept.get(key)
        if storage is None:
            storage = _kept[key] = JournalStorage(_Backend(str(path), lock_obj=lock))
    return storage


# A new JournalStorage replays the whole file, and a tune opens the storage once per shape: over
# a grid of hundreds of shapes the replays grew with the square of the shapes (a 476-shape grid's
# journal reaches ~100 MB, replayed for every shape). Kept only inside kept_journals(), so that
# any other open reads the file as it is now (a file rewritten in place is read afresh).
_kept: dict[tuple, JournalStorage] | None = None
_kept_lock = threading.Lock()


@contextlib.contextmanager
def kept_journals():
    """Within: open_storage returns the same JournalStorage for a journal file each time."""
    global _kept
    outer = _kept
    if outer is None:
        _kept = {}
    try:
        yield
    finally:
        if outer is None:
            _kept = None


_rdb: dict[str, optuna.storages.RDBStorage] = {}
_rdb_lock = threading.Lock()


def _rdb_storage(spec: str) -> optuna.storages.RDBStorage:
    """One RDBStorage per URL in a process: each holds an engine with its pool of connections,
    and every study of a tune opens the storage again."""
    from ..db.engine import is_postgres, to_url
    url = to_url(spec)
    with _rdb_lock:
        storage = _rdb.get(url)
        if storage is None:
            storage = _open_postgres(url) if is_postgres(url) else optuna.storages.RDBStorage(url)
            _rdb[url] = storage
    return storage


def _own_search_path(url: str) -> bool:
    """Whether a PostgreSQL URL picks its schema itself (`options=-csearch_path=...`)."""
    import sqlalchemy as sa
    try:
        opts = sa.engine.make_url(url).query.get("options", "")
    except sa.exc.ArgumentError:
        return False
    return "search_path" in " ".join(opts) if isinstance(opts, tuple) else "search_path" in opts


def _open_postgres(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage in `PG_SCHEMA` of a PostgreSQL database. Optuna creates its tables and
    stamps its version when a storage is first opened, which several processes starting at once
    would race; an advisory lock has them do it one at a time."""
    import sqlalchemy as sa
    kwargs: dict = {"pool_pre_ping": True}
    own = _own_search_path(url)
    if not own:
        opts = sa.engine.make_url(url).query.get("options", "")
        opts = " ".join(opts) if isinstance(opts, tuple) else opts
        kwargs["connect_args"] = {"options": f"{opts} -c search_path={PG_SCHEMA}".strip()}
    setup = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with setup.connect() as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": _SETUP_LOCK})
            conn.commit()
            # created only when missing: CREATE SCHEMA needs a right on the database that a
            # worker's role may lack where the schema exists already
            there = conn.execute(sa.text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": PG_SCHEMA})
            if not own and there.first() is None:
                conn.execute(sa.text(f'CREATE SCHEMA "{PG_SCHEMA}"'))
                conn.commit()
            # no unlock needed: the lock is the session's, and this connection (NullPool) is
            # closed on the way out, whether Optuna opened the storage or raised
            return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    finally:
        setup.dispose()


def _lock_key(study_name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"autossd study {study_name}".encode()).digest()[:8], "big",
                          signed=True)


@contextlib.contextmanager
def study_lock(spec: str | None, study_name: str) -> Iterator[None]:
    """Hold the study's claim lock: the tuner counts the study's trials, asks for its next
    candidates and seeds it under this lock, so concurrent workers (processes of one host, or a
    fleet of hosts on PostgreSQL) neither overrun the shared budget nor enqueue or evaluate one
    candidate twice. PostgreSQL: a session advisory lock (released by the server if the process
    dies); a journal file: an flock on a file beside it; other storages: no lock (SQLite and
    MySQL are not for fleets here). Yields whether a lock is held."""
    if spec == ":memory:":
        yield False
        return
    if spec and "://" in spec:
        from ..db.engine import is_postgres, to_url
        if not is_postgres(to_url(spec)):
            yield False
            return
        yield from _pg_lock(_rdb_storage(spec), _lock_key(study_name))
        return
    try:
        import fcntl
    except ImportError:   # no flock (Windows): one worker per study there
        yield False
        return
    path = Path(spec.removeprefix("journal:")) if spec else default_journal_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.claims", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pg_lock(storage: optuna.storages.RDBStorage, key: int) -> Iterator[None]:
    import sqlalchemy as sa
    conn = storage.engine.connect()
    try:
        conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
        conn.commit()
        try:
            yield True
        finally:
            try:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
            except Exception:   # a connection that cannot unlock must not go back to the pool
                conn.invalidate()   # holding the lock: closing it makes the server drop the lock
                raise
    finally:
        conn.close()


class JournalError(ValueError):
    """A journal file that cannot be read as Optuna's log of studies."""


def _corrupt(path: str | Path, err: Exception) -> str:
    line = 0
    try:
        with open(path, "rb") as f:
            for line, raw in enumerate(f, 1):
                try:
                    json.loads(raw)
                except ValueError:
                    break
    except OSError:
        pass
    at = f" at line {line}" if line else ""
    what = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else str(err)
    return (f"{path}: the Optuna journal of the tuning studies cannot be read{at} "
            f"({what}). Move it aside to start the studies afresh (the tuning "
            f"records are stored elsewhere and stay as they are), or cut the file before that line "
            f"to keep the trials written up to it; --storage picks another journal")


class _Backend(JournalFileBackend):
    """Optuna's file backend, whose read errors name the file and say what to do."""

    def read_logs(self, log_number_from: int):
        try:
            yield from super().read_logs(log_number_from)
        except ValueError as e:   # json.JSONDecodeError, "Invalid log format."
            if isinstance(e, JournalError):
                raise
            raise JournalError(_corrupt(self._file_path, e)) from None


def _cut_torn_tail(path: Path) -> int:
    """Cut off the journal's last line when it is unterminated or no JSON object: what a process
    killed mid-append leaves. Optuna's reader skips such a line, but the next append would be
    glued onto it, making a bad line in the middle, which no reader gets past. Returns the bytes
    cut (0: the tail is whole)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        if not end:
            return 0
        f.seek(end - 1)
        terminated = f.read(1) == b"\n"
        start, pos = 0, end - 1 if terminated else end
        while pos > 0:   # back to the newline before the last line
            lo = max(0, pos - (1 << 16))
            f.seek(lo)
            i = f.read(pos - lo).rfind(b"\n")
            if i >= 0:
                start = lo + i + 1
                break
            pos = lo
        if terminated:
            f.seek(start)
            try:
                if isinstance(json.loads(f.read(end - start)), dict):
                    return 0
            except ValueError:   # JSONDecodeError, UnicodeDecodeError
                pass
        f.truncate(start)
        f.flush()
        os.fsync(f.fileno())
        return end - start
