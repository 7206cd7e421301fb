"""Tuned records: build, validate, write and read them.

A row holds its problem and its config as canonical JSON (`problem_json`, `config_json`); both
are validated on read against the space and problem type of the row's own op, taken from the op
registry (`autossd.ops.registry.get_op`). Every row read from any database goes through
`validate_row` before it can be used:
  - each JSON text must parse strictly (no NaN or Infinity, no repeated key), be an object, and
    be exactly the canonical text of what it holds (sorted keys, as `key()` writes it), so an
    edited text that merely parses is still refused;
  - the problem through the op's problem type, every field checked for its exact type first
    (true is no 1, "4" is no 4); an unknown field is refused;
  - the config through the op's config type, which rejects an unknown knob and any value outside
    a knob's declared set; a knob the stored JSON lacks (one added after the record was written)
    takes its default, which is why a new knob needs no migration;
  - the config must be feasible for its arch and problem (the op's `violations`);
  - numbers must be finite and non-negative, and every text field must match a narrow pattern
    (no quotes, brackets, parentheses, backslashes, newlines...),
so neither an out-of-range value nor a string with code in it survives. Rows are read raw (no type
coercion by SQLAlchemy), so a string in a number column is seen as a string and rejected.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import logging
import math
import re
import socket
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import sqlalchemy as sa

from ..arch import ARCHS, get_arch
from ..knobs import BaseConfig, ConfigError
from ..ops.registry import Op, get_op
from .engine import (TuningDBError, checkpoint, current_revision, dispose_engines, get_engine, is_wal_file,
                     migrate, read_only_wal_error, shown, sqlite_path, to_url, with_retries, writable,
                     write_transaction)
from .models import FIGURE_COLUMNS, KEY_COLUMNS, LAUNCH_MODES, PROVENANCES, TEXT_COLUMNS, tuned_records

log = logging.getLogger("autossd.db")

# Measured ceilings (H100: device-to-device copy and bf16 matmul, as the benchmarks measure them); other archs use
# their datasheet figures from arch.py.
MEASURED_CEILINGS = {"sm90": (3000.0, 738.0)}  # GB/s, TFLOP/s

_SAFE_TEXT = r"[A-Za-z0-9 ._:/+@%,=-]"
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9 ._:/+@%,=-]")


def device_text(name: str) -> str:
    """A GPU's name as a record stores it: characters outside the stored set replaced by '-', at
    most 128 characters (what the tuner writes, and what the lookup compares with)."""
    return _UNSAFE_CHAR.sub("-", name)[:128]

TEXT_PATTERNS = {
    "op": re.compile(r"[a-z][a-z0-9_]{0,15}"),
    "dtype": re.compile(r"[A-Za-z0-9_]{0,16}"),
    "device": re.compile(rf"{_SAFE_TEXT}{{0,128}}"),
    "notes": re.compile(rf"{_SAFE_TEXT}{{0,256}}"),
    "host": re.compile(r"[A-Za-z0-9._-]{0,255}"),
    "triton_version": re.compile(r"[A-Za-z0-9.+_-]{1,64}"),
    "autossd_version": re.compile(r"[A-Za-z0-9.+_-]{1,32}"),
    "template_hash": re.compile(r"[0-9a-f]{1,64}"),
    "created_at": re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.]{2,15}(Z|[+-][0-9]{2}:[0-9]{2})?"),
}
CHOICES = {"arch": tuple(ARCHS), "provenance": PROVENANCES, "launch_mode": LAUNCH_MODES}
# a problem or config of any op fits well inside this; a longer text is no record of ours
MAX_JSON_CHARS = 8192


class RecordError(ValueError):
    """A tuned record is invalid (tampered, corrupt or from an incompatible writer)."""


def canonical_json(data: Mapping[str, Any]) -> str:
    """The one text a problem key or a config is stored as (what `BaseConfig.key()` writes)."""
    return json.dumps(dict(data), sort_keys=True)


@dataclass(frozen=True)
class Record:
    """One validated tuned record: `problem` and `config` are of its op's problem and config
    types. `origin` says where it was read from ("user", "shipped", or a URL); it is not stored."""
    op: str
    arch: str
    device: str
    problem: Any
    config: BaseConfig
    time_ms: float | None
    provenance: str
    triton_version: str
    autossd_version: str
    template_hash: str
    created_at: str
    host: str
    tflops: float | None = None
    gbps: float | None = None
    pct_of_floor: float | None = None
    predicted_ms: float | None = None
    notes: str = ""
    launch_mode: str = "eager"   # models.LAUNCH_MODES: what time_ms was measured under
    id: int | None = field(default=None, compare=False)
    origin: str = field(default="", compare=False)

    def stale_reasons(self, triton_version: str, template_hash: str) -> list[str]:
        """Why this record was made by other code than what runs now (empty when fresh). The
        stored hash is that of the kernels its config launches (render.kernel_hash); a record
        from before that stored the hash of every template (`template_hash`), which is accepted
        while the templates are unchanged."""
        why = []
        if self.triton_version != triton_version:
            why.append(f"triton {self.triton_version} != {triton_version}")
        if self.template_hash != template_hash:
            now = current_kernel_hash(self.config, self.arch)
            if self.template_hash not in (now, legacy_kernel_hash(self.config, self.arch)):
                why.append(f"kernel hash {self.template_hash} != {now} (the kernels this config launches changed)")
        return why

    def to_row(self) -> dict[str, Any]:
        """The row this record is stored as (every column but id)."""
        row = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("problem", "config", "id", "origin")}
        key = self.problem.key()
        row["dtype"] = _dtype_of(key)
        row["problem_json"] = canonical_json(key)
        row["config_json"] = self.config.key()
        return row


def _dtype_of(problem_key: Mapping[str, Any]) -> str:
    """What the dtype column holds: the problem's dtype (empty for an op whose problem has none)."""
    d = problem_key.get("dtype", "")
    return d if isinstance(d, str) else ""


