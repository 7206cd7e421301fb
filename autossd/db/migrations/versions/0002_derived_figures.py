"""Schema 2: derived figures (TFLOP/s, GB/s, % of floor), the static model's prediction, notes.

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_FLOATS = ("tflops", "gbps", "pct_of_floor", "predicted_ms")


def upgrade() -> None:
    # batch mode: SQLite cannot ALTER most things in place; add_column alone would do, but
    # batch keeps later revisions uniform
    with op.batch_alter_table("tuned_records") as batch:
        for name in _FLOATS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.add_column(sa.Column("notes", sa.String(256), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("tuned_records") as batch:
        for name in ("notes",) + _FLOATS:
            batch.drop_column(name)
