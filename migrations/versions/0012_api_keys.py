"""API keys of tenants, and the identity of each waiting learner sample.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05

``api_keys``: one row per key (``core/keys.py``; docs/tenants.md): its public id, its tenant,
the sha256 of the key (never the key) and when it was created and revoked (NULL while valid).
``learner_samples.identity``: who sent the sample (``key:<key id>`` or ``user:<user field>``),
what the learner's identity cap counts (learner/data/identity_cap.py); NULL for the samples waiting
at the upgrade, which the cap treats as anonymous, each its own identity.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("key_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    op.create_index(op.f("ix_api_keys_tenant"), "api_keys", ["tenant"])
    with op.batch_alter_table("learner_samples") as batch:
        batch.add_column(sa.Column("identity", sa.String(261), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("learner_samples") as batch:
        batch.drop_column("identity")
    op.drop_index(op.f("ix_api_keys_tenant"), table_name="api_keys")
    op.drop_table("api_keys")
