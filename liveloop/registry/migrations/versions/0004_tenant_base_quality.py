"""Version 0's quality on each tenant's own traffic (tenant scope).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Add the tenant_base_quality table."""
    op.create_table(
        "tenant_base_quality",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("served", sa.JSON(), nullable=True),
        sa.Column("probe", sa.JSON(), nullable=True),
    )


def downgrade() -> None:
    """Drop what upgrade added."""
    op.drop_table("tenant_base_quality")
