"""Initial schema: runs, model_versions, sessions.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Create the three registry tables."""
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
    )
    op.create_table(
        "model_versions",
        sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("path", sa.String(1024), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column(
            "run_id",
            sa.Integer(),
            sa.ForeignKey("runs.id", name="fk_model_versions_run_id", ondelete="SET NULL"),
            nullable=True,
        ),
    )
    op.create_index("ix_model_versions_run_id", "model_versions", ["run_id"])
    op.create_table(
        "sessions",
        sa.Column("session_id", sa.String(255), primary_key=True),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False),
        sa.Column("main_turns", sa.Integer(), nullable=False),
        sa.Column("side_turns", sa.Integer(), nullable=False),
        sa.Column("scored_turns", sa.Integer(), nullable=False),
        sa.Column("score_sum", sa.Float(), nullable=False),
        sa.Column("last_score", sa.Float(), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=True),
    )
    op.create_index("ix_sessions_tenant", "sessions", ["tenant"])


def downgrade() -> None:
    """Drop the three registry tables."""
    op.drop_index("ix_sessions_tenant", table_name="sessions")
    op.drop_table("sessions")
    op.drop_index("ix_model_versions_run_id", table_name="model_versions")
    op.drop_table("model_versions")
    op.drop_table("runs")
