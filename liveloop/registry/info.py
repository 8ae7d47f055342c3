"""Errors and plain, detached records returned by the registry.

Nothing here holds a database session: every record is a frozen dataclass copied out of
the ORM row before the session closes, so callers may keep it around freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from liveloop.contracts import VersionStatus


class RegistryError(RuntimeError):
    """The registry cannot do what was asked; the message is one line without passwords."""


class SessionOwnershipError(RegistryError):
    """A session id is already recorded for another tenant."""


@dataclass(frozen=True)
class RunInfo:
    """One run of a loop: what kind, with which config, and how it ended."""

    id: int
    kind: str
    started_at: datetime
    finished_at: datetime | None
    config: dict[str, Any]
    status: str


@dataclass(frozen=True)
class ModelVersionInfo:
    """A policy version: checkpoint path, parent version, metrics and producing run."""

    version: int
    path: str
    parent: int | None
    created_at: datetime
    metrics: dict[str, float]
    run_id: int | None
    status: VersionStatus = VersionStatus.ACCEPTED
    reason: str | None = None


@dataclass(frozen=True)
class VersionQualityInfo:
    """A version's quality on served traffic (`served`) and on the gate's probes (`probe`)."""

    version: int
    updated_at: datetime
    served: dict[str, Any] | None
    probe: dict[str, Any] | None


@dataclass(frozen=True)
class SessionInfo:
    """Turn counters and scores of one conversation."""

    session_id: str
    tenant: str
    created_at: datetime
    last_seen_at: datetime
    turns: int
    main_turns: int
    side_turns: int
    scored_turns: int
    score_sum: float
    last_score: float | None
    summary: dict[str, Any] | None

    @property
    def mean_score(self) -> float | None:
        """Mean of the recorded scores, or None before the first one."""
        return self.score_sum / self.scored_turns if self.scored_turns else None
