"""Dead letters: what the learner set aside, and why.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03

``dead_letters``: one row per record (or sample) the learner could not join, validate or train
after a bounded number of tries, or feedback that can never train (its trajectory expired first);
written in the transaction that moves the consumer offsets past the record (``core/dead_letters.py``,
docs/reliability.md).
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "dead_letters",
        sa.Column("id", RowId, autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("key", sa.String(160), nullable=True),
        sa.Column("prompt_id", sa.String(128), nullable=True),
        sa.Column("topic", sa.String(64), nullable=True),
        sa.Column("log_partition", sa.Integer(), nullable=True),
        sa.Column("log_offset", sa.BigInteger(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("payload", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
    )


def downgrade() -> None:
    op.drop_table("dead_letters")
