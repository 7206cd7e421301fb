"""Schema 14: the walk_block knob (tokens per block of the Gluon walk's TMA ring).

Rows written before it ran the walk's ring in 128-token blocks, i.e. walk_block = 128: the column
defaults to 128 and each row's canonical config_json gains "walk_block": 128, so it still matches its
knob columns.

Revision ID: 0014
Revises: 0013
"""
import json

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


# A migration is a frozen snapshot: it carries its own copy of this helper (as 0007-0013 do) rather
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
        batch.add_column(sa.Column("cfg_walk_block", sa.Integer(), nullable=False, server_default="128"))
    _rewrite_config_json(lambda cfg: cfg.setdefault("walk_block", 128))
    # the column follows the JSON, so a row whose JSON already names the knob stays consistent
    conn = op.get_bind()
    for rid, text in conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall():
        try:
            v = int(_config_of(text)["walk_block"])
        except (TypeError, ValueError, OverflowError):   # no config, or no int (inf): left as it is
            continue
        conn.execute(sa.text("UPDATE tuned_records SET cfg_walk_block = :v WHERE id = :i"), {"v": v, "i": rid})


def downgrade() -> None:
    # a walk_block record cannot be expressed without the knob: kept, its time would read as
    # the 128-token ring's
    op.execute("DELETE FROM tuned_records WHERE cfg_walk_block != 128")
    _rewrite_config_json(lambda cfg: cfg.pop("walk_block", None))
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("cfg_walk_block")
