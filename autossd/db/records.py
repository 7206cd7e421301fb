"""Tuned records: build, validate, write and read them.

Every row read from any database goes through `validate_row` before it can be used: the problem
through `Problem(...)`, the config through `Config(...)` (which rejects any value outside a knob's
declared set), the config must be feasible on its arch (`space.violations`), the canonical JSON
must agree with the knob columns, numbers must be finite and non-negative, and every text field
must match a narrow pattern (no quotes, brackets, parentheses, backslashes, newlines...), so
neither an out-of-range value nor a string with code in it survives. Rows are read raw (no type
coercion by SQLAlchemy), so a string in an integer column is seen as a string and rejected.
"""
from __future__ import annotations

import datetime as _dt
import logging
import math
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import sqlalchemy as sa

from ..arch import ARCHS, get_arch
from ..problem import Problem
from ..ops.ssd.fwd_knobs import KNOB_BY_NAME, Config, ConfigError, violations
from .engine import (TuningDBError, checkpoint, current_revision, get_engine, migrate, to_url, with_retries,
                     write_transaction)
from .models import (FIGURE_COLUMNS, KNOB_COLUMNS, LAUNCH_MODES, OPS, PROBLEM_COLUMNS, PROVENANCES,
                     TEXT_COLUMNS, tuned_records)

log = logging.getLogger("autossd.db")

# Measured ceilings (DESIGN.md: H100 device-to-device copy and bf16 matmul); other archs use
# their datasheet figures from arch.py.
MEASURED_CEILINGS = {"sm90": (3000.0, 738.0)}  # GB/s, TFLOP/s

_SAFE_TEXT = r"[A-Za-z0-9 ._:/+@%,=-]"
TEXT_PATTERNS = {
    "device": re.compile(rf"{_SAFE_TEXT}{{0,128}}"),
    "notes": re.compile(rf"{_SAFE_TEXT}{{0,256}}"),
    "host": re.compile(r"[A-Za-z0-9._-]{0,255}"),
    "triton_version": re.compile(r"[A-Za-z0-9.+_-]{1,64}"),
    "autossd_version": re.compile(r"[A-Za-z0-9.+_-]{1,32}"),
    "template_hash": re.compile(r"[0-9a-f]{1,64}"),
    "created_at": re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}[T ][0-9:.]{2,15}(Z|[+-][0-9]{2}:[0-9]{2})?"),
}
CHOICES = {"op": OPS, "arch": tuple(ARCHS), "provenance": PROVENANCES, "launch_mode": LAUNCH_MODES}


class RecordError(ValueError):
    """A tuned record is invalid (tampered, corrupt or from an incompatible writer)."""


@dataclass(frozen=True)
class Record:
    """One validated tuned record. `origin` says where it was read from ("user", "shipped",
    or a URL); it is not stored."""
    op: str
    arch: str
    device: str
    problem: Problem
    config: Config
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
        row = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("problem", "config", "id", "origin")}
        row.update(self.problem.key())
        row.update({col: self.config[knob] for col, knob in KNOB_COLUMNS.items()})
        row["config_json"] = self.config.key()
        return row


# --- derived figures ----------------------------------------------------------------------
def floor_ms(problem: Problem, arch: str, chunk_size: int = 256) -> float:
    """Speed-of-light time: max(min bytes / bandwidth, causal FLOPs / matmul rate)."""
    a = get_arch(arch)
    gbps, tflops = MEASURED_CEILINGS.get(arch, (a.hbm_gbps, a.matmul_tflops))
    return max(problem.min_bytes() / (gbps * 1e9), problem.flops(chunk_size) / (tflops * 1e12)) * 1e3


def figures(problem: Problem, config: Config, arch: str, time_ms: float | None) -> dict[str, float | None]:
    if type(time_ms) not in (int, float) or not time_ms > 0:  # validate_row rejects bad times
        return {"tflops": None, "gbps": None, "pct_of_floor": None}
    s = time_ms * 1e-3
    return {"tflops": problem.flops(config.chunk_size) / s / 1e12,
            "gbps": problem.min_bytes() / s / 1e9,
            "pct_of_floor": 100.0 * floor_ms(problem, arch, config.chunk_size) / time_ms}


def current_kernel_hash(config: Config, arch: str) -> str:
    """The hash a record of `config` on `arch` made by the code now running would store."""
    from ..render import kernel_hash
    return kernel_hash(config, get_arch(arch).backend)


def legacy_kernel_hash(config: Config, arch: str) -> str:
    """The hash a record made before kernel hashes ignored comments would store now."""
    from ..render import legacy_kernel_hash as legacy
    return legacy(config, get_arch(arch).backend)


def _versions() -> tuple[str, str]:
    import triton

    from .. import __version__
    return triton.__version__, __version__


def _hostname() -> str:
    host = socket.gethostname()
    return host if TEXT_PATTERNS["host"].fullmatch(host) else re.sub(r"[^A-Za-z0-9._-]", "-", host)[:255]


