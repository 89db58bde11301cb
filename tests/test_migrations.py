"""Alembic migrations: up/down/up on SQLite and PostgreSQL, and the models match them."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from core.db import Base, downgrade, make_engine, migrate


def _check(url: str) -> None:
    migrate(url)
    downgrade(url, "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    migrate(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == [], f"models and migrations differ: {diff}"


def test_migrations_sqlite(tmp_path):
    _check(f"sqlite:///{tmp_path / 'm.db'}")


@pytest.mark.postgres
def test_migrations_postgres(pg_url):
    _check(pg_url)
