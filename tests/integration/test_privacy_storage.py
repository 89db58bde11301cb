"""Retention and forget on PostgreSQL (docs/privacy.md): the tests of
``testing.backends.privacy_storage`` (tests/unit/core/test_privacy_storage.py runs them on
SQLite), with PostgreSQL's table lock in forget and its sequence for the log's ids."""

from __future__ import annotations

from testing.backends.privacy_storage import *  # noqa: F403 (its tests run here on PostgreSQL)
