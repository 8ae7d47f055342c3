"""Alembic environment of the registry, driven from code by `liveloop.registry.store`.

There is no `alembic.ini`: `store.upgrade_to_head` builds the Alembic `Config` itself and
passes an open connection in `config.attributes["connection"]`. Offline (`--sql`) mode
renders SQL from `sqlalchemy.url` for whoever wants to review the DDL.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from liveloop.registry.models import Base

VERSION_TABLE = "liveloop_alembic_version"


def _run_offline() -> None:
    """Render the migrations as SQL text without a database."""
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online(connection: Connection) -> None:
    """Apply the migrations over the connection handed in by the registry."""
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _main() -> None:
    """Entry point Alembic runs when it loads this file."""
    if context.is_offline_mode():
        _run_offline()
        return
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("the registry migrations need a connection in config.attributes")
    _run_online(connection)


_main()
