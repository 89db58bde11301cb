"""Initial schema: trajectory index, SQL-table log, policy versions, offsets, joins, steps.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "trajectory_index",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("prompt_id", sa.String(128), nullable=False),
        sa.Column("episode_id", sa.String(128), nullable=True),
        sa.Column("turn", sa.Integer(), nullable=True),
        sa.Column("dispatch_version", sa.Integer(), nullable=False),
        sa.Column("last_version", sa.Integer(), nullable=False),
        sa.Column("n_response_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=False),
        sa.Column("log_partition", sa.Integer(), nullable=False),
        sa.Column("log_offset", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trajectory_index")),
    )
    op.create_table(
        "feedback_claims",
        sa.Column("target", sa.String(160), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("target", name=op.f("pk_feedback_claims")),
    )
    op.create_index(op.f("ix_trajectory_index_prompt_id"), "trajectory_index", ["prompt_id"])
    op.create_index(op.f("ix_trajectory_index_episode_id"), "trajectory_index", ["episode_id"])
    op.create_table(
        "log_records",
        sa.Column("id", RowId, autoincrement=True, nullable=False),
        sa.Column("topic", sa.String(64), nullable=False),
        sa.Column("key", sa.String(128), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_log_records")),
    )
    op.create_index("ix_log_records_topic_id", "log_records", ["topic", "id"])
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("parent_version", sa.Integer(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_policy_versions")),
    )
    op.create_table(
        "consumer_offsets",
        sa.Column("consumer", sa.String(64), nullable=False),
        sa.Column("topic", sa.String(64), nullable=False),
        sa.Column("partition", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("consumer", "topic", "partition", name=op.f("pk_consumer_offsets")),
    )
    op.create_table(
        "pending_joins",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("prompt_id", sa.String(128), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", "kind", name=op.f("pk_pending_joins")),
    )
    op.create_table(
        "learner_steps",
        sa.Column("id", RowId, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_learner_steps")),
    )


def downgrade() -> None:
    op.drop_table("learner_steps")
    op.drop_table("pending_joins")
    op.drop_table("consumer_offsets")
    op.drop_table("policy_versions")
    op.drop_table("feedback_claims")
    op.drop_index("ix_log_records_topic_id", table_name="log_records")
    op.drop_table("log_records")
    op.drop_index(op.f("ix_trajectory_index_episode_id"), table_name="trajectory_index")
    op.drop_index(op.f("ix_trajectory_index_prompt_id"), table_name="trajectory_index")
    op.drop_table("trajectory_index")
