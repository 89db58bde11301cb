"""Whether each indexed trajectory may train, in the index the guard reads.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06

``trajectory_index.train`` (the record's ``train`` flag): the guard's rating and health streams
leave out opted-out answers and pass the identity cap by ``trajectory_index.identity`` (revision
0015) (``learner.guard.guard_votes``; docs/guard.md, "Who votes"). NULL for trajectories logged before
the upgrade, like their identity: an unknown identity, which does not vote while the cap is on.
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("trajectory_index") as batch:
        batch.add_column(sa.Column("train", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trajectory_index") as batch:
        batch.drop_column("train")
