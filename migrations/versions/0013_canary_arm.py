"""The canary arm of each trajectory.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

``trajectory_index.arm``: ``canary`` or ``control`` when the request was served while a canary
share split the traffic between the candidate lineage and the promoted version
(``server.canary``; docs/guard.md, "The canary share"), NULL otherwise (probation, the guard
off, and every trajectory logged before the upgrade). The guard compares the two arms of one
time window when the lineage's window holds canary-arm answers.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trajectory_index") as batch:
        batch.add_column(sa.Column("arm", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trajectory_index") as batch:
        batch.drop_column("arm")
