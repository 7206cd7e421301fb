"""Schema 13: the walk_split knob (the Gluon walk cut into segments along the sequence).

Rows written before it walked each sequence whole, in one program per state tile, i.e.
walk_split = 1: the column defaults to 1 and each row's canonical config_json gains "walk_split": 1, so it still matches
its knob columns.

Revision ID: 0013
Revises: 0012
"""
import json

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


# A migration is a frozen snapshot: it carries its own copy of this helper (as 0007-0012 do) rather
# than importing code that later revisions may change.
def _config_of(text):
    """A row's config as a dict, or None for a row that is not one (a damaged or tampered row is
    left as it is: the reader rejects that row alone, instead of the migration failing and the
    whole database being ignored)."""
    try:
        cfg = json.loads(text)
    except (TypeError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _rewrite_config_json(edit) -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall()
    for rid, text in rows:
        cfg = _config_of(text)
        if cfg is None:
            continue
        edit(cfg)
        conn.execute(sa.text("UPDATE tuned_records SET config_json = :j WHERE id = :i"),
                     {"j": json.dumps(cfg, sort_keys=True), "i": rid})  # as Config.key() writes it


def upgrade() -> None:
    with op.batch_alter_table("tuned_records") as batch:
        batch.add_column(sa.Column("cfg_walk_split", sa.Integer(), nullable=False, server_default="1"))
    _rewrite_config_json(lambda cfg: cfg.setdefault("walk_split", 1))
    # the column follows the JSON, so a row whose JSON already names the knob stays consistent
    conn = op.get_bind()
    for rid, text in conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall():
        try:
            v = int(_config_of(text)["walk_split"])
        except (TypeError, ValueError, OverflowError):   # no config, or no int (inf): left as it is
            continue
        conn.execute(sa.text("UPDATE tuned_records SET cfg_walk_split = :v WHERE id = :i"), {"v": v, "i": rid})


def downgrade() -> None:
    # a walk_split record cannot be expressed without the knob: kept, its time would read as
    # the unsegmented walk
    op.execute("DELETE FROM tuned_records WHERE cfg_walk_split != 1")
    _rewrite_config_json(lambda cfg: cfg.pop("walk_split", None))
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("cfg_walk_split")