# --- derived figures ----------------------------------------------------------------------
def floor_ms(problem, arch: str, chunk_size: int = 256) -> float:
    """Speed-of-light time: max(min bytes / bandwidth, causal FLOPs / matmul rate)."""
    a = get_arch(arch)
    gbps, tflops = MEASURED_CEILINGS.get(arch, (a.hbm_gbps, a.matmul_tflops))
    return max(problem.min_bytes() / (gbps * 1e9), problem.flops(chunk_size) / (tflops * 1e12)) * 1e3


def figures(problem, config: BaseConfig, arch: str, time_ms: float | None) -> dict[str, float | None]:
    """TFLOP/s, GB/s and % of the floor of a time; None where the time is missing or the op's
    problem has no FLOP and byte counts."""
    if type(time_ms) not in (int, float) or not time_ms > 0:  # validate_row rejects bad times
        return {"tflops": None, "gbps": None, "pct_of_floor": None}
    if not (hasattr(problem, "flops") and hasattr(problem, "min_bytes")):
        return {"tflops": None, "gbps": None, "pct_of_floor": None}
    chunk = config.get("chunk_size", 256)
    s = time_ms * 1e-3
    return {"tflops": problem.flops(chunk) / s / 1e12,
            "gbps": problem.min_bytes() / s / 1e9,
            "pct_of_floor": 100.0 * floor_ms(problem, arch, chunk) / time_ms}


def current_kernel_hash(config: BaseConfig, arch: str) -> str:
    """The hash a record of `config` on `arch` made by the code now running would store."""
    from ..render import kernel_hash
    return kernel_hash(config, get_arch(arch).backend)


def legacy_kernel_hash(config: BaseConfig, arch: str) -> str:
    """The hash a record made before kernel hashes ignored comments would store now."""
    from ..render import legacy_kernel_hash as legacy
    return legacy(config, get_arch(arch).backend)


PROVENANCE_RANK = {"measured": 0, "static": 1, "default": 2}   # how records rank: measured first


def _freshness() -> tuple[str, str]:
    import triton

    from ..render import template_hash
    return triton.__version__, template_hash()


