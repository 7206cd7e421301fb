"""Schema 6: the scan_early knob (chunk scan: the diagonal block's tiles loaded first).

Rows written before it loaded the diagonal block in order, i.e. scan_early = false: the column
defaults to false and each row's canonical config_json gains "scan_early": false, so it still
matches its knob columns. (Their kernel hashes stay valid: with the knob off the rendered code
is what it was, and the hash leaves out the header line naming the config.)

Revision ID: 0006
Revises: 0005
"""
import json

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
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
        batch.add_column(sa.Column("cfg_scan_early", sa.Boolean(), nullable=False, server_default=sa.false()))
    _rewrite_config_json(lambda cfg: cfg.setdefault("scan_early", False))
    # the column follows the JSON, so a row whose JSON already names the knob stays consistent
    conn = op.get_bind()
    for rid, text in conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall():
        conn.execute(sa.text("UPDATE tuned_records SET cfg_scan_early = :v WHERE id = :i"),
                     {"v": bool(json.loads(text)["scan_early"]), "i": rid})


def downgrade() -> None:
    # an early-load record cannot be expressed without the knob: dropping it would relabel
    # one kernel's time as another's
    op.execute("DELETE FROM tuned_records WHERE cfg_scan_early")
    _rewrite_config_json(lambda cfg: cfg.pop("scan_early", None))
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("cfg_scan_early")
