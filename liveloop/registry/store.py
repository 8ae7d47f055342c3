"""The `Registry`: model versions, runs and sessions in SQLite or PostgreSQL.

Every call opens a short-lived ORM session and returns detached records
(`liveloop.registry.info`), so one `Registry` may be shared by threads, and several
processes may open the same SQLite file at once. Database failures surface as
`RegistryError` with a one-line message that never contains a password.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Self

from sqlalchemy import delete, select, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from liveloop.contracts import VersionStatus
from liveloop.registry.info import (
    ModelVersionInfo,
    RegistryError,
    RunInfo,
    SessionInfo,
    SessionOwnershipError,
    VersionQualityInfo,
)
from liveloop.registry.migrate import make_engine, sqlite_file, upgrade_to_head
from liveloop.registry.models import (
    ChatSession,
    ModelVersion,
    Run,
    TenantBaseQuality,
    VersionQuality,
    utcnow,
)
from liveloop.registry.rows import quality_info, run_info, session_info, version_info

log = logging.getLogger(__name__)

TURN_TYPES = ("main", "side")


def safe_url(url: str) -> str:
    """The URL with any password masked, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def one_line(exc: BaseException) -> str:
    """A short one-line reason for an exception (the driver's own message when wrapped)."""
    inner = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    reason = lines[0] if lines else type(inner).__name__
    return f"{type(inner).__name__}: {reason}"


def _json_dict(value: dict[str, Any]) -> dict[str, Any]:
    """A JSON-safe copy of a dict (paths and other objects become strings)."""
    result: dict[str, Any] = json.loads(json.dumps(value, default=str))
    return result


def _clean_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    """Metrics as finite floats; non-finite values are dropped with a warning."""
    cleaned: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        number = float(value)
        if math.isfinite(number):
            cleaned[str(key)] = number
        else:
            log.warning("dropping non-finite metric %s=%r", key, value)
    return cleaned


