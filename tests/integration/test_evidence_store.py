"""The prompt_evidence table (core/evidence_store.py, migration 0002) on PostgreSQL: the tests of
``testing.backends.evidence_store`` (tests/unit/core/test_evidence_store.py runs them on SQLite),
and concurrent writers with no lost update and no deadlock."""

from __future__ import annotations

from core.db import make_engine, migrate
from core.evidence_store import EvidenceStore
from testing.backends.evidence_store import *  # noqa: F403 (its tests run here on PostgreSQL)
from testing.backends.evidence_store import REVISION, check_sum, hammer, pid


def test_concurrent_writers_postgres(new_database):
    # 8 threads × 500 results on 3 prompts, 5 per transaction: no lost update, no deadlock.
    with new_database() as url:
        migrate(url, REVISION)
        engine = make_engine(url)
        store = EvidenceStore(engine)
        prompts = [pid("hot") for _ in range(3)]
        results = hammer(store, prompts, threads=8, per_thread=500, batch=5)
        check_sum(store, prompts, results)
        engine.dispose()
