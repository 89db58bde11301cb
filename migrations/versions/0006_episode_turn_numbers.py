"""Episode turns keep their number and stay after they are logged.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

``episode_turns.turn``: the turn's number, once per episode (unique with ``episode_id``), so
the server refuses a duplicate or out-of-order turn; ``logged_at``: NULL while the turn is in
flight, set when its record is indexed (the row used to be deleted then). The numbered turns
already in the trajectory index are backfilled as logged, one trajectory per number (the
first id). Rows in flight at the upgrade keep no number and stop counting after the server's
turn timeout.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("episode_turns") as batch:
        batch.add_column(sa.Column("turn", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("logged_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_unique_constraint(op.f("uq_episode_turns_episode_id"), ["episode_id", "turn"])
    op.execute(
        "INSERT INTO episode_turns (trajectory_id, episode_id, dispatched_at, turn, logged_at) "
        "SELECT MIN(id), episode_id, MIN(created_at), turn, MIN(created_at) FROM trajectory_index "
        "WHERE episode_id IS NOT NULL AND turn IS NOT NULL GROUP BY episode_id, turn"
    )


def downgrade() -> None:
    # Before 0006 a row meant "in flight": logged turns had none.
    op.execute("DELETE FROM episode_turns WHERE logged_at IS NOT NULL")
    with op.batch_alter_table("episode_turns") as batch:
        batch.drop_constraint(op.f("uq_episode_turns_episode_id"), type_="unique")
        batch.drop_column("logged_at")
        batch.drop_column("turn")
