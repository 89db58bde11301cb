"""Episodes: who started each episode, and its turns in flight.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

``episodes``: the first chat with a new episode id inserts the row (the primary key lets exactly
one of two racing first turns win); later turns must present the episode's token.
``episode_turns``: a turn dispatched and not yet indexed, so episode feedback can wait for it.
Episodes already in the trajectory index are backfilled as started.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "episodes",
        sa.Column("episode_id", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("episode_id", name=op.f("pk_episodes")),
    )
    op.create_table(
        "episode_turns",
        sa.Column("trajectory_id", sa.String(64), nullable=False),
        sa.Column("episode_id", sa.String(128), nullable=False),
        sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("trajectory_id", name=op.f("pk_episode_turns")),
    )
    op.create_index(op.f("ix_episode_turns_episode_id"), "episode_turns", ["episode_id"])
    op.execute(
        "INSERT INTO episodes (episode_id, created_at) "
        "SELECT episode_id, MIN(created_at) FROM trajectory_index "
        "WHERE episode_id IS NOT NULL GROUP BY episode_id"
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_episode_turns_episode_id"), table_name="episode_turns")
    op.drop_table("episode_turns")
    op.drop_table("episodes")
