"""The LiveLoop registry: model versions, runs and sessions in SQLite or PostgreSQL.

`Registry.open(url)` creates the database if needed and migrates it to the newest schema
(Alembic, driven from code), then serves short, independent calls from any thread or
process. `LiveLoopSettings.effective_db_url` gives the URL every loop should use.
"""

from liveloop.registry.info import (
    ModelVersionInfo,
    RegistryError,
    RunInfo,
    SessionInfo,
    SessionOwnershipError,
    VersionQualityInfo,
)
from liveloop.registry.store import Registry

__all__ = [
    "ModelVersionInfo",
    "Registry",
    "RegistryError",
    "RunInfo",
    "SessionInfo",
    "SessionOwnershipError",
    "VersionQualityInfo",
]
