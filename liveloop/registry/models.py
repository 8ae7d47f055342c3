"""SQLAlchemy ORM models of the registry: runs, model versions, their quality, sessions.

The schema itself is owned by the Alembic migrations in `liveloop/registry/migrations`;
these classes must stay in step with them (a test compares the two). Timestamps are
stored as timezone-aware UTC where the database supports it; SQLite hands them back
naive, which `liveloop.registry.store` normalises to UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    """The current time as a timezone-aware UTC datetime."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """Declarative base of every registry table."""


class Run(Base):
    """One run of a loop (a training run, a serving process, a demo...)."""

    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(64), nullable=False)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False, default=dict)
    status: Mapped[str] = mapped_column(String(32), nullable=False, default="running")


class ModelVersion(Base):
    """A policy version: the checkpoint on disk, where it came from, and how it scored.

    `parent` is a plain integer rather than a foreign key so that deleting an old version
    (checkpoint garbage collection) keeps the lineage of its descendants readable.
    """

    __tablename__ = "model_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    path: Mapped[str] = mapped_column(String(1024), nullable=False)
    parent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, nullable=False, default=dict)
    run_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("runs.id", ondelete="SET NULL"), nullable=True, index=True
    )
    status: Mapped[str] = mapped_column(
        String(16), nullable=False, default="accepted", server_default="accepted"
    )
    reason: Mapped[str | None] = mapped_column(String(2048), nullable=True)
    adapter: Mapped[str | None] = mapped_column(String(128), nullable=True)
    tenant: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)


class VersionQuality(Base):
    """Quality of a policy version: on the traffic it served, and on the gate's probes.

    Kept apart from `model_versions` so that pruning a checkpoint keeps its measures; so it
    names the version's tenant itself (its probe examples are that tenant's prompts, which
    the tenant's deletion must remove after the version's own row is gone).
    """

    __tablename__ = "version_quality"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    served: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    probe: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    tenant: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)


class TenantBaseQuality(Base):
    """Quality of version 0, the base, on one tenant's traffic alone (tenant scope).

    The base serves every tenant without an adapter, so its `version_quality` row mixes all
    tenants; a tenant's adapter is compared with this one.
    """

    __tablename__ = "tenant_base_quality"

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    served: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    probe: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ChatSession(Base):
    """A conversation seen by the server, with its turn counters and latest score."""

    __tablename__ = "sessions"

    session_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(255), nullable=False, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    turns: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    main_turns: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    side_turns: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    scored_turns: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    score_sum: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    last_score: Mapped[float | None] = mapped_column(Float, nullable=True)
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
