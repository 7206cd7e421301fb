"""Schema 8: the pass_chunks knob (state passing over several chunks per step, by a scan).

Rows written before it passed the states one chunk per step, i.e. pass_chunks = 1: the column
defaults to 1 and each row's canonical config_json gains "pass_chunks": 1, so it still
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
        batch.add_column(sa.Column("cfg_pass_chunks", sa.Integer(), nullable=False, server_default="1"))
    _rewrite_config_json(lambda cfg: cfg.setdefault("pass_chunks", 1))
    # the column follows the JSON, so a row whose JSON already names the knob stays consistent
    conn = op.get_bind()
    for rid, text in conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall():
        conn.execute(sa.text("UPDATE tuned_records SET cfg_pass_chunks = :v WHERE id = :i"),
                     {"v": int(json.loads(text)["pass_chunks"]), "i": rid})


def downgrade() -> None:
    # a scanned-passing record cannot be expressed without the knob: keeping it would relabel
    # one kernel's time as another's
    op.execute("DELETE FROM tuned_records WHERE cfg_pass_chunks != 1")
    _rewrite_config_json(lambda cfg: cfg.pop("pass_chunks", None))
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("cfg_pass_chunks")
