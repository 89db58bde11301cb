"""Alembic migrations on PostgreSQL: up/down/up with the models matching, and revision 0010's
repair of episodes logged before 0006 (``testing.backends.migrations``). On SQLite:
tests/unit/core/test_migrations.py."""

from __future__ import annotations

import pytest

from testing.backends.migrations import (
    check_0010,
    check_up_down_up,
)


@pytest.mark.postgres
def test_migrations_postgres(pg_url):
    check_up_down_up(pg_url)


@pytest.mark.postgres
def test_revision_0010_repairs_the_episodes_on_postgres(pg_url):
    check_0010(pg_url)
