"""The guard's version lifecycle: each version's stage, its transitions, quarantined samples.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04

``policy_versions.lifecycle``: ``candidate`` | ``canary`` | ``promoted`` | ``rejected``
(``core/lifecycle.py``; docs/guard.md, "The lifecycle"); every existing version, version 0
included, was served unguarded and becomes ``promoted``. ``policy_versions.gate``: the gate's
figures (``learner.guard.gate.GateResult`` as JSON; NULL when no gate ran). ``version_status_events``:
one row per transition, with who made it (``learner``, ``guard`` or an operator's name), why and
when. ``quarantined_samples``: one row per sample id that trained a rejected version, which the
learner never trains again. The lifecycle is a separate column from ``status`` (``committed`` |
``published``: whether the version's policy event is out), which it does not replace.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("policy_versions") as batch:
        batch.add_column(sa.Column("lifecycle", sa.String(16), nullable=False, server_default="promoted"))
        batch.add_column(sa.Column("gate", sa.JSON(), nullable=True))
    op.create_table(
        "version_status_events",
        sa.Column("id", RowId, autoincrement=True, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("from_status", sa.String(16), nullable=True),
        sa.Column("to_status", sa.String(16), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_version_status_events")),
    )
    op.create_index(op.f("ix_version_status_events_version"), "version_status_events", ["version"])
    op.create_table(
        "quarantined_samples",
        sa.Column("sample_id", sa.String(160), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sample_id", name=op.f("pk_quarantined_samples")),
    )


def downgrade() -> None:
    op.drop_table("quarantined_samples")
    op.drop_index(op.f("ix_version_status_events_version"), table_name="version_status_events")
    op.drop_table("version_status_events")
    with op.batch_alter_table("policy_versions") as batch:
        batch.drop_column("gate")
        batch.drop_column("lifecycle")
