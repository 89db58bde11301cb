"""Dead letters on PostgreSQL (core/dead_letters.py, issue 23 findings 1 and 7): a record with a
NUL, which PostgreSQL cannot store, is set aside and the joins go on. The rest:
tests/unit/learner/test_dead_letters.py."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DataError

from core.db import (
    make_engine,
    migrate,
)
from core.logbus import open_log
from core.records import TOPIC_TRAJECTORIES, utcnow
from learner.data.joiner import Joiner
from testing.builders import fb, traj
from testing.logs import append
from testing.rows import letters


@pytest.mark.postgres
def test_a_record_with_a_nul_is_set_aside_on_postgres(pg_url):
    migrate(pg_url)
    engine, log = make_engine(pg_url), open_log(pg_url)
    now = utcnow()
    # From a writer that never checked (the edge refuses a NUL); the log's key is not the id.
    log.append(TOPIC_TRAJECTORIES, "p", traj("nul", "p\x00q", created_at=now).to_json())
    append(log, traj("t1", created_at=now), fb("t1"))
    joiner = Joiner(log, engine, 3600)
    for _ in range(2):
        with pytest.raises(DataError):
            joiner.poll_once()
    assert joiner.poll_once().samples == 1
    [(kind, key, prompt_id, topic, _, attempts, reason)] = letters(engine)
    assert (kind, key, prompt_id, topic, attempts) == ("unjoinable", "nul", "p\\x00q", TOPIC_TRAJECTORIES, 3)
    assert reason.startswith("the database refused its join 3 times: DataError: ")
    log.close()
    engine.dispose()
