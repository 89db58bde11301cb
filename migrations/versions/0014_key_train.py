"""The training opt-out of an API key.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07

``api_keys.train``: false when the key opts out of training (``core/keys.py``; docs/privacy.md,
"A key that opts out"): every trajectory its requests send is logged marked ``train: false``, as
``store: false`` marks one request's. Server default true, so the keys made before the upgrade
keep training, as they did.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("train", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("train")
