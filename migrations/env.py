"""Alembic environment: batch mode so ALTERs work on SQLite as on PostgreSQL."""

from alembic import context
from sqlalchemy import text

from core.db import MIGRATION_LOCK_KEY, Base, make_engine

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is None:
        engine = make_engine(config.get_main_option("sqlalchemy.url"))
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connectable)


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Every replica and the learner migrate at start; on a fresh database two at once both
            # created the tables and all but one failed. The lock (released at commit) makes
            # them take turns, and the later ones then find the schema at head.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


run_migrations_online()