class Registry:
    """Model versions, runs and sessions, shared by every LiveLoop process."""

    def __init__(self, engine: Engine) -> None:
        """Wrap an engine whose schema is already at head; use `Registry.open` instead."""
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str) -> Registry:
        """Open the registry at `url`, creating and migrating the database as needed."""
        engine: Engine | None = None
        try:
            parsed = make_url(url)
            path = sqlite_file(parsed)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
            engine = make_engine(parsed)
            upgrade_to_head(engine)
        except Exception as exc:
            if engine is not None:
                engine.dispose()
            raise RegistryError(
                f"cannot open registry at {safe_url(url)}: {one_line(exc)}"
            ) from exc
        return cls(engine)

    @property
    def url(self) -> str:
        """The database URL with the password masked."""
        return self._engine.url.render_as_string(hide_password=True)

    @property
    def engine(self) -> Engine:
        """The underlying SQLAlchemy engine (for tests and maintenance)."""
        return self._engine

    def close(self) -> None:
        """Release every pooled connection; the registry must not be used afterwards."""
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @contextmanager
    def _guard(self, action: str) -> Iterator[None]:
        """Turn database errors into a one-line `RegistryError`."""
        try:
            yield
        except RegistryError:
            raise
        except SQLAlchemyError as exc:
            raise RegistryError(f"registry {action} failed: {one_line(exc)}") from exc

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """A short-lived session in a transaction, committed on success."""
        with self._sessions.begin() as session:
            yield session

    # -- runs ---------------------------------------------------------------------------

    def start_run(self, kind: str, config: dict[str, Any]) -> int:
        """Record the start of a run and return its id."""
        with self._guard("start_run"), self._tx() as session:
            row = Run(kind=kind, config=_json_dict(config), status="running")
            session.add(row)
            session.flush()
            return row.id

    def finish_run(self, run_id: int, status: str = "finished") -> None:
        """Mark a run as ended with `status`; raises `RegistryError` for an unknown id."""
        with self._guard("finish_run"), self._tx() as session:
            row = session.get(Run, run_id)
            if row is None:
                raise RegistryError(f"no run with id {run_id}")
            row.status = status
            row.finished_at = utcnow()

    def get_run(self, run_id: int) -> RunInfo | None:
        """The run with this id, or None."""
        with self._guard("get_run"), self._tx() as session:
            row = session.get(Run, run_id)
            return run_info(row) if row is not None else None

    # -- model versions -----------------------------------------------------------------

    def add_model_version(
        self,
        version: int,
        path: str,
        parent: int | None,
        metrics: dict[str, float] | None = None,
        run_id: int | None = None,
        *,
        status: VersionStatus = VersionStatus.ACCEPTED,
        reason: str | None = None,
        adapter: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Record a policy version; recording a version that exists already is a no-op.

        `status` REJECTED marks a version the promotion gate refused (`reason` says why);
        the served-quality watch later turns a served one into ROLLED_BACK.
        """
        with self._guard("add_model_version"):
            try:
                with self._tx() as session:
                    existing = session.get(ModelVersion, version)
                    if existing is None:
                        session.add(
                            ModelVersion(
                                version=version,
                                path=str(path),
                                parent=parent,
                                metrics=_clean_metrics(metrics),
                                run_id=run_id,
                                status=str(status),
                                reason=reason[:2048] if reason else None,
                                adapter=adapter,
                                tenant=tenant,
                            )
                        )
                    elif existing.path != str(path):
                        log.warning(
                            "model version %d already recorded at %s; keeping it, not %s",
                            version,
                            existing.path,
                            path,
                        )
            except IntegrityError:
                # Lost a race with another writer of the same version: fine. Anything
                # else (an unknown run_id) is a real error.
                if self.get_model_version(version) is None:
                    raise

    def get_model_version(self, version: int) -> ModelVersionInfo | None:
        """The record of one version, or None."""
        with self._guard("get_model_version"), self._tx() as session:
            row = session.get(ModelVersion, version)
            return version_info(row) if row is not None else None

    def latest_model_version(self, *, accepted_only: bool = True) -> ModelVersionInfo | None:
        """The highest recorded version (by default the highest accepted one), or None."""
        accepted = VersionStatus.ACCEPTED if accepted_only else None
        versions = self.list_model_versions(limit=1, status=accepted)
        return versions[0] if versions else None

    def list_model_versions(
        self,
        limit: int = 100,
        *,
        status: VersionStatus | None = None,
        tenant: str | None = None,
    ) -> list[ModelVersionInfo]:
        """Up to `limit` versions (optionally of one status, or one tenant's), newest first."""
        query = select(ModelVersion).order_by(ModelVersion.version.desc()).limit(max(limit, 0))
        if status is not None:
            query = query.where(ModelVersion.status == status)
        if tenant is not None:
            query = query.where(ModelVersion.tenant == tenant)
        with self._guard("list_model_versions"), self._tx() as session:
            return [version_info(row) for row in session.scalars(query)]

    def record_version_quality(
        self,
        version: int,
        *,
        served: dict[str, Any] | None = None,
        probe: dict[str, Any] | None = None,
        tenant: str | None = None,
    ) -> None:
        """Store a version's measures on served traffic and/or on the gate's probes (with
        `tenant`, version 0's on that tenant's traffic alone)."""
        with self._guard("record_version_quality"):
            for _attempt in range(3):
                try:
                    with self._tx() as session:
                        row: VersionQuality | TenantBaseQuality | None
                        if tenant is not None and version == 0:
                            row = session.get(TenantBaseQuality, tenant)
                            row = row or TenantBaseQuality(tenant=tenant)
                        else:
                            row = session.get(VersionQuality, version)
                            row = row or VersionQuality(version=version)
                            if row.tenant is None:  # whose version it is, past its own row
                                recorded = session.get(ModelVersion, version)
                                row.tenant = recorded.tenant if recorded else None
                        session.add(row)
                        if served is not None:
                            row.served = _json_dict(served)
                        if probe is not None:
                            row.probe = _json_dict(probe)
                        row.updated_at = utcnow()
                    return
                except IntegrityError:
                    continue  # created concurrently: update it on the next attempt

    def version_quality(self, tenant: str | None = None) -> list[VersionQualityInfo]:
        """The stored measures of every version, oldest first; with `tenant`, that tenant's
        versions only, and version 0's on its traffic (none stored yet: no version 0 row)."""
        query = select(VersionQuality).order_by(VersionQuality.version)
        if tenant is not None:
            query = query.where(VersionQuality.tenant == tenant)
        with self._guard("version_quality"), self._tx() as session:
            rows: list[tuple[int, VersionQuality | TenantBaseQuality]]
            rows = [(row.version, row) for row in session.scalars(query)]
            if tenant is not None:
                base = session.get(TenantBaseQuality, tenant)
                if base is not None:
                    rows.insert(0, (0, base))
            return [quality_info(version, row) for version, row in rows]

    def set_model_version_status(
        self, version: int, status: VersionStatus, reason: str | None
    ) -> None:
        """Change a recorded version's status (e.g. ROLLED_BACK) and reason; unknown: no-op."""
        with self._guard("set_model_version_status"), self._tx() as session:
            row = session.get(ModelVersion, version)
            if row is not None:
                row.status = str(status)
                row.reason = reason[:2048] if reason else None

    def delete_model_version(self, version: int) -> None:
        """Forget a version (its children keep their parent number); unknown: no-op."""
        with self._guard("delete_model_version"), self._tx() as session:
            session.execute(delete(ModelVersion).where(ModelVersion.version == version))

    def delete_tenant(self, tenant: str) -> dict[str, int]:
        """Forget everything recorded of one tenant: its versions, their quality, the base's
        quality on its traffic, its sessions. Returns how many rows of each went; a tenant never seen: all zero."""
        with self._guard("delete_tenant"), self._tx() as session:
            versions = list(
                session.scalars(select(ModelVersion.version).where(ModelVersion.tenant == tenant))
            )
            whose = VersionQuality.tenant == tenant  # pruned versions' measures too
            session.execute(
                delete(VersionQuality).where(whose | VersionQuality.version.in_(versions))
            )
            if versions:
                session.execute(delete(ModelVersion).where(ModelVersion.version.in_(versions)))
            gone = session.execute(delete(ChatSession).where(ChatSession.tenant == tenant))
            session.execute(delete(TenantBaseQuality).where(TenantBaseQuality.tenant == tenant))
        return {"versions": len(versions), "sessions": int(getattr(gone, "rowcount", 0) or 0)}

    # -- sessions -----------------------------------------------------------------------

    def upsert_session(
        self,
        session_id: str,
        tenant: str,
        *,
        turn_type: str = "main",
        score: float | None = None,
        count_turn: bool = True,
        summary: dict[str, Any] | None = None,
    ) -> None:
        """Record activity in a session, creating it on first sight.

        Each call counts one turn of `turn_type` ("main" or "side") unless `count_turn` is
        False (e.g. a judge recording the score of a turn already counted). A `score` sets
        `last_score` and adds to the running mean; a `summary` replaces the stored one.
        Counters are updated atomically in the database, so concurrent writers never lose
        a turn. Raises `SessionOwnershipError` if the session belongs to another tenant.
        """
        if turn_type not in TURN_TYPES:
            raise ValueError(f"turn_type must be one of {TURN_TYPES}, not {turn_type!r}")
        if score is not None and not math.isfinite(score):
            raise ValueError(f"score must be finite, not {score!r}")
        values = self._session_changes(turn_type, score, count_turn, summary)
        with self._guard("upsert_session"):
            for _attempt in range(3):
                if self._update_session(session_id, tenant, values):
                    return
                self._create_session(session_id, tenant)
        raise RegistryError(f"could not record session {session_id!r}: too much contention")

    def _create_session(self, session_id: str, tenant: str) -> None:
        """Insert an empty session row unless one exists; check who owns an existing one."""
        try:
            with self._tx() as session:
                existing = session.get(ChatSession, session_id)
                if existing is not None and existing.tenant != tenant:
                    raise SessionOwnershipError(f"session {session_id!r} belongs to another tenant")
                if existing is None:
                    session.add(ChatSession(session_id=session_id, tenant=tenant))
        except IntegrityError:
            pass  # created concurrently; the caller's next update finds it

    @staticmethod
    def _session_changes(
        turn_type: str, score: float | None, count_turn: bool, summary: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Column updates (as SQL expressions) for one `upsert_session` call."""
        values: dict[str, Any] = {"last_seen_at": utcnow()}
        if count_turn:
            values["turns"] = ChatSession.turns + 1
            column = "main_turns" if turn_type == "main" else "side_turns"
            values[column] = getattr(ChatSession, column) + 1
        if score is not None:
            values["last_score"] = float(score)
            values["scored_turns"] = ChatSession.scored_turns + 1
            values["score_sum"] = ChatSession.score_sum + float(score)
        if summary is not None:
            values["summary"] = _json_dict(summary)
        return values

    def _update_session(self, session_id: str, tenant: str, values: dict[str, Any]) -> bool:
        """Apply `values` to an existing session of this tenant; False if there is none."""
        statement = (
            update(ChatSession)
            .where(ChatSession.session_id == session_id, ChatSession.tenant == tenant)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        with self._tx() as session:
            result = session.execute(statement)
            return bool(getattr(result, "rowcount", 0))

    def get_session(self, session_id: str) -> SessionInfo | None:
        """The record of one session, or None."""
        with self._guard("get_session"), self._tx() as session:
            row = session.get(ChatSession, session_id)
            return session_info(row) if row is not None else None
