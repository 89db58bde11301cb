"""The pure tier's back end: where a test of ``testing.backends`` asks for a database, it gets an
SQLite file (tests/integration runs the same tests on PostgreSQL)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest


@pytest.fixture(scope="session")
def new_database(tmp_path_factory) -> Callable[[], contextlib.AbstractContextManager[str]]:
    """``with new_database() as url``: the URL of a fresh, empty SQLite database file."""

    @contextlib.contextmanager
    def sqlite() -> Iterator[str]:
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'db.sqlite'}"

    return sqlite
