"""Prompt evidence: per-prompt event-time value evidence (SPO++, docs/design.md §5.4).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

One row per prompt. The prior (``alpha0``, ``beta0`` at ``prior_version``) and the online
evidence (``alpha_ref``, ``beta_ref``, the sum of ρ-decayed results expressed at
``ref_version``, the newest result version) are kept apart, so results update only the online
columns and offline initialisation only the prior columns (``offline_n`` NULL: the default
prior, not initialised offline). ``core/evidence_store.py`` documents the arithmetic and the
concurrency argument.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "prompt_evidence",
        sa.Column("prompt_id", sa.String(128), nullable=False),
        sa.Column("alpha0", sa.Float(), nullable=False),
        sa.Column("beta0", sa.Float(), nullable=False),
        sa.Column("prior_version", sa.Integer(), nullable=False),
        sa.Column("alpha_ref", sa.Float(), nullable=False),
        sa.Column("beta_ref", sa.Float(), nullable=False),
        sa.Column("ref_version", sa.Integer(), nullable=False),
        sa.Column("n_results", sa.BigInteger(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=False),
        sa.Column("offline_n", sa.Integer(), nullable=True),
        sa.Column("offline_successes", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("prompt_id", name=op.f("pk_prompt_evidence")),
    )


def downgrade() -> None:
    op.drop_table("prompt_evidence")
