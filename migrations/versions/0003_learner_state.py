"""Learner state: joined samples, counters, operator control flags.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "learner_samples",
        sa.Column("id", sa.String(160), nullable=False),
        sa.Column("prompt_id", sa.String(128), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_learner_samples")),
    )
    op.create_table(
        "learner_counters",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_learner_counters")),
    )
    op.create_table(
        "control_flags",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_control_flags")),
    )


def downgrade() -> None:
    op.drop_table("control_flags")
    op.drop_table("learner_counters")
    op.drop_table("learner_samples")
