"""Pending-join keys as wide as the keys the learner makes.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03

``pending_joins.key`` was 64 characters, while an episode's tombstone key is ``e:`` + its
episode id, which the edge takes up to 128 characters: on PostgreSQL one episode id over 62
characters made every join commit fail, for good. The key takes 160 characters now, as
``feedback_claims.target`` and ``learner_samples.id`` do (``core.limits.KEY_CHARS``).
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("pending_joins") as batch:
        batch.alter_column("key", existing_type=sa.String(64), type_=sa.String(160), existing_nullable=False)


def downgrade() -> None:
    # Rows with a longer key could not be written before this revision: their joins are lost.
    op.execute("DELETE FROM pending_joins WHERE LENGTH(key) > 64")
    with op.batch_alter_table("pending_joins") as batch:
        batch.alter_column("key", existing_type=sa.String(160), type_=sa.String(64), existing_nullable=False)
