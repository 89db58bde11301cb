"""The integration tier's back end: where a test of ``testing.backends`` asks for a database, it
gets a fresh PostgreSQL database (tests/unit runs the same tests on SQLite)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from testing.dependencies import fresh_pg_database


@pytest.fixture(scope="session")
def new_database() -> Callable[[], contextlib.AbstractContextManager[str]]:
    """``with new_database() as url``: the URL of a fresh PostgreSQL database, dropped on exit."""
    return fresh_pg_database
