"""``GET /dashboard/state`` and ``/metrics`` on PostgreSQL: the test of
``testing.backends.dashboard`` (tests/unit/server/test_dashboard.py runs it on SQLite)."""

from __future__ import annotations

from testing.backends.dashboard import *  # noqa: F403 (its test runs here on PostgreSQL)