def make_record(problem: Problem, config: Config, arch: str, *, provenance: str,
                time_ms: float | None = None, op: str = "ssd_fwd", device: str = "",
                predicted_ms: float | None = None, notes: str = "",
                launch_mode: str | None = None, made: Mapping[str, str] | None = None) -> Record:
    """A record for the current code (triton version, autossd version, kernel hash, now,
    this host), with TFLOP/s, GB/s and % of floor derived from time_ms. Validated like a row
    read back, so nothing a reader would reject can be written. launch_mode: default "eager"
    for a measured record, "any" for a static or default one (a prediction of GPU time).
    made: what a record copied from another store says of the code, time and host that made it
    (any of triton_version, autossd_version, template_hash, created_at, host): kept, so that a
    stale record stays stale and keeps its date."""
    if launch_mode is None:
        launch_mode = "eager" if provenance == "measured" else "any"
    triton_v, autossd_v = _versions()
    th = current_kernel_hash(config, arch)
    row = dict(op=op, arch=arch, device=device, **problem.key(),
               **{col: config[knob] for col, knob in KNOB_COLUMNS.items()},
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


def _typed(row: Mapping, name: str, py: object) -> Any:
    """A raw column value checked against a Python type (bool columns may come back as 0/1)."""
    v = row.get(name)
    if v is None and type(None) in getattr(py, "__args__", ()):
        return None
    base = next((a for a in getattr(py, "__args__", (py,)) if a is not type(None)), py)
    if base is bool:
        if type(v) is bool or (type(v) is int and v in (0, 1)):
            return bool(v)
        raise _fail(row, name, f"expected a boolean (0/1), got {v!r}")
    if type(v) is not base:
        raise _fail(row, name, f"expected {base.__name__}, got {type(v).__name__} {str(v)[:40]!r}")
    return v


def validate_row(row: Mapping[str, Any]) -> Record:
    """A Record from a raw row, or RecordError saying which field is wrong and why."""
    text = {name: _text(row, name) for name in TEXT_COLUMNS}
    notes = row.get("notes", "")
    if notes is None:
        notes = ""
    text["notes"] = _text({**row, "notes": notes}, "notes")
    try:
        problem = Problem(**{name: _typed(row, name, py) for name, py in PROBLEM_COLUMNS.items()})
    except (ValueError, TypeError) as e:
        raise _fail(row, "problem", str(e)) from None
    knobs = {}
    for col, knob in KNOB_COLUMNS.items():
        v = row.get(col)
        if isinstance(KNOB_BY_NAME[knob].default, bool) and type(v) is int and v in (0, 1):
            v = bool(v)
        knobs[knob] = v
    try:
        config = Config(knobs)
    except ConfigError as e:
        raise _fail(row, "config", str(e)) from None
    if row.get("config_json") != config.key():
        raise _fail(row, "config_json", "does not match the knob columns (expected the canonical Config.key())")
    bad = violations(config, text["arch"], problem)
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


def read_rows(url: str, arch: str | None = None, op: str | None = None,
              readonly: bool = False) -> list[dict[str, Any]]:
    """Raw rows (dicts) of a database at the current schema. Raises TuningDBError when the file
    is not a readable autossd tuning database."""
    try:
        eng = get_engine(url, readonly=readonly)
        with eng.connect() as conn:
            rev = current_revision(conn)
            if rev is None:
                raise TuningDBError(f"tuning db {url}: not an autossd tuning database (no schema version)")
            if not sa.inspect(conn).has_table(tuned_records.name):
                raise TuningDBError(f"tuning db {url}: schema {rev} has no table {tuned_records.name!r}")
            result = conn.execute(_raw_select(tuned_records, arch, op))
            return [dict(r._mapping) for r in result]
    except sa.exc.DatabaseError as e:
        raise TuningDBError(f"tuning db {url}: cannot be read ({getattr(e, 'orig', e)})") from None


def read_records(db: str, arch: str | None = None, op: str | None = None, *, strict: bool = True,
                 readonly: bool = False, origin: str = "") -> list[Record]:
    """Validated records of a database already at the current schema. strict: the first bad row
    raises RecordError; otherwise bad rows are logged and skipped."""
    url = to_url(db)
    out = []
    for row in read_rows(url, arch, op, readonly=readonly):
        try:
            rec = validate_row(row)
        except RecordError as e:
            if strict:
                raise
            log.warning("%s (in %s); record skipped", e, url)
            continue
        out.append(replace(rec, origin=origin or url))
    return out


_listeners: list = []  # callables(url) run after a write, e.g. the runtime's lookup caches


def on_write(fn) -> None:
    _listeners.append(fn)


def add_records(db: str, records: Iterable[Record], batch_size: int = 500) -> int:
    """Append records (creating/upgrading the database first). Each batch is one BEGIN
    IMMEDIATE transaction, retried as a whole on a lock error, so every record lands once."""
    url = to_url(db)
    migrate(url)
    eng = get_engine(url)
    rows = [r.to_row() for r in records]
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]

        def _insert(chunk=chunk) -> None:
            with write_transaction(eng) as conn:
                conn.execute(tuned_records.insert(), chunk)
        with_retries(_insert)
    checkpoint(eng)
    for fn in _listeners:
        fn(url)
    return len(rows)


def row_count(db: str) -> int:
    url = to_url(db)
    with get_engine(url).connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(tuned_records)).scalar_one()


__all__ = ["Record", "RecordError", "add_records", "figures", "floor_ms", "make_record",
           "on_write", "read_records", "read_rows", "row_count", "validate_row"]
