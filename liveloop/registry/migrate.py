"""Engine construction and schema migration of the registry database.

`make_engine` configures SQLite for sharing between processes (WAL journal, a busy
timeout, enforced foreign keys) and PostgreSQL for long-lived pools. `upgrade_to_head`
drives Alembic from code (no `alembic.ini`) under a lock, so that several processes
starting at once apply each migration exactly once: an exclusive file lock next to a
SQLite file, a transaction-scoped advisory lock on PostgreSQL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import StaticPool

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "liveloop_alembic_version"
SQLITE_BUSY_TIMEOUT_MS = 30_000
MIGRATION_LOCK_TIMEOUT_S = 120.0
PG_ADVISORY_LOCK_KEY = 0x4C4C_5245  # "LLRE": LiveLoop REgistry


def is_sqlite_memory(url: URL) -> bool:
    """Whether a SQLite URL names a private in-memory database."""
    database = url.database or ""
    return database in ("", ":memory:") or "mode=memory" in database


def sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL, or None for memory and `file:` URI databases."""
    if url.get_backend_name() != "sqlite" or is_sqlite_memory(url):
        return None
    database = url.database or ""
    if database.startswith("file:"):
        return None
    return Path(database)


def _sqlite_on_connect(dbapi_conn: Any, _record: Any, *, memory: bool) -> None:
    """Per-connection SQLite settings: busy timeout, foreign keys, WAL journal."""
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if not memory:
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
    finally:
        cursor.close()


def make_engine(url: URL) -> Engine:
    """An engine for the registry URL, tuned for its backend."""
    backend = url.get_backend_name()
    if backend == "sqlite":
        memory = is_sqlite_memory(url)
        kwargs: dict[str, Any] = {
            "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
        }
        if memory:
            kwargs["poolclass"] = StaticPool
        engine = create_engine(url, **kwargs)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, record: Any) -> None:
            _sqlite_on_connect(dbapi_conn, record, memory=memory)

        return engine
    connect_args: dict[str, Any] = {}
    if backend == "postgresql" and "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = 10
    return create_engine(url, pool_pre_ping=True, connect_args=connect_args)


@contextmanager
def file_lock(path: Path, timeout_s: float = MIGRATION_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if absent); no-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    deadline = time.monotonic() + timeout_s
    with open(path, "a+b") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"migration lock {path} held too long") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def alembic_config() -> Config:
    """An Alembic config pointing at the packaged migrations, without an ini file."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return config


def head_revision() -> str | None:
    """The newest revision among the packaged migrations."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None for an empty database."""
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


def _upgrade(engine: Engine) -> None:
    """Apply pending migrations in one transaction (serialised on PostgreSQL)."""
    config = alembic_config()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_ADVISORY_LOCK_KEY})
        config.attributes["connection"] = conn
        command.upgrade(config, "head")


def upgrade_to_head(engine: Engine) -> None:
    """Bring the schema to the newest revision; a no-op when it already is."""
    path = sqlite_file(engine.url)
    if path is None:
        _upgrade(engine)
        return
    with file_lock(path.with_name(path.name + ".lock")):
        _upgrade(engine)