def record_time(rec: Record) -> float:
    """The time a record ranks by: measured, else the static model's prediction, else inf."""
    if rec.time_ms is not None:
        return rec.time_ms
    return rec.predicted_ms if rec.predicted_ms is not None else math.inf


def _versions() -> tuple[str, str]:
    import triton

    from .. import __version__
    return triton.__version__, __version__


def _hostname() -> str:
    host = socket.gethostname()
    return host if TEXT_PATTERNS["host"].fullmatch(host) else re.sub(r"[^A-Za-z0-9._-]", "-", host)[:255]


def make_record(problem, config: BaseConfig, arch: str, *, provenance: str,
                time_ms: float | None = None, op: str | None = None, device: str = "",
                predicted_ms: float | None = None, notes: str = "",
                launch_mode: str | None = None, made: Mapping[str, str] | None = None) -> Record:
    """A record for the current code (triton version, autossd version, kernel hash, now,
    this host), with TFLOP/s, GB/s and % of floor derived from time_ms. Validated like a row
    read back, so nothing a reader would reject can be written. launch_mode: default "eager"
    for a measured record, "any" for a static or default one (a prediction of GPU time).
    made: what a record copied from another store says of the code, time and host that made it
    (any of triton_version, autossd_version, template_hash, created_at, host): kept, so that a
    stale record stays stale and keeps its date. op: default the config's."""
    op = op or config.op
    if launch_mode is None:
        launch_mode = "eager" if provenance == "measured" else "any"
    triton_v, autossd_v = _versions()
    th = current_kernel_hash(config, arch)
    key = problem.key()
    row = dict(op=op, arch=arch, device=device, dtype=_dtype_of(key), problem_json=canonical_json(key),
               config_json=config.key(), time_ms=time_ms, provenance=provenance,
               triton_version=triton_v, autossd_version=autossd_v, template_hash=th,
               created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               host=_hostname(), predicted_ms=predicted_ms, notes=notes, launch_mode=launch_mode,
               **figures(problem, config, arch, time_ms))
    for k, v in (made or {}).items():
        if k not in ("triton_version", "autossd_version", "template_hash", "created_at", "host"):
            raise ValueError(f"made: {k!r} is not a field that says who made a record")
        row[k] = v
    return validate_row(row)


# --- validation ---------------------------------------------------------------------------
def _fail(row: Mapping, name: str, why: str) -> RecordError:
    rid = row.get("id")
    where = f"record id={rid!r}" if rid is not None else "record"
    # an error raised by the field's own check (ConfigError, ...) already names the field
    return RecordError(f"tuning db {where}: {name}: {why.removeprefix(f'{name}: ')}")


def _text(row: Mapping, name: str) -> str:
    v = row.get(name)
    if type(v) is not str:
        raise _fail(row, name, f"expected text, got {type(v).__name__}")
    if name in CHOICES:
        if v not in CHOICES[name]:
            raise _fail(row, name, f"{v[:40]!r} is not one of {list(CHOICES[name])}")
    elif not TEXT_PATTERNS[name].fullmatch(v):
        raise _fail(row, name, f"{v[:40]!r} has characters or a length outside the allowed pattern "
                               f"{TEXT_PATTERNS[name].pattern!r}")
    return v


