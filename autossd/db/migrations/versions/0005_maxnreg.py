"""Schema 5: the register-cap knobs state_maxnreg and scan_maxnreg (ptxas -maxnreg; CUDA only).

Rows written before it ran without a cap, i.e. 0: both columns default to 0 and each row's
canonical config_json gains the two keys at 0, so it still matches its knob columns.

Revision ID: 0005
Revises: 0004
"""
import json

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

KNOBS = ("state_maxnreg", "scan_maxnreg")


# A migration is a frozen snapshot: it carries its own copy of this helper (as 0003 does) rather
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
        for k in KNOBS:
            batch.add_column(sa.Column(f"cfg_{k}", sa.Integer(), nullable=False, server_default="0"))

    def add(cfg):
        for k in KNOBS:
            cfg.setdefault(k, 0)
    _rewrite_config_json(add)
    # the columns follow the JSON, so a row whose JSON already names a knob stays consistent
    conn = op.get_bind()
    for rid, text in conn.execute(sa.text("SELECT id, config_json FROM tuned_records")).fetchall():
        cfg = _config_of(text)
        try:
            vals = {"s": int(cfg["state_maxnreg"]), "c": int(cfg["scan_maxnreg"]), "i": rid}
        except (TypeError, ValueError, OverflowError):   # no config, or no int (inf): left as it is
            continue
        conn.execute(sa.text("UPDATE tuned_records SET cfg_state_maxnreg = :s, cfg_scan_maxnreg = :c "
                             "WHERE id = :i"), vals)


def downgrade() -> None:
    # a capped record cannot be expressed without the knobs: dropping them would relabel one
    # kernel's time as another's
    op.execute("DELETE FROM tuned_records WHERE cfg_state_maxnreg != 0 OR cfg_scan_maxnreg != 0")

    def drop(cfg):
        for k in KNOBS:
            cfg.pop(k, None)
    _rewrite_config_json(drop)
    with op.batch_alter_table("tuned_records") as batch:
        for k in KNOBS:
            batch.drop_column(f"cfg_{k}")
