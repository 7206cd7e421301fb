"""Where studies live. Default: an Optuna JournalStorage file (append-only log; a study killed
with SIGKILL reloads with every finished trial). An RDB URL (postgresql://, mysql://) shares a
study across hosts; SQLite is accepted but is not for parallel workers ("database is locked")."""
from __future__ import annotations

import os
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


def describe(spec: str | None) -> str:
    """The storage in words, without a password."""
    if spec and "://" in spec:
        scheme, rest = spec.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}" if "@" in rest else spec
    return f"journal:{spec.removeprefix('journal:') if spec else default_journal_path()}"


def open_storage(spec: str | None) -> optuna.storages.BaseStorage:
    """`spec`: None (default journal file), a path or "journal:PATH" (journal file), an RDB URL,
    or ":memory:" (in-process only: replays and tests)."""
    if spec == ":memory:":
        return optuna.storages.InMemoryStorage()
    if spec and "://" in spec:
        return optuna.storages.RDBStorage(spec)
    path = Path(spec.removeprefix("journal:")) if spec else default_journal_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    grace = int(os.environ.get("AUTOSSD_JOURNAL_LOCK_GRACE", LOCK_GRACE_S))
    lock = JournalFileSymlinkLock(str(path), grace_period=grace)
    return JournalStorage(JournalFileBackend(str(path), lock_obj=lock))
