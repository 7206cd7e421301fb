"""Schema 6: the state_walk knob (depth 3: the state kernel walks the chunks).

Rows written before it used the ordered hand-off, i.e. state_walk = false: the column
defaults to false and each row's canonical config_json gains "state_walk": false, so it still
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
        batch.add_column(sa.Column("cfg_state_walk", sa.Boolean(), nullable=False, server_default=sa.false()))
    _rewrite_config_json(lambda cfg: cfg.setdefault("state_walk", False))
    # the column follows the JSON, so a row whose JSON already names the knob stays consistent
    conn = op.get_bind()
    for rid, text in conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall():
        conn.execute(sa.text("UPDATE tuned_records SET cfg_state_walk = :v WHERE id = :i"),
                     {"v": bool(json.loads(text)["state_walk"]), "i": rid})


def downgrade() -> None:
    # a walking record cannot be expressed without the knob: dropping it would relabel
    # one kernel's time as another's
    op.execute("DELETE FROM tuned_records WHERE cfg_state_walk")
    _rewrite_config_json(lambda cfg: cfg.pop("state_walk", None))
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("cfg_state_walk")
