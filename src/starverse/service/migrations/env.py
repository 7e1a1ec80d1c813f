"""Alembic environment of the service schema: runs on the connection :func:`starverse.service.db.migrate`
passes in (``config.attributes['connection']``), or on ``sqlalchemy.url`` when run by the alembic CLI."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from starverse.service.db import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: object) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,  # type: ignore[arg-type]
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


given = config.attributes.get("connection")
if given is not None:
    _run(given)
else:
    engine = engine_from_config(config.get_section(config.config_ini_section) or {}, prefix="sqlalchemy.",
                                poolclass=pool.NullPool)
    with engine.connect() as conn:
        _run(conn)
