"""From ORM rows to the registry's detached records (`liveloop.registry.info`).

Each function copies a row's columns out while its session is open, so the record can be
kept after the session closes.
"""

from __future__ import annotations

from datetime import UTC, datetime

from liveloop.contracts import VersionStatus
from liveloop.registry.info import ModelVersionInfo, RunInfo, SessionInfo, VersionQualityInfo
from liveloop.registry.models import (
    ChatSession,
    ModelVersion,
    Run,
    TenantBaseQuality,
    VersionQuality,
)


def aware(moment: datetime) -> datetime:
    """Treat naive datetimes (SQLite) as UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def run_info(row: Run) -> RunInfo:
    return RunInfo(
        id=row.id,
        kind=row.kind,
        started_at=aware(row.started_at),
        finished_at=aware(row.finished_at) if row.finished_at else None,
        config=dict(row.config or {}),
        status=row.status,
    )


def quality_info(version: int, row: VersionQuality | TenantBaseQuality) -> VersionQualityInfo:
    return VersionQualityInfo(
        version=version,
        updated_at=aware(row.updated_at),
        served=dict(row.served) if row.served is not None else None,
        probe=dict(row.probe) if row.probe is not None else None,
    )


def version_info(row: ModelVersion) -> ModelVersionInfo:
    return ModelVersionInfo(
        version=row.version,
        path=row.path,
        parent=row.parent,
        created_at=aware(row.created_at),
        metrics=dict(row.metrics or {}),
        run_id=row.run_id,
        status=VersionStatus(row.status),
        reason=row.reason,
        adapter=row.adapter,
        tenant=row.tenant,
    )


def session_info(row: ChatSession) -> SessionInfo:
    return SessionInfo(
        session_id=row.session_id,
        tenant=row.tenant,
        created_at=aware(row.created_at),
        last_seen_at=aware(row.last_seen_at),
        turns=row.turns,
        main_turns=row.main_turns,
        side_turns=row.side_turns,
        scored_turns=row.scored_turns,
        score_sum=row.score_sum,
        last_score=row.last_score,
        summary=dict(row.summary) if row.summary is not None else None,
    )
