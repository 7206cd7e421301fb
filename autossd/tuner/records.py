"""Tuning records and the storage seam the tuner writes them through.

The tuner only needs `Sink.save(record: dict)`. `JsonlSink` (append-only JSON lines, one record a
line, fsynced) is the fallback store; `open_sink` adapts the tuning database in `autossd.db`
when that layer is installed (see `_db_sink`).

A record: arch, device, op, problem (Problem fields), config (every knob), time_ms, provenance
("measured" | "static"), triton_version, template_hash, date (UTC ISO), host, plus
informational fields (floor_ms, study, trial, gate errors, compile report summary).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ..problem import Problem
from ..space import Config

OP = "ssd_fwd"
PROVENANCES = ("measured", "static")


class Sink(Protocol):
    def save(self, record: dict) -> None: ...


def triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:  # pragma: no cover
        return "none"


def make_record(arch: str, device: str, problem: Problem, config: Config, time_ms: float,
                provenance: str, **extra: Any) -> dict:
    from ..render import template_hash
    if provenance not in PROVENANCES:
        raise ValueError(f"provenance: expected one of {PROVENANCES}, got {provenance!r}")
    rec = {"arch": arch, "device": device, "op": OP, "problem": problem.key(),
           "config": config.as_dict(), "time_ms": float(time_ms), "provenance": provenance,
           "triton_version": triton_version(), "template_hash": template_hash(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "host": socket.gethostname()}
    rec.update(extra)
    return rec


def record_key(rec: dict) -> str:
    """What a record answers: one (arch, device for measured records, op, problem)."""
    dev = rec["device"] if rec["provenance"] == "measured" else ""
    return json.dumps([rec["arch"], dev, rec["op"], rec["problem"], rec["template_hash"]], sort_keys=True)


def better(a: dict, b: dict) -> dict:
    """The record to keep of two for one key: measured beats static, then the faster one."""
    rank = lambda r: (r["provenance"] != "measured", r["time_ms"])  # noqa: E731
    return a if rank(a) <= rank(b) else b


class JsonlSink:
    """Append-only JSON-lines store: survives kills (each line is one whole write + fsync)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def save(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def load(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn last line after a kill: skip it
        return out

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


def best_records(records: Iterable[dict]) -> list[dict]:
    """One record per key (measured beats static, then the fastest)."""
    keep: dict[str, dict] = {}
    for r in records:
        k = record_key(r)
        keep[k] = better(keep[k], r) if k in keep else r
    return list(keep.values())


def default_records_path() -> Path:
    env = os.environ.get("AUTOSSD_DATA_DIR")
    if env:
        return Path(env) / "records.jsonl"
    import platformdirs
    return Path(platformdirs.user_data_dir("autossd")) / "records.jsonl"


def db_layer():
    """The tuning-database module when it is installed, else None."""
    try:
        from .. import db  # noqa: F401  (being built in parallel: autossd/db/)
    except ImportError:
        return None
    return db


def _db_sink(db_url: str):
    """Adapter to autossd.db when it offers a record writer; None otherwise."""
    db = db_layer()
    if db is None:
        return None
    for name in ("save_record", "add_record", "put_record"):
        fn = getattr(db, name, None)
        if callable(fn):
            class _DbSink:
                def save(self, record: dict, _fn=fn, _url=db_url) -> None:
                    _fn(_url, record)

                def __repr__(self) -> str:
                    return f"DbSink({db_url!r} via autossd.db.{name})"
            return _DbSink()
    return None


def open_sink(db: str | None) -> Sink:
    """`db`: a .jsonl path (JSON-lines store), a database path/URL (needs autossd.db), or None
    (the default JSON-lines file in the user data dir)."""
    if db is None:
        return JsonlSink(default_records_path())
    if db.endswith(".jsonl"):
        return JsonlSink(db)
    sink = _db_sink(db)
    if sink is None:
        raise RuntimeError(f"--db {db}: the tuning database layer (autossd.db) is not available; "
                           "use a .jsonl path")
    return sink
