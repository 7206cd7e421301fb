"""Schema 3: the smem_pad knob (shared-memory pad of the Gluon chunk-state kernel).

Rows written before it were tuned with the tl kernel, i.e. smem_pad = 0: the column defaults to 0
and each row's canonical config_json gains "smem_pad": 0, so it still matches its knob columns.

Revision ID: 0003
Revises: 0002
"""
import json

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


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
        batch.add_column(sa.Column("cfg_smem_pad", sa.Integer(), nullable=False, server_default="0"))
    _rewrite_config_json(lambda cfg: cfg.setdefault("smem_pad", 0))


def downgrade() -> None:
    # a padded config's record cannot be expressed without the knob: dropping the pad would
    # relabel a Gluon kernel's time as the tl kernel's
    op.execute("DELETE FROM tuned_records WHERE cfg_smem_pad != 0")
    _rewrite_config_json(lambda cfg: cfg.pop("smem_pad", None))
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("cfg_smem_pad")
