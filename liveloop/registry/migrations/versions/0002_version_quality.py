"""Version status (accepted or rejected by the promotion gate) and per-version quality.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Add model_versions.status/reason and the version_quality table."""
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(
            sa.Column("status", sa.String(16), nullable=False, server_default="accepted")
        )
        batch.add_column(sa.Column("reason", sa.String(2048), nullable=True))
    op.create_table(
        "version_quality",
        sa.Column("version", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("served", sa.JSON(), nullable=True),
        sa.Column("probe", sa.JSON(), nullable=True),
    )


def downgrade() -> None:
    """Drop what upgrade added."""
    op.drop_table("version_quality")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("reason")
        batch.drop_column("status")
