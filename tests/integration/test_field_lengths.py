"""Field lengths on PostgreSQL (core/limits.py, issue 23 finding 1): the migrations create the
declared widths, and an episode id of 100 characters joins (before the fix it made every join
commit fail on ``pending_joins.key``). The same on SQLite and the rest:
tests/unit/core/test_field_lengths.py."""

from __future__ import annotations

import pytest

from testing.backends.field_lengths import COLUMNS, join_long_ids, migrated_lengths


@pytest.mark.postgres
def test_the_migrations_create_the_declared_lengths_postgres(pg_url):
    assert migrated_lengths(pg_url) == COLUMNS


@pytest.mark.postgres
def test_an_episode_id_of_100_characters_joins_on_postgres(pg_url):
    join_long_ids(pg_url)
