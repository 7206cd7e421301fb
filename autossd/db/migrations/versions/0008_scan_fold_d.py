"""Schema 7: the scan_fold_d knob (D·x through the diagonal of the chunk scan's weights).

Rows written before it ran the plain chunk scan, i.e. scan_fold_d = false: the column
defaults to false and each row's canonical config_json gains "scan_fold_d": false, so it still
matches its knob columns.

Revision ID: 0008
Revises: 0007
"""
import json

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


# A migration is a frozen snapshot: it carries its own copy of this helper (as 0003 does) rather
# than importing code that later revisions may change.
def _rewrite_config_json(edit) -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall()
    for rid, text in rows:
        cfg = json.loads(text)
        edit(cfg)
        conn.execute(sa.text("UPDATE tuned_records SET config_json = :j WHERE id = :i"),
                     {"j": json.dumps(cfg, sort_keys=True), "i": rid})  # as Config.key() writes it


def upgrade() -> None:
    with op.batch_alter_table("tuned_records") as batch:
        batch.add_column(sa.Column("cfg_scan_fold_d", sa.Boolean(), nullable=False, server_default=sa.false()))
    _rewrite_config_json(lambda cfg: cfg.setdefault("scan_fold_d", False))
    # the column follows the JSON, so a row whose JSON already names the knob stays consistent
    conn = op.get_bind()
    for rid, text in conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall():
        conn.execute(sa.text("UPDATE tuned_records SET cfg_scan_fold_d = :v WHERE id = :i"),
                     {"v": bool(json.loads(text)["scan_fold_d"]), "i": rid})


def downgrade() -> None:
    # a folded record cannot be expressed without the knob: dropping it would relabel one
    # kernel's time as another's
    op.execute("DELETE FROM tuned_records WHERE cfg_scan_fold_d")
    _rewrite_config_json(lambda cfg: cfg.pop("scan_fold_d", None))
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("cfg_scan_fold_d")
