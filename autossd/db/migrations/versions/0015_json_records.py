"""Schema 15: the problem and the config as validated JSON; no column per knob or problem field.

Until schema 14 a row held one column per field of the forward's problem and one `cfg_<knob>`
column per knob, so every new knob needed a schema. From here a row holds `problem_json` (the
canonical JSON of the op's problem key, flags included) and `config_json` (already the canonical
Config.key(), kept as it is); the reader validates both against the row's own op, and a knob a
stored config lacks takes its default. `dtype` repeats the problem's dtype for the lookup index.

Every row is kept, its id too. A row whose values are damaged is carried over as it is (its
problem JSON holds what the columns held), so the reader refuses that row alone, as before.

Revision ID: 0015
Revises: 0014
"""
import json
import math

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TABLE = "tuned_records"
# A migration is a frozen snapshot: the problem fields and the knobs as of schema 14 are written
# out here, not taken from code that later revisions may change.
PROBLEM_FIELDS = ("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups", "dtype", "chunk_size",
                  "has_D", "D_has_hdim", "has_z", "has_dt_bias", "dt_softplus", "has_dt_limit",
                  "has_initial_states", "has_seq_idx", "return_final_states", "return_varlen_states")
BOOL_FIELDS = frozenset(PROBLEM_FIELDS[8:])
# knob -> column type of schema 14's cfg_ columns, for the downgrade
KNOBS_14 = {
    **{k: sa.Integer() for k in (
        "launches", "chunk_size", "cumsum_block_h", "bmm_block_m", "bmm_block_n", "bmm_block_k",
        "bmm_warps", "bmm_stages", "state_block_m", "state_block_n", "state_block_k", "state_warps",
        "state_stages", "pass_block", "pass_warps", "scan_block_m", "scan_block_n", "scan_block_k",
        "scan_block_d", "scan_warps", "scan_stages", "waves_per_eu", "matrix_instr_nonkdim", "kpack",
        "smem_pad", "state_maxnreg", "scan_maxnreg", "fold_prep", "scan_gluon", "state_walk", "pdl",
        "walk_weights", "pass_stages", "walk_split", "walk_block")},
    "state_dtype": sa.String(32),
    "decay_split": sa.Boolean(),
}
# columns both schemas hold, copied as they are
COMMON = ("id", "op", "arch", "device", "launch_mode", "provenance", "config_json", "time_ms",
          "predicted_ms", "tflops", "gbps", "pct_of_floor", "triton_version", "autossd_version",
          "template_hash", "created_at", "host", "notes")


def _new_table(name):
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("op", sa.String(16), nullable=False),
        sa.Column("arch", sa.String(16), nullable=False),
        sa.Column("device", sa.String(128), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("launch_mode", sa.String(8), nullable=False),
        sa.Column("provenance", sa.String(16), nullable=False),
        sa.Column("problem_json", sa.Text(), nullable=False),
        sa.Column("config_json", sa.Text(), nullable=False),
        sa.Column("time_ms", sa.Float(), nullable=True),
        sa.Column("predicted_ms", sa.Float(), nullable=True),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("gbps", sa.Float(), nullable=True),
        sa.Column("pct_of_floor", sa.Float(), nullable=True),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("autossd_version", sa.String(32), nullable=False),
        sa.Column("template_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("notes", sa.String(256), nullable=False, server_default=""),
    )


def _json_value(name, v):
    """A problem column's value as JSON holds it: SQLite returns booleans as 0/1. Anything that
    is not what the field holds (a damaged row) is kept as near as JSON allows, for the reader to
    refuse, rather than made valid here."""
    if name in BOOL_FIELDS and type(v) is int and v in (0, 1):
        return bool(v)
    if v is None or type(v) in (bool, int, str):
        return v
    if type(v) is float:
        return v if math.isfinite(v) else str(v)
    return repr(v)


def _raw(conn, table, names):
    # sa.text: no type processing, so each value comes back as the backend stores it
    cols = ", ".join(f'"{c}"' for c in names)
    return [dict(r._mapping) for r in conn.execute(sa.text(f"SELECT {cols} FROM {table} ORDER BY id"))]


def _copy_rows(conn, table, rows):
    """Insert rows into `table` with no type processing (a damaged value goes in as it is)."""
    if rows:
        names = list(rows[0])
        conn.execute(sa.insert(sa.table(table.name, *[sa.column(c) for c in names])), rows)


def _finish(conn):
    # rows were copied with their ids: PostgreSQL's id sequence must continue after the largest
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{TABLE}', 'id'), "
                             f"COALESCE((SELECT MAX(id) FROM {TABLE}), 0) + 1, false)"))


