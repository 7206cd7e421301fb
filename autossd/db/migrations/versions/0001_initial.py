"""Schema 1: tuned records (problem key, config knobs, time, provenance).

Frozen snapshot of the model as of this revision: do not derive it from models.py.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tuned_records",
        sa.Column('id', sa.Integer(), nullable=False, primary_key=True, autoincrement=True),
        sa.Column('op', sa.String(16), nullable=False),
        sa.Column('arch', sa.String(16), nullable=False),
        sa.Column('device', sa.String(128), nullable=False),
        sa.Column('batch', sa.Integer(), nullable=False),
        sa.Column('seqlen', sa.Integer(), nullable=False),
        sa.Column('nheads', sa.Integer(), nullable=False),
        sa.Column('headdim', sa.Integer(), nullable=False),
        sa.Column('dstate', sa.Integer(), nullable=False),
        sa.Column('ngroups', sa.Integer(), nullable=False),
        sa.Column('dtype', sa.String(32), nullable=False),
        sa.Column('chunk_size', sa.Integer(), nullable=True),
        sa.Column('has_D', sa.Boolean(), nullable=False),
        sa.Column('D_has_hdim', sa.Boolean(), nullable=False),
        sa.Column('has_z', sa.Boolean(), nullable=False),
        sa.Column('has_dt_bias', sa.Boolean(), nullable=False),
        sa.Column('dt_softplus', sa.Boolean(), nullable=False),
        sa.Column('has_dt_limit', sa.Boolean(), nullable=False),
        sa.Column('has_initial_states', sa.Boolean(), nullable=False),
        sa.Column('has_seq_idx', sa.Boolean(), nullable=False),
        sa.Column('return_final_states', sa.Boolean(), nullable=False),
        sa.Column('return_varlen_states', sa.Boolean(), nullable=False),
        sa.Column('cfg_launches', sa.Integer(), nullable=False),
        sa.Column('cfg_chunk_size', sa.Integer(), nullable=False),
        sa.Column('cfg_state_dtype', sa.String(32), nullable=False),
        sa.Column('cfg_cumsum_block_h', sa.Integer(), nullable=False),
        sa.Column('cfg_bmm_block_m', sa.Integer(), nullable=False),
        sa.Column('cfg_bmm_block_n', sa.Integer(), nullable=False),
        sa.Column('cfg_bmm_block_k', sa.Integer(), nullable=False),
        sa.Column('cfg_bmm_warps', sa.Integer(), nullable=False),
        sa.Column('cfg_bmm_stages', sa.Integer(), nullable=False),
        sa.Column('cfg_state_block_m', sa.Integer(), nullable=False),
        sa.Column('cfg_state_block_n', sa.Integer(), nullable=False),
        sa.Column('cfg_state_block_k', sa.Integer(), nullable=False),
        sa.Column('cfg_state_warps', sa.Integer(), nullable=False),
        sa.Column('cfg_state_stages', sa.Integer(), nullable=False),
        sa.Column('cfg_pass_block', sa.Integer(), nullable=False),
        sa.Column('cfg_pass_warps', sa.Integer(), nullable=False),
        sa.Column('cfg_scan_block_m', sa.Integer(), nullable=False),
        sa.Column('cfg_scan_block_n', sa.Integer(), nullable=False),
        sa.Column('cfg_scan_block_k', sa.Integer(), nullable=False),
        sa.Column('cfg_scan_block_d', sa.Integer(), nullable=False),
        sa.Column('cfg_scan_warps', sa.Integer(), nullable=False),
        sa.Column('cfg_scan_stages', sa.Integer(), nullable=False),
        sa.Column('cfg_waves_per_eu', sa.Integer(), nullable=False),
        sa.Column('cfg_matrix_instr_nonkdim', sa.Integer(), nullable=False),
        sa.Column('cfg_kpack', sa.Integer(), nullable=False),
        sa.Column('config_json', sa.Text(), nullable=False),
        sa.Column('time_ms', sa.Float(), nullable=True),
        sa.Column('provenance', sa.String(16), nullable=False),
        sa.Column('triton_version', sa.String(64), nullable=False),
        sa.Column('autossd_version', sa.String(32), nullable=False),
        sa.Column('template_hash', sa.String(64), nullable=False),
        sa.Column('created_at', sa.String(32), nullable=False),
        sa.Column('host', sa.String(255), nullable=False),
    )
    op.create_index("ix_tuned_records_lookup", "tuned_records", ["op", "arch", "dtype", "headdim", "dstate"])


def downgrade() -> None:
    op.drop_index("ix_tuned_records_lookup", table_name="tuned_records")
    op.drop_table("tuned_records")
