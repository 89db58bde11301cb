"""Forget reaches every copy: who sent each indexed trajectory, the data keys of a log that keeps
records, and forget requests with their receipts.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06

``trajectory_index.identity``: ``key:<key id>`` or ``user:<user>`` (``TrajectoryRecord.identity``),
what ``saoserve admin forget --key`` looks up; NULL for the rows indexed before the upgrade (a
SQL-table log's forget still finds their records by reading the log itself, docs/privacy.md).
``subject_keys``: one data key per (API key, user) subject sealing its trajectory records in a
Kafka log (``core/sealing.py``); a forget destroys it. ``forget_requests``: each forget, recorded
before it is carried out, with the receipt of what it removed (``core/forget.py``).

The prompt evidence rows keyed by a client's own ``prompt_id`` before the upgrade keep that key:
the keyed hash needs the server's secret, which a migration does not have. A forget re-keys the
rows of the prompts it touches (docs/privacy.md, "Prompt ids").
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
        batch.create_index(batch.f("ix_trajectory_index_identity"), ["identity"])
    op.create_table(
        "subject_keys",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(64), nullable=True),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("user_id", sa.String(256), nullable=True),
        sa.Column("secret", sa.LargeBinary(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("destroyed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_subject_keys")),
        sa.UniqueConstraint("holder", name=op.f("uq_subject_keys_holder")),
    )
    op.create_index(op.f("ix_subject_keys_key_id"), "subject_keys", ["key_id"])
    op.create_index(op.f("ix_subject_keys_user_id"), "subject_keys", ["user_id"])
    op.create_table(
        "forget_requests",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("subject", sa.String(256), nullable=True),
        sa.Column("subject_hash", sa.String(64), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("receipt", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_forget_requests")),
    )
    op.create_index(op.f("ix_forget_requests_subject_hash"), "forget_requests", ["subject_hash"])


def downgrade() -> None:
    op.drop_index(op.f("ix_forget_requests_subject_hash"), table_name="forget_requests")
    op.drop_table("forget_requests")
    op.drop_index(op.f("ix_subject_keys_user_id"), table_name="subject_keys")
    op.drop_index(op.f("ix_subject_keys_key_id"), table_name="subject_keys")
    op.drop_table("subject_keys")
    with op.batch_alter_table("trajectory_index") as batch:
        batch.drop_index(batch.f("ix_trajectory_index_identity"))
        batch.drop_column("identity")
