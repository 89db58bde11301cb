"""The first record a feedback claim was taken over from.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06

``feedback_claims.superseded_id``: when a claim left ``claimed`` past ``core.claims.CLAIM_TIMEOUT``
is taken over by a later record, the id of the first record it held (issue 40 item 9). That
record's request may have answered 202 and lost its mark (a database blip, then a restart): if
the record is in the log, the joiner trains it and not the later one, so the first accepted
rating wins. Null for every claim made before the upgrade, and for claims never taken over.
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("feedback_claims") as batch:
        batch.add_column(sa.Column("superseded_id", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("feedback_claims") as batch:
        batch.drop_column("superseded_id")