def _number(row: Mapping, name: str) -> float | None:
    v = row.get(name)
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0 or (name == "time_ms" and v == 0):
        raise _fail(row, name, f"expected a finite non-negative number or NULL, got {v!r}")
    return float(v)


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k[:40]!r} appears twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_object(row: Mapping, name: str) -> dict[str, Any]:
    """A JSON column's object, parsed strictly, whose text must be its canonical form."""
    text = row.get(name)
    if type(text) is not str:
        raise _fail(row, name, f"expected JSON text, got {type(text).__name__}")
    if len(text) > MAX_JSON_CHARS:
        raise _fail(row, name, f"{len(text)} characters, more than a record holds ({MAX_JSON_CHARS})")
    try:
        data = json.loads(text, object_pairs_hook=_no_repeated_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise _fail(row, name, f"not valid JSON ({str(e)[:80]})") from None
    if type(data) is not dict:
        raise _fail(row, name, f"expected a JSON object, got {type(data).__name__}")
    if canonical_json(data) != text:
        raise _fail(row, name, "not in canonical form (sorted keys, as key() writes it): the text was edited")
    return data


@functools.lru_cache(maxsize=None)
def _field_types(problem_type: type) -> dict[str, Any] | None:
    """A dataclass problem type's field -> annotated type (None: not a dataclass; its
    constructor alone validates)."""
    if not dataclasses.is_dataclass(problem_type):
        return None
    hints = typing.get_type_hints(problem_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(problem_type)}


def _exact(v: Any, py: Any) -> bool:
    """v has exactly type py (bool is no int; an Optional takes None)."""
    args = typing.get_args(py)
    if args:
        return any(_exact(v, a) for a in args)
    if py is type(None):
        return v is None
    if py is float:
        return type(v) is float and math.isfinite(v)
    return type(v) is py


def _problem(row: Mapping, op: Op) -> tuple[Any, dict[str, Any]]:
    """The row's problem, of its op's problem type, and the fields stored."""
    data = _json_object(row, "problem_json")
    types = _field_types(op.problem_type)
    if types is not None:
        unknown = sorted(set(data) - set(types))
        if unknown:
            raise _fail(row, "problem", f"unknown field(s) {[u[:40] for u in unknown]} for {op.name}")
        for name, v in data.items():
            if not _exact(v, types[name]):
                raise _fail(row, "problem", f"{name}: expected {types[name]}, got "
                                            f"{type(v).__name__} {str(v)[:40]!r}")
    try:
        problem = op.problem_type(**data)
    except (ValueError, TypeError) as e:
        raise _fail(row, "problem", str(e)) from None
    return problem, data


def validate_row(row: Mapping[str, Any]) -> Record:
    """A Record from a raw row, or RecordError saying which field is wrong and why."""
    text = {name: _text(row, name) for name in TEXT_COLUMNS}
    notes = row.get("notes", "")
    if notes is None:
        notes = ""
    text["notes"] = _text({**row, "notes": notes}, "notes")
    try:
        op = get_op(text["op"])
    except ValueError as e:
        raise _fail(row, "op", str(e)) from None
    problem, key = _problem(row, op)
    if text.pop("dtype") != _dtype_of(key):
        raise _fail(row, "dtype", "differs from the problem's dtype")
    knobs = _json_object(row, "config_json")
    try:
        config = op.config_type(knobs)   # a knob the text lacks takes its default
    except ConfigError as e:
        raise _fail(row, "config", str(e)) from None
    bad = op.fn("violations")(config, text["arch"], problem)
    if bad:
        raise _fail(row, "config", f"cannot run on {text['arch']}: {'; '.join(bad)}")
    nums = {name: _number(row, name) for name in FIGURE_COLUMNS}
    if text["provenance"] == "measured" and nums["time_ms"] is None:
        raise _fail(row, "time_ms", "a measured record needs a time")
    try:
        _dt.datetime.fromisoformat(text["created_at"].replace("Z", "+00:00"))
    except ValueError:
        raise _fail(row, "created_at", f"{text['created_at']!r} is not an ISO-8601 date") from None
    rid = row.get("id")
    if rid is not None and type(rid) is not int:
        raise _fail(row, "id", f"expected int, got {type(rid).__name__}")
    return Record(problem=problem, config=config, id=rid, **text, **nums)


# --- reading and writing ------------------------------------------------------------------
def _raw_select(table: sa.Table, arch: str | None, op: str | None) -> sa.Select:
    # NullType: no result processing, so the validator sees exactly what is stored
    cols = [sa.type_coerce(c, sa.types.NullType()).label(c.name) for c in table.c]
    q = sa.select(*cols).order_by(table.c.id)
    if arch is not None:
        q = q.where(table.c.arch == arch)
    if op is not None:
        q = q.where(table.c.op == op)
    return q


def _reader(url: str, readonly: bool, immutable: bool = False):
    """The engine a read goes through: an SQLite file is always opened read-only (reading needs
    no write access to it or its folder); immutable: a file nothing writes (a shipped one)."""
    path = sqlite_path(url)
    return get_engine(url, readonly=readonly or (path is not None and path.is_file()), immutable=immutable)


def read_rows(url: str, arch: str | None = None, op: str | None = None,
              readonly: bool = False, immutable: bool = False) -> list[dict[str, Any]]:
    """Raw rows (dicts) of a database at the current schema. Raises TuningDBError when the file
    is not a readable autossd tuning database (ReadOnlyWALError when it is one, in WAL mode, in a
    folder this process cannot write)."""
    path = sqlite_path(url)
    try:
        eng = _reader(url, readonly, immutable)
        with eng.connect() as conn:
            rev = current_revision(conn)
            if rev is None:
                raise TuningDBError(f"tuning db {shown(url)}: not an autossd tuning database (no schema version)")
            if not sa.inspect(conn).has_table(tuned_records.name):
                raise TuningDBError(f"tuning db {shown(url)}: schema {rev} has no table {tuned_records.name!r}")
            result = conn.execute(_raw_select(tuned_records, arch, op))
            return [dict(r._mapping) for r in result]
    except sa.exc.DatabaseError as e:
        if path is not None and is_wal_file(path) and not writable(url):
            raise read_only_wal_error(path) from None
        raise TuningDBError(f"tuning db {shown(url)}: cannot be read ({getattr(e, 'orig', e)})") from None


def read_records(db: str, arch: str | None = None, op: str | None = None, *, strict: bool = True,
                 readonly: bool = False, origin: str = "", immutable: bool = False) -> list[Record]:
    """Validated records of a database already at the current schema. strict: the first bad row
    raises RecordError; otherwise bad rows are logged and skipped. An SQLite file is read through
    a read-only connection (`readonly` matters for other backends only); immutable: a file that
    nothing writes (a shipped database), read with no locking."""
    url = to_url(db)
    out = []
    skipped = []
    for row in read_rows(url, arch, op, readonly=readonly, immutable=immutable):
        try:
            rec = validate_row(row)
        except RecordError as e:
            if strict:
                raise
            log.warning("%s (in %s); record skipped", e, shown(url))
            skipped.append(str(e))
            continue
        out.append(replace(rec, origin=origin or shown(url)))
    _rejected[(url, arch, op)] = skipped
    return out


# (url, arch, op) -> why each row skipped by the last read_records of it failed validation: a
# lookup that fell back to a default can say that records were there but refused
_rejected: dict[tuple, list[str]] = {}


def rejected_rows(url: str, arch: str | None = None, op: str | None = None) -> list[str]:
    """Why the rows of `url` (for arch and op) that the last non-strict read skipped were
    refused; [] when none were, or the database was not read."""
    return list(_rejected.get((to_url(url), arch, op), ()))


_listeners: list = []  # callables(url) run after a write, e.g. the runtime's lookup caches


def on_write(fn) -> None:
    _listeners.append(fn)


def _rank_time(row: Mapping[str, Any]) -> float | None:
    t = row.get("time_ms")
    if t is None:
        t = row.get("predicted_ms")
    return t if type(t) in (int, float) else None


def replaces(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    """Whether row `new` supersedes row `old` of the same key: made by the same code (triton
    version and kernel hash), when its time (measured, else predicted) is smaller; made by other
    code, when it is newer (the older figure may no longer hold). So re-running a tune keeps the
    better figure, and a re-tune after the kernels changed replaces the stale one. `_replaces_sql`
    says the same to the database."""
    if (new.get("triton_version"), new.get("template_hash")) == (old.get("triton_version"), old.get("template_hash")):
        nt, ot = _rank_time(new), _rank_time(old)
        return nt is not None and (ot is None or nt < ot)
    return str(new.get("created_at")) > str(old.get("created_at"))


def _replaces_sql(new, old, dialect: str = "sqlite") -> sa.ColumnElement[bool]:
    same_code = sa.and_(new.triton_version == old.triton_version, new.template_hash == old.template_hash)
    nt = sa.func.coalesce(new.time_ms, new.predicted_ms)
    ot = sa.func.coalesce(old.time_ms, old.predicted_ms)
    faster = sa.and_(nt.is_not(None), sa.or_(ot.is_(None), nt < ot))
    newer = new.created_at > old.created_at
    if dialect == "postgresql":
        # dates compare as Python compares them (code points); a database's locale collation
        # may order text by other rules
        newer = sa.collate(new.created_at, "C") > sa.collate(old.created_at, "C")
    return sa.or_(sa.and_(same_code, faster), sa.and_(sa.not_(same_code), newer))


def _key(row: Mapping[str, Any]) -> tuple:
    return tuple(row[c] for c in KEY_COLUMNS)


def _fold(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per key, the one that supersedes the others (in the order given)."""
    best: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        k = _key(row)
        if k not in best or replaces(row, best[k]):
            best[k] = row
    return list(best.values())


_UPDATED = [c.name for c in tuned_records.c if c.name != "id" and c.name not in KEY_COLUMNS]


def _upsert(conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
    """Insert rows; a row whose key the table holds replaces that row only where it supersedes it
    (`replaces`). The unique index decides, inside the database, so two writers of the same record
    at the same moment leave one row."""
    name = conn.dialect.name
    if name in ("sqlite", "postgresql"):
        if name == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:
            from sqlalchemy.dialects.postgresql import insert
        ins = insert(tuned_records)
        stmt = ins.on_conflict_do_update(index_elements=list(KEY_COLUMNS),
                                         set_={c: ins.excluded[c] for c in _UPDATED},
                                         where=_replaces_sql(ins.excluded, tuned_records.c, name))
        conn.execute(stmt, rows)
        return
    # other backends: look the key up in the same write transaction; a writer that inserts the
    # same key in between makes the unique index refuse ours, and add_records runs the batch again
    t = tuned_records
    for row in rows:
        cols = [t.c.id, t.c.triton_version, t.c.template_hash, t.c.created_at, t.c.time_ms, t.c.predicted_ms]
        old = conn.execute(sa.select(*cols).where(*[t.c[c] == row[c] for c in KEY_COLUMNS])).first()
        if old is None:
            conn.execute(t.insert(), [row])
        elif replaces(row, old._mapping):
            conn.execute(t.update().where(t.c.id == old.id).values({c: row[c] for c in _UPDATED}))


def add_records(db: str, records: Iterable[Record], batch_size: int = 500) -> int:
    """Store records (creating/upgrading the database first), one row per key
    (`models.KEY_COLUMNS`): a record the database already holds is kept once, with the better
    figure (`replaces`), so re-running a finished tune or two identical tunes at once add no
    duplicates. Each batch is one BEGIN IMMEDIATE transaction, retried as a whole on a lock
    error. When done, an SQLite file goes back to rollback-journal mode unless another writer
    has it open (`engine.leave_wal`), so it reads from a read-only place. Returns the number of
    records given."""
    url = to_url(db)
    migrate(url)
    eng = get_engine(url)
    records = list(records)
    rows = _fold([r.to_row() for r in records])
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]

        def _write(chunk=chunk) -> None:
            with write_transaction(eng) as conn:
                _upsert(conn, chunk)

        for attempt in range(3):
            try:
                with_retries(_write)
                break
            except sa.exc.IntegrityError:   # only the look-up path: a concurrent writer won the key
                if attempt == 2 or eng.dialect.name in ("sqlite", "postgresql"):
                    raise
    checkpoint(eng)
    dispose_engines(url)   # this writer is done: rollback-journal mode, where no one else writes
    for fn in _listeners:
        fn(url)
    return len(records)


def row_count(db: str) -> int:
    url = to_url(db)
    with _reader(url, False).connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(tuned_records)).scalar_one()


__all__ = ["Record", "RecordError", "add_records", "figures", "floor_ms", "make_record",
           "on_write", "read_records", "read_rows", "row_count", "validate_row"]
