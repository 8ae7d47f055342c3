"""A version's measures name its tenant, so they outlive its pruned row and still go with
the tenant's deletion.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Add version_quality.tenant (indexed), filled in from the versions still recorded."""
    with op.batch_alter_table("version_quality") as batch:
        batch.add_column(sa.Column("tenant", sa.String(128), nullable=True))
        batch.create_index("ix_version_quality_tenant", ["tenant"])
    op.execute(
        "UPDATE version_quality SET tenant = (SELECT model_versions.tenant FROM model_versions "
        "WHERE model_versions.version = version_quality.version)"
    )


def downgrade() -> None:
    """Drop what upgrade added."""
    with op.batch_alter_table("version_quality") as batch:
        batch.drop_index("ix_version_quality_tenant")
        batch.drop_column("tenant")
