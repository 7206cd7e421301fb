"""Tuning records and the storage seam the tuner writes them through.

The tuner only needs `Sink.save(record: dict)`. `DbSink` adapts it to the tuning database
(`autossd.db`: make_record + add_records, the store `autossd.runtime.get_kernel` reads);
`JsonlSink` (append-only JSON lines, one record a line, fsynced) is the plain-file store for
`--db x.jsonl` and the fallback when the database layer is not installed.

A record: arch, device, op, problem (Problem fields), config (every knob), time_ms, provenance
("measured" | "static"), launch_mode ("eager" | "graph": what time_ms was measured under; "any"
for a prediction), triton_version, template_hash, date (UTC ISO), host, plus
informational fields (floor_ms, study, trial, gate errors, compile report summary).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ..ops.registry import LEGACY_OP
from ..problem import Problem
from ..knobs import BaseConfig as Config

PROVENANCES = ("measured", "static")


class Sink(Protocol):
    def save(self, record: dict) -> None: ...


def triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:  # pragma: no cover
        return "none"


def mode_of(rec: dict) -> str:
    """A record's launch mode; a record from before launch modes was timed by eager calls when
    measured, and is a prediction of GPU time ("any") otherwise (as migration 0006 labels them)."""
    return rec.get("launch_mode") or ("eager" if rec.get("provenance") == "measured" else "any")


def make_result(arch: str, device: str, problem: Problem, config: Config, time_ms: float,
                provenance: str, launch_mode: str | None = None, **extra: Any) -> dict:
    """A tune's result as plain data, for any sink (a JSON-lines file, or a database through
    `autossd.db.records.make_record`, which builds the validated Record)."""
    from ..arch import get_arch
    from ..render import kernel_hash
    if provenance not in PROVENANCES:
        raise ValueError(f"provenance: expected one of {PROVENANCES}, got {provenance!r}")
    rec = {"arch": arch, "device": device, "op": config.op, "problem": problem.key(),
           "config": config.as_dict(), "time_ms": float(time_ms), "provenance": provenance,
           "launch_mode": mode_of({"launch_mode": launch_mode, "provenance": provenance}),
           "triton_version": triton_version(),
           # the hash of the kernels this config launches (see db.records.Record.stale_reasons)
           "template_hash": kernel_hash(config, get_arch(arch).backend),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname()}
    rec.update(extra)
    return rec


def record_key(rec: dict) -> str:
    """What a record answers, as the tuning database keys it: (arch, op, problem, launch mode;
    a record from before launch modes was timed by eager calls)."""
    return json.dumps([rec["arch"], rec["op"], rec["problem"], mode_of(rec)], sort_keys=True)


def better(a: dict, b: dict) -> dict:
    """The record to keep of two for one key: measured beats static, then the faster one."""
    rank = lambda r: (r["provenance"] != "measured", r["time_ms"])  # noqa: E731
    return a if rank(a) <= rank(b) else b


class RecordStoreError(ValueError):
    """A file given as a record store that holds something else."""


_RECORD_KEYS = frozenset({"arch", "op", "problem", "config", "provenance"})
_LINE_START = '{"arch": '   # how each line `JsonlSink.save` writes begins (json.dumps, sort_keys)


def unwritable(path: str | os.PathLike, *, dir_too: bool = False) -> str | None:
    """Why a store file at `path` could not be written, or None when it can: an existing file
    must open for writing (`dir_too`: its directory must also take new files, as SQLite's
    journal and WAL files need); a new one, the nearest existing folder above it must take a
    file. Tried, not asked: os.access says yes to root for a 0444 file, which root can indeed
    write, but cannot know of an immutable file, and the folder probe is a nameless temporary
    file, so nothing is left behind."""
    path = Path(path)
    try:
        if path.is_file():
            with open(path, "r+b"):
                pass
            if not dir_too:
                return None
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        return f"{e.strerror or e}{where}"
    return None


class JsonlSink:
    """Append-only JSON-lines store: survives kills (each line is one whole write + fsync)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def save(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    # a torn last line (a kill mid-write): cut it off, or this record would be
                    # glued to it and the next one would make the store unreadable
                    f.seek(0)
                    data = f.read()
                    f.truncate(data.rfind(b"\n") + 1)
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> list[dict]:
        """The records. Only a torn last line (a kill mid-write) is skipped; any other line that
        is no record means the file is not a record store, and reading it (or merging into it,
        which rewrites it) would lose or invent data: RecordStoreError, naming the line."""
        if not self.path.exists():
            return []
        lines = [(i, ln.strip()) for i, ln in enumerate(self.path.read_text().splitlines(), 1) if ln.strip()]
        out = []
        for k, (i, line) in enumerate(lines):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                # a torn last line after a kill: what `save` had begun to write, so it starts as
                # every record's line does (its keys sorted: "arch" first). Any other line that
                # is no JSON, one alone above all, means some other file, which a tune must not
                # append to
                if k == len(lines) - 1 and (line.startswith(_LINE_START) or _LINE_START.startswith(line)):
                    continue
                rec = None
            if not isinstance(rec, dict) or not _RECORD_KEYS <= rec.keys():
                raise RecordStoreError(f"{self.path}:{i}: not an autossd tuning record "
                                       f"(expected a JSON object with {sorted(_RECORD_KEYS)})")
            out.append(rec)
        return out

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


def best_records(records: Iterable[dict]) -> list[dict]:
    """The records worth keeping, by the tuning database's merge rule (autossd.db.exchange): per
    (arch, op, problem) the best record (measured beats static, then the fastest); when it is
    measured, also the best measured record of each other (device, launch mode)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(json.dumps([r["arch"], r["op"], r["problem"]], sort_keys=True), []).append(r)
    keep = []
    for recs in groups.values():
        winner = recs[0]
        for r in recs[1:]:
            winner = better(winner, r)
        keep.append(winner)
        if winner["provenance"] == "measured":
            kinds = {(r.get("device") or "", mode_of(r)) for r in recs if r["provenance"] == "measured"}
            for kind in sorted(kinds - {(winner.get("device") or "", mode_of(winner))}):
                best = None
                for r in recs:
                    if r["provenance"] == "measured" and (r.get("device") or "", mode_of(r)) == kind:
                        best = r if best is None else better(best, r)
                keep.append(best)
    return keep


def default_records_path() -> Path:
    env = os.environ.get("AUTOSSD_DATA_DIR")
    if env:
        return Path(env) / "records.jsonl"
    import platformdirs
    return Path(platformdirs.user_data_dir("autossd")) / "records.jsonl"


def db_layer():
    """The tuning-database package (autossd.db) when it is importable, else None."""
    try:
        from .. import db
    except ImportError:
        return None
    return db


_UNSAFE = re.compile(r"[^A-Za-z0-9 ._:/+@%,=-]")


class DbSink:
    """Writes records into the tuning database (autossd.db), the store the runtime reads.
    Static records keep their prediction in predicted_ms and leave time_ms empty."""

    def __init__(self, db: str | None) -> None:
        layer = db_layer()
        if layer is None:
            raise RuntimeError("the tuning database layer (autossd.db) is not available")
        self.layer = layer
        self.url = layer.user_db_url(db)

    def prepare(self) -> "DbSink":
        """Create or upgrade the database now, before a tune spends its time: a path that is no
        database (or an unreachable URL), or a database file that cannot be written, fails here,
        with the reason, not after the last trial."""
        if self.url.startswith("sqlite:///"):
            _refuse_unwritable(self.url.removeprefix("sqlite:///"), dir_too=True)
        try:
            self.layer.migrate(self.url)
        except Exception as e:  # SQLAlchemy, alembic, OS: all mean "cannot store records here"
            why = str(getattr(e, "orig", None) or e).splitlines()[0]
            raise RuntimeError(f"{self.layer.engine.shown(self.url)}: cannot store tuning records there "
                               f"({why})") from None
        return self

    def save(self, record: dict) -> None:
        self.layer.add_records(self.url, [self.to_db(record)])

    def to_db(self, record: dict, copied: bool = False):
        """The tuning-database Record of a tuner record. copied: the record comes from another
        store (a .jsonl file being merged), so what it says of the code, date and host that made
        it is kept (validated like any row): a stale record must not turn fresh by a merge."""
        static = record["provenance"] == "static"
        notes = f"study {record.get('study', '')} sampler {record.get('sampler', '')} " \
                f"trials {record.get('trials', '')}"
        made = None
        if copied:
            made = {k: str(record[src]) for k, src in (("triton_version", "triton_version"),
                                                        ("template_hash", "template_hash"),
                                                        ("created_at", "date"), ("host", "host"))
                    if record.get(src)}
        from ..db.records import device_text
        from ..ops.registry import get_op
        op = get_op(record.get("op", LEGACY_OP))
        return self.layer.make_record(
            op.problem_type(**record["problem"]), op.config(record["config"]), record["arch"],
            op=op.name, provenance=record["provenance"], time_ms=None if static else record["time_ms"],
            predicted_ms=record["time_ms"] if static else None,
            device=device_text(record.get("device") or ""),
            launch_mode=mode_of(record),
            notes=_UNSAFE.sub("-", notes)[:256], made=made)

    def load(self, arch: str | None = None) -> list[dict]:
        if not _exists(self.url):
            return []
        self.layer.upgrade_if_older(self.url)  # a store from an earlier autossd: migrate, then read
        recs = self.layer.read_records(self.url, arch, strict=False)
        return [db_record_dict(r) for r in recs]

    def __repr__(self) -> str:
        return f"DbSink({self.layer.engine.shown(self.url)!r})"


def _refuse_unwritable(path: str, dir_too: bool) -> None:
    why = unwritable(path, dir_too=dir_too)
    if why:
        raise RuntimeError(f"{path}: cannot write records there ({why}); nothing would be stored")


def _exists(url: str) -> bool:
    if url.startswith("sqlite:///"):
        return Path(url.removeprefix("sqlite:///")).exists()
    return True


def db_record_dict(r) -> dict:
    """An autossd.db Record in the tuner's record shape (time_ms = the prediction when static)."""
    t = r.time_ms if r.time_ms is not None else r.predicted_ms
    return {"arch": r.arch, "device": r.device, "op": r.op, "problem": r.problem.key(),
            "config": r.config.as_dict(), "time_ms": t, "provenance": r.provenance,
            "launch_mode": r.launch_mode,
            "triton_version": r.triton_version, "template_hash": r.template_hash,
            "date": r.created_at, "host": r.host, "origin": r.origin}


def open_sink(db: str | None):
    """`db`: a .jsonl path (JSON-lines store), a database path/URL, or None: the user tuning
    database that the runtime reads (`autossd.db.user_db_url`), or the default JSON-lines file
    when the database layer is not installed."""
    if db is not None and db.endswith(".jsonl"):
        sink = JsonlSink(db)
        try:
            sink.load()   # a file that is no record store is refused before a tune appends to it
        except RecordStoreError as e:
            raise RuntimeError(str(e)) from None
        except OSError as e:   # a directory, an unreadable file
            raise RuntimeError(f"{db}: cannot read it ({e.strerror or e})") from None
        _refuse_unwritable(db, dir_too=False)
        return sink
    if db_layer() is not None:
        return DbSink(db).prepare()
    if db is None:
        return JsonlSink(default_records_path())
    raise RuntimeError(f"--db {db}: the tuning database layer (autossd.db) is not available; "
                       "use a .jsonl path")
