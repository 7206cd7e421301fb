"""Where studies live. Default: an Optuna JournalStorage file (append-only log; a study killed
with SIGKILL reloads with every finished trial). An RDB URL (postgresql://, mysql://) shares a
study across hosts; SQLite is accepted but is not for parallel workers ("database is locked")."""
from __future__ import annotations

import json
import logging
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
    return JournalStorage(_Backend(str(path), lock_obj=lock))


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
