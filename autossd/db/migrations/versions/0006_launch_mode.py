"""Schema 6: launch_mode, what a record's time was measured under ("eager" / "graph" / "any").

Rows written before it were measured by eager calls (the tuner timed with do_bench), or are
predictions of GPU time (static, default), which stand for both modes: "eager" for measured
rows, "any" for the others.

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tuned_records") as batch:
        batch.add_column(sa.Column("launch_mode", sa.String(8), nullable=False, server_default="eager"))
    op.execute("UPDATE tuned_records SET launch_mode = 'any' WHERE provenance != 'measured'")


def downgrade() -> None:
    # without the column a graph-replay time would read as an eager one: drop those rows
    op.execute("DELETE FROM tuned_records WHERE launch_mode = 'graph'")
    with op.batch_alter_table("tuned_records") as batch:
        batch.drop_column("launch_mode")
