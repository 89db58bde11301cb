"""The version lifecycle on PostgreSQL: the tests of ``testing.backends.lifecycle``
(tests/unit/core/test_lifecycle.py runs them on SQLite, beside the pure transitions and rules)."""

from __future__ import annotations

from testing.backends.lifecycle import *  # noqa: F403 (its tests run here on PostgreSQL)
