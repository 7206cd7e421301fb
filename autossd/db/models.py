"""The tuning database's schema (SQLAlchemy 2.x ORM).

One table, `tuned_records`: one row per (op, arch, device, problem, config) measurement or
choice. Its columns are derived, not retyped: one per field of `autossd.problem.Problem` (named
as the field) and one per knob of `autossd.ops.ssd.fwd_knobs.KNOBS` (named `cfg_<knob>`). Adding a knob or a
problem field therefore changes this model; the migrations in `migrations/versions/` are frozen
snapshots, and `tests/test_db.py` fails until a new revision adds the column (alembic's
compare_metadata must find no difference between a migrated database and this model).

Dates are ISO-8601 text so that every backend returns a value the loader can validate exactly
(see `records.validate_row`).
"""
from __future__ import annotations

import typing

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from ..problem import Problem
from ..ops.ssd.fwd_knobs import KNOBS

TABLE = "tuned_records"
OPS = ("ssd_fwd", "ssd_bwd", "ssd_decode")
PROVENANCES = ("measured", "static", "default")
# What a record's time was measured under: eager calls (host launch cost included: at a small
# shape it favours fewer launches), CUDA-graph replay (GPU time only), or "any" for a prediction
# of GPU time (static) that stands for both. The runtime asks for "graph" while a stream captures.
LAUNCH_MODES = ("eager", "graph", "any")
KNOB_PREFIX = "cfg_"

# column name -> python type / knob name, derived from the declarations
PROBLEM_COLUMNS: dict[str, object] = typing.get_type_hints(Problem)
KNOB_COLUMNS: dict[str, str] = {KNOB_PREFIX + k.name: k.name for k in KNOBS}
# text columns and their maximum lengths (validated on read as well)
TEXT_COLUMNS = {"op": 16, "arch": 16, "device": 128, "provenance": 16, "triton_version": 64,
                "autossd_version": 32, "template_hash": 64, "created_at": 32, "host": 255,
                "launch_mode": 8}
FIGURE_COLUMNS = ("time_ms", "tflops", "gbps", "pct_of_floor", "predicted_ms")  # floats or NULL


def sa_type(py: object) -> tuple[sa.types.TypeEngine, bool]:
    """(column type, nullable) for a Problem field type or a knob's default type."""
    args = typing.get_args(py)
    nullable = type(None) in args
    if nullable:
        (py,) = [a for a in args if a is not type(None)]
    if py is bool:  # before int: bool is an int subclass
        return sa.Boolean(), nullable
    if py is int:
        return sa.Integer(), nullable
    if py is str:
        return sa.String(32), nullable
    raise TypeError(f"tuning db: no column type for {py!r}; extend models.sa_type")


def _derived_columns() -> list[sa.Column]:
    cols = []
    for name, py in PROBLEM_COLUMNS.items():
        typ, nullable = sa_type(py)
        cols.append(sa.Column(name, typ, nullable=nullable))
    for knob in KNOBS:
        typ, _ = sa_type(type(knob.default))
        cols.append(sa.Column(KNOB_PREFIX + knob.name, typ, nullable=False))
    return cols


class Base(DeclarativeBase):
    pass


tuned_records = sa.Table(
    TABLE, Base.metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("op", sa.String(16), nullable=False),
    sa.Column("arch", sa.String(16), nullable=False),
    sa.Column("device", sa.String(128), nullable=False),
    *_derived_columns(),
    sa.Column("config_json", sa.Text, nullable=False),      # canonical Config.key()
    sa.Column("time_ms", sa.Float, nullable=True),
    sa.Column("provenance", sa.String(16), nullable=False),
    sa.Column("triton_version", sa.String(64), nullable=False),
    sa.Column("autossd_version", sa.String(32), nullable=False),
    sa.Column("template_hash", sa.String(64), nullable=False),
    sa.Column("created_at", sa.String(32), nullable=False),  # ISO-8601, UTC
    sa.Column("host", sa.String(255), nullable=False),
    # --- schema revision 2 ---
    sa.Column("tflops", sa.Float, nullable=True),
    sa.Column("gbps", sa.Float, nullable=True),
    sa.Column("pct_of_floor", sa.Float, nullable=True),
    sa.Column("predicted_ms", sa.Float, nullable=True),
    sa.Column("notes", sa.String(256), nullable=False, server_default=""),
    # --- schema revision 6 ---
    sa.Column("launch_mode", sa.String(8), nullable=False, server_default="eager"),
    sa.Index("ix_tuned_records_lookup", "op", "arch", "dtype", "headdim", "dstate"),
)


class TunedRecord(Base):
    """A tuned (or chosen) config for one problem on one arch."""
    __table__ = tuned_records

    def __repr__(self) -> str:
        return f"TunedRecord(id={self.id}, op={self.op}, arch={self.arch}, provenance={self.provenance})"
