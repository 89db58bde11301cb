"""The list of tenant policies, kept in the database.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06

``tenant_policies``: one row per tenant with a policy of its own (issue 39 item 3;
``core.tenant_store``; docs/tenants.md, "Adding and removing a tenant policy"): its name and when
it was added, and when the admin route removed it (``removed_at``; None while it is served). A
removed name stays, so forget and retention still reach the namespace it leaves behind. Every
process seeds it from ``SAOSERVE_TENANT_POLICIES`` at start (names absent
are added); the admin route adds and removes names at run time. Empty at the upgrade: the first
start after it copies the setting in. Only the global database's table is read; a tenant
namespace's stays empty.
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_policies",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("added_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("removed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tenant_policies")),
    )


def downgrade() -> None:
    op.drop_table("tenant_policies")
