"""Export and merge tuning databases (the shipped per-arch files are built with these; the CLI
exposes them).

Both write a new, self-contained SQLite file (rollback journal, vacuumed) atomically: the result
is built under a temporary name beside `dest` and renamed over it, so a reader never sees half a
file and `dest` may also be one of the sources.

Merge conflict rule: records conflict when they share (op, arch, problem). One survives per key,
chosen in the lookup's order without the user/shipped distinction (below); when it is measured,
so does the best measured record of each other (device, launch mode): a pick timed by eager calls
and one timed by CUDA-graph replay answer different questions, and so do two GPUs of one arch
(an H100's and an H200's records both ship; the lookup prefers the caller's device). The order:
    fresh before stale (triton version, and the hash of the kernels the config launches)
    > measured > static > default  > smaller time (time_ms, or predicted_ms for static records)
    > newer created_at  > earlier source
    > config key.
So the best measured time wins among fresh measured records, and a measurement always beats a
model's or a default's choice.
"""
from __future__ import annotations

import os
import sqlite3
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from .engine import (HEAD, TuningDBError, current_revision, dispose_engines, finalize_sqlite, get_engine,
                     migrate, reader_uri, shown, sqlite_path, to_url)
from .records import PROVENANCE_RANK, _freshness, record_time
from .records import Record, add_records, read_records


@dataclass(frozen=True)
class MergeResult:
    kept: int        # records written
    dropped: int     # records that lost a conflict
    conflicts: int   # keys that had more than one record


def read_source(src: str | os.PathLike, arch: str | None, op: str | None, strict: bool) -> list[Record]:
    """A source's records, leaving the source as it was: an SQLite file is opened read-only, and
    one with an older schema is migrated in a temporary copy (an older autossd may still use it,
    or it may sit where this process cannot write)."""
    url = to_url(src)
    path = sqlite_path(url)
    if path is None:   # a server database (or in-memory): read through a normal engine
        with get_engine(url).connect() as conn:
            rev = current_revision(conn)
        if rev is not None and rev != HEAD:
            raise TuningDBError(f"tuning db {shown(url)}: schema {rev}, not {HEAD}; migrate it first (autossd.db.migrate)")
        return read_records(url, arch, op, strict=strict)
    if not path.is_file():
        raise TuningDBError(f"tuning db {path}: no such file")
    with get_engine(url, readonly=True).connect() as conn:
        rev = current_revision(conn)
    if rev is None or rev == HEAD:
        return read_records(url, arch, op, strict=strict, readonly=True)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        s, d = sqlite3.connect(reader_uri(path), uri=True), sqlite3.connect(copy)
        try:
            s.backup(d)
        finally:
            s.close()
            d.close()
        curl = to_url(copy)
        migrate(curl)
        try:
            return read_records(curl, arch, op, strict=strict)
        finally:
            dispose_engines(curl)


_read = read_source   # the name scripts/build_shipped_db.py imports


def _read_named(src: str | os.PathLike, arch: str | None, op: str | None, strict: bool) -> list[Record]:
    """read_source, its errors naming the source: of several files merged, SQLite's "file is not
    a database" alone does not say which one."""
    url = to_url(src)
    name = str(sqlite_path(url) or shown(url))
    try:
        return read_source(src, arch, op, strict)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy, SQLite, RecordError: all of this one file
        why = str(getattr(e, "orig", None) or e).splitlines()[0]
        if name in why or str(src) in why:
            raise
        raise TuningDBError(f"tuning db {name}: {why}") from e


def _write(dest: str | os.PathLike, records: list[Record], overwrite: bool) -> int:
    dest = Path(dest)
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest}: exists; pass overwrite=True to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        p.unlink(missing_ok=True)
    try:
        add_records(str(tmp), [replace(r, id=None) for r in records])
        if not records:
            migrate(to_url(tmp))
        finalize_sqlite(tmp)
        if dest.exists():
            # fold dest's WAL back in and drop it (and our pooled connections): a -wal file
            # left beside the new file would be replayed into it
            finalize_sqlite(dest, vacuum=False)
        os.replace(tmp, dest)
    finally:
        for p in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            p.unlink(missing_ok=True)
    return len(records)


def export_db(src: str | os.PathLike, dest: str | os.PathLike, arch: str | None = None,
              op: str | None = None, overwrite: bool = False, strict: bool = True) -> int:
    """Copy the (validated) records of `src`, optionally only one arch / op, into a new SQLite
    file `dest`. strict: an invalid record raises RecordError; else it is skipped with a warning.
    Returns the number of records written."""
    return _write(dest, read_source(src, arch, op, strict), overwrite)


def merge_rank(rec: Record, source_index: int, triton_v: str, th: str) -> tuple:
    stale = bool(rec.stale_reasons(triton_v, th))
    # created_at is ISO-8601 UTC from make_record: negate by sorting on the inverted string
    newest_first = "".join(chr(0x10FFFF - ord(c)) for c in rec.created_at)
    return (stale, PROVENANCE_RANK[rec.provenance],
            record_time(rec), newest_first, source_index, rec.config.key())


def merge_records(sources: list[list[Record]]) -> tuple[list[Record], MergeResult]:
    """Apply the conflict rule to lists of records (one list per source, in priority order)."""
    triton_v, th = _freshness()
    groups: dict[tuple, list[tuple[tuple, Record]]] = {}
    for i, recs in enumerate(sources):
        for rec in recs:
            groups.setdefault((rec.op, rec.arch, rec.problem), []).append(
                (merge_rank(rec, i, triton_v, th), rec))
    kept = []
    for cands in groups.values():
        cands.sort(key=lambda c: c[0])
        winner = cands[0][1]
        kept.append(winner)
        if winner.provenance == "measured":   # and the best measurement of each other device and mode
            seen = {(winner.device, winner.launch_mode)}
            for _, rec in cands[1:]:
                if rec.provenance == "measured" and (rec.device, rec.launch_mode) not in seen:
                    kept.append(rec)
                    seen.add((rec.device, rec.launch_mode))
    counts = {g: len(c) for g, c in groups.items()}
    total = sum(counts.values())
    return kept, MergeResult(len(kept), total - len(kept), sum(c > 1 for c in counts.values()))


def merge_dbs(sources: list[str | os.PathLike], dest: str | os.PathLike, arch: str | None = None,
              op: str | None = None, overwrite: bool = False, strict: bool = True) -> MergeResult:
    """Merge databases into a new SQLite file `dest`, one record per (op, arch, problem) (and
    launch mode, where measured) by the
    conflict rule in the module docstring."""
    kept, result = merge_records([_read_named(s, arch, op, strict) for s in sources])
    _write(dest, kept, overwrite)
    return result
