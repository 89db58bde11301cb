"""Keys the operator vouches for, which the identity caps do not bound.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06

``api_keys.trusted``: true for a key whose traffic the operator declares is many people's (a
backend relaying its users) or a judge's (``core/keys.py``; docs/guard.md, "Who votes"): the
identity caps on training batches and on the guard's votes do not bound it. False for every key
at the upgrade.
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("trusted", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("trusted")
