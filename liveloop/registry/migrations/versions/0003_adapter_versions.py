"""Versions published as adapters: which adapter, and whose (tenant scope).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Add model_versions.adapter and model_versions.tenant (indexed)."""
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("adapter", sa.String(128), nullable=True))
        batch.add_column(sa.Column("tenant", sa.String(128), nullable=True))
        batch.create_index("ix_model_versions_tenant", ["tenant"])


def downgrade() -> None:
    """Drop what upgrade added."""
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_index("ix_model_versions_tenant")
        batch.drop_column("tenant")
        batch.drop_column("adapter")
