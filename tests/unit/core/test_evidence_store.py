"""The prompt_evidence table (core/evidence_store.py, migration 0002) on SQLite: the tests of
``testing.backends.evidence_store`` (tests/integration/test_evidence_store.py runs them on
PostgreSQL), the ranking of uncertain prompts, concurrent writers on a WAL file, and the errors of
the offline rollouts file.
"""

from __future__ import annotations

import pytest

from core.db import make_engine, migrate
from core.evidence_store import EvidenceStore, read_rollouts_file
from testing.backends.evidence_store import *  # noqa: F403 (its tests run here on SQLite)
from testing.backends.evidence_store import REVISION, check_sum, hammer, pid


def test_top_uncertain(new_database):
    # A fresh store on its own table keeps other tests' prompts out of the ranking.
    with new_database() as url:
        migrate(url, REVISION)
        engine = make_engine(url)
        s = EvidenceStore(engine)
        # Jeffreys values: 4 of 8 → 0.5, 1 of 8 → 8·1.5/9/8 = 1/6, 8 of 8 → 8.5/9.
        s.init_from_rollouts([("half", 4, 8), ("hard", 1, 8), ("easy", 8, 8)])
        top = s.top_uncertain(2, 3)
        assert [p for p, _ in top] == ["half", "hard"]
        assert top[0][1].value == pytest.approx(0.5) and top[0][1].version == 3
        assert s.top_uncertain(0, 3) == []
        with pytest.raises(ValueError):
            s.top_uncertain(-1, 3)
        engine.dispose()


# ---------------------------------------------------------------- order and concurrency


def test_concurrent_writers_sqlite(new_database):
    # 4 threads × 100 results on 3 prompts against a WAL file database.
    with new_database() as url:
        migrate(url, REVISION)
        engine = make_engine(url)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        store = EvidenceStore(engine)
        prompts = [pid("hot") for _ in range(3)]
        results = hammer(store, prompts, threads=4, per_thread=100, batch=5)
        check_sum(store, prompts, results)
        engine.dispose()


# ---------------------------------------------------------------- offline file


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"prompt_id": "p", "reward": 2}', "reward must be 0 or 1"),
        ('{"prompt_id": "p", "reward": true}', "reward must be 0 or 1"),
        ('{"prompt_id": "p", "successes": 5, "n": 4}', "exceed"),
        ('{"prompt_id": "p", "successes": 1.5, "n": 4}', "successes"),
        ('{"prompt_id": "", "reward": 1}', "prompt_id"),
        ('{"prompt_id": "p", "reward": 1, "extra": 0}', "expected keys"),
    ],
)
def test_rollouts_file_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_id": "ok", "reward": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        read_rollouts_file(path)
    assert f"{path}:2:" in str(e.value)
