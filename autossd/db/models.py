"""The tuning database's schema (SQLAlchemy 2.x ORM).

One table, `tuned_records`: one row per (op, arch, device, launch mode, provenance, problem,
config) measurement or choice. The problem and the config are stored as canonical JSON text
(`problem_json`: the op's problem key, flags included; `config_json`: the op's `Config.key()`),
and are validated on read against *that op's* problem type and knob space, taken from the op
registry (`records.validate_row`). So the schema knows no knob and no problem field: adding a
knob needs no migration (a stored config that lacks it takes its default when read), and a new
op with its own knobs and problem type shares the table.

`dtype` repeats the problem's dtype (validated equal on read) only so that the lookup index can
narrow a search without parsing JSON.

Dates are ISO-8601 text so that every backend returns a value the loader can validate exactly
(see `records.validate_row`). The migrations in `migrations/versions/` are frozen snapshots:
`tests/test_db.py` checks that alembic's compare_metadata finds no difference between a
migrated database and this model.
"""
from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

TABLE = "tuned_records"
PROVENANCES = ("measured", "static", "default")
# What a record's time was measured under: eager calls (host launch cost included: at a small
# shape it favours fewer launches), CUDA-graph replay (GPU time only), or "any" for a prediction
# of GPU time (static) that stands for both. The runtime asks for "graph" while a stream captures.
LAUNCH_MODES = ("eager", "graph", "any")
# text columns and their maximum lengths (validated on read as well)
TEXT_COLUMNS = {"op": 16, "arch": 16, "device": 128, "dtype": 16, "provenance": 16, "launch_mode": 8,
                "triton_version": 64, "autossd_version": 32, "template_hash": 64, "created_at": 32,
                "host": 255}
JSON_COLUMNS = ("problem_json", "config_json")
FIGURE_COLUMNS = ("time_ms", "tflops", "gbps", "pct_of_floor", "predicted_ms")  # floats or NULL
# What makes two rows the same record: the database holds one row per key (a unique index), the
# better one (records.add_records). The device is part of it (two GPUs of one arch may time a
# config differently); the code that made a record is not (a re-measurement replaces the figure
# it supersedes, rather than piling up beside it).
KEY_COLUMNS = ("op", "arch", "device", "launch_mode", "provenance", "problem_json", "config_json")


class Base(DeclarativeBase):
    pass


tuned_records = sa.Table(
    TABLE, Base.metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("op", sa.String(16), nullable=False),
    sa.Column("arch", sa.String(16), nullable=False),
    sa.Column("device", sa.String(128), nullable=False),
    sa.Column("dtype", sa.String(16), nullable=False),
    sa.Column("launch_mode", sa.String(8), nullable=False),
    sa.Column("provenance", sa.String(16), nullable=False),
    sa.Column("problem_json", sa.Text, nullable=False),     # canonical JSON of the op's problem key
    sa.Column("config_json", sa.Text, nullable=False),      # canonical Config.key()
    sa.Column("time_ms", sa.Float, nullable=True),
    sa.Column("predicted_ms", sa.Float, nullable=True),
    sa.Column("tflops", sa.Float, nullable=True),
    sa.Column("gbps", sa.Float, nullable=True),
    sa.Column("pct_of_floor", sa.Float, nullable=True),
    sa.Column("triton_version", sa.String(64), nullable=False),
    sa.Column("autossd_version", sa.String(32), nullable=False),
    sa.Column("template_hash", sa.String(64), nullable=False),
    sa.Column("created_at", sa.String(32), nullable=False),  # ISO-8601, UTC
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("notes", sa.String(256), nullable=False, server_default=""),
    sa.Index("ix_tuned_records_lookup", "op", "arch", "dtype"),
    sa.Index("ux_tuned_records_key", *KEY_COLUMNS, unique=True),
)


class TunedRecord(Base):
    """A tuned (or chosen) config for one problem on one arch."""
    __table__ = tuned_records

    def __repr__(self) -> str:
        return f"TunedRecord(id={self.id}, op={self.op}, arch={self.arch}, provenance={self.provenance})"