def upgrade() -> None:
    conn = op.get_bind()
    new = _new_table("tuned_records_v15")
    new.create(conn)
    rows = []
    for r in _raw(conn, TABLE, COMMON + PROBLEM_FIELDS):
        problem = {f: _json_value(f, r[f]) for f in PROBLEM_FIELDS}
        dtype = r["dtype"] if type(r["dtype"]) is str else str(r["dtype"])
        rows.append({**{c: r[c] for c in COMMON}, "dtype": dtype[:16],
                     "problem_json": json.dumps(problem, sort_keys=True)})
    _copy_rows(conn, new, rows)
    op.drop_index("ix_tuned_records_lookup", table_name=TABLE)
    op.drop_table(TABLE)
    op.rename_table("tuned_records_v15", TABLE)
    op.create_index("ix_tuned_records_lookup", TABLE, ["op", "arch", "dtype"])
    _finish(conn)


def _old_table(name):
    cols = [sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
            sa.Column("op", sa.String(16), nullable=False),
            sa.Column("arch", sa.String(16), nullable=False),
            sa.Column("device", sa.String(128), nullable=False)]
    for f in PROBLEM_FIELDS:
        typ = sa.Boolean() if f in BOOL_FIELDS else sa.String(32) if f == "dtype" else sa.Integer()
        cols.append(sa.Column(f, typ, nullable=f == "chunk_size"))
    cols += [sa.Column(f"cfg_{k}", t, nullable=False) for k, t in KNOBS_14.items()]
    cols += [sa.Column("config_json", sa.Text(), nullable=False),
             sa.Column("time_ms", sa.Float(), nullable=True),
             sa.Column("provenance", sa.String(16), nullable=False),
             sa.Column("triton_version", sa.String(64), nullable=False),
             sa.Column("autossd_version", sa.String(32), nullable=False),
             sa.Column("template_hash", sa.String(64), nullable=False),
             sa.Column("created_at", sa.String(32), nullable=False),
             sa.Column("host", sa.String(255), nullable=False),
             sa.Column("tflops", sa.Float(), nullable=True),
             sa.Column("gbps", sa.Float(), nullable=True),
             sa.Column("pct_of_floor", sa.Float(), nullable=True),
             sa.Column("predicted_ms", sa.Float(), nullable=True),
             sa.Column("notes", sa.String(256), nullable=False, server_default=""),
             sa.Column("launch_mode", sa.String(8), nullable=False, server_default="eager")]
    return sa.Table(name, sa.MetaData(), *cols)


def _object(text):
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def downgrade() -> None:
    # Schema 14 has a column per knob of its time and per problem field: a row whose config names
    # any other knob (one added later, with no schema of its own), lacks one of them, or whose
    # JSON does not parse cannot be expressed there and is dropped, as the knob schemas'
    # downgrades drop what their older schema cannot say.
    conn = op.get_bind()
    old = _old_table("tuned_records_v14")
    old.create(conn)
    rows = []
    for r in _raw(conn, TABLE, COMMON + ("problem_json",)):
        problem, cfg = _object(r["problem_json"]), _object(r["config_json"])
        if problem is None or cfg is None or set(cfg) != set(KNOBS_14) or set(problem) != set(PROBLEM_FIELDS):
            continue
        rows.append({**{c: r[c] for c in COMMON}, **problem,
                     **{f"cfg_{k}": v for k, v in cfg.items()}})
    _copy_rows(conn, old, rows)
    op.drop_index("ix_tuned_records_lookup", table_name=TABLE)
    op.drop_table(TABLE)
    op.rename_table("tuned_records_v14", TABLE)
    op.create_index("ix_tuned_records_lookup", TABLE, ["op", "arch", "dtype", "headdim", "dstate"])
    _finish(conn)
