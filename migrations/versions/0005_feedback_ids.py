"""Feedback claims hold the id of the record they confirm.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30

``feedback_claims.feedback_id``: the id of the feedback record (request) holding the claim;
once the claim is marked received (its record is in the log) the joiner trains only the record
with this id, so a record the server answered 503 for, appended late by the log, is void. Null
for claims taken before this revision.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("feedback_claims") as batch:
        batch.add_column(sa.Column("feedback_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("feedback_claims") as batch:
        batch.drop_column("feedback_id")
