"""Schema 16: one row per record key, enforced by a unique index.

Re-running a finished tune, or two identical tunes at once, used to add the same record again.
The key is (op, arch, device, launch_mode, provenance, problem_json, config_json); the writer now
keeps the better row of a key (made by the same code: the smaller time, measured or predicted;
by other code: the newer). Rows of a key that an older writer stored more than once are reduced
here to the one that writer's successor would have kept, taking them in the order stored: they
are copies of one record, and the index cannot be built over them.

Revision ID: 0016
Revises: 0015
"""
import logging

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

TABLE = "tuned_records"
INDEX = "ux_tuned_records_key"
# A migration is a frozen snapshot: the key and the rule are written out here.
KEY = ("op", "arch", "device", "launch_mode", "provenance", "problem_json", "config_json")


def _time(row):
    t = row["time_ms"] if row["time_ms"] is not None else row["predicted_ms"]
    return t if type(t) in (int, float) else None


def _replaces(new, old):
    if (new["triton_version"], new["template_hash"]) == (old["triton_version"], old["template_hash"]):
        nt, ot = _time(new), _time(old)
        return nt is not None and (ot is None or nt < ot)
    return str(new["created_at"]) > str(old["created_at"])


def upgrade() -> None:
    conn = op.get_bind()
    cols = ("id",) + KEY + ("time_ms", "predicted_ms", "triton_version", "template_hash", "created_at")
    rows = conn.execute(sa.text(f"SELECT {', '.join(cols)} FROM {TABLE} ORDER BY id")).fetchall()
    best, drop = {}, []
    for r in rows:
        r = r._mapping
        k = tuple(r[c] for c in KEY)
        if k not in best:
            best[k] = r
        elif _replaces(r, best[k]):
            drop.append(best[k]["id"])
            best[k] = r
        else:
            drop.append(r["id"])
    for rid in drop:
        conn.execute(sa.text(f"DELETE FROM {TABLE} WHERE id = :i"), {"i": rid})
    if drop:
        logging.getLogger("autossd.db").info("tuning db: %d duplicate record(s) removed", len(drop))
    op.create_index(INDEX, TABLE, list(KEY), unique=True)


def downgrade() -> None:
    op.drop_index(INDEX, table_name=TABLE)
