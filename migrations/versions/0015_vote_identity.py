"""Who sent each trajectory, and whether it may train, in the index the guard reads.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06

``trajectory_index.identity`` (``TrajectoryRecord.identity``: ``key:<key id>`` or
``user:<user field>``) and ``trajectory_index.train`` (the record's ``train`` flag): the guard's
rating and health streams pass the identity cap and leave out opted-out answers
(``learner.guard_votes``; docs/guard.md, "Who votes"). Both NULL for trajectories logged before
the upgrade: an unknown identity, which does not vote while the cap is on.
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trajectory_index") as batch:
        batch.add_column(sa.Column("identity", sa.String(261), nullable=True))
        batch.add_column(sa.Column("train", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trajectory_index") as batch:
        batch.drop_column("train")
        batch.drop_column("identity")
