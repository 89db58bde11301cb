"""Privacy: whose trajectory it is, tombstones of forgotten records, log ids that never go back.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

``trajectory_index.user_id``: the request's ``user`` field (indexed), which ``saoserve admin
forget`` looks up; NULL for trajectories indexed before this revision. ``forgotten_records``:
one row per forgotten trajectory id or ``e:<episode id>``, which the learner checks for every
record it reads (docs/privacy.md). ``log_records`` on SQLite becomes AUTOINCREMENT (the table is
copied): a rowid table otherwise hands out the largest id left plus one, so after retention or
forget deleted the newest rows a new record could get an id below a reader's committed offset
and never be read. PostgreSQL's sequence never goes back already.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _log_autoincrement(on: bool) -> None:
    if op.get_bind().dialect.name == "sqlite":
        with op.batch_alter_table(
            "log_records", recreate="always", table_kwargs={"sqlite_autoincrement": on}
        ):
            pass


def upgrade() -> None:
    with op.batch_alter_table("trajectory_index") as batch:
        batch.add_column(sa.Column("user_id", sa.String(256), nullable=True))
        batch.create_index(op.f("ix_trajectory_index_user_id"), ["user_id"])
    op.create_table(
        "forgotten_records",
        sa.Column("key", sa.String(160), nullable=False),
        sa.Column("forgotten_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_forgotten_records")),
    )
    _log_autoincrement(True)


def downgrade() -> None:
    _log_autoincrement(False)
    op.drop_table("forgotten_records")
    with op.batch_alter_table("trajectory_index") as batch:
        batch.drop_index(op.f("ix_trajectory_index_user_id"))
        batch.drop_column("user_id")
