"""Field lengths on a migrated database (SQLite in tests/unit/core/test_field_lengths.py,
PostgreSQL in tests/integration/test_field_lengths.py): the declared width of every column
(``COLUMNS``), the widths a migration made (``migrated_lengths``) and ids of the longest lengths
joined (``join_long_ids``)."""

from __future__ import annotations

from sqlalchemy import inspect, select

from core import limits
from core.db import LearnerSample, PendingJoin, make_engine, migrate
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, utcnow
from learner.data.joiner import Joiner
from testing.builders import fb, traj

# Every string column and the bound of what it holds.
COLUMNS = {
    ("trajectory_index", "id"): limits.ID_CHARS,
    ("trajectory_index", "prompt_id"): limits.PROMPT_ID_CHARS,
    ("trajectory_index", "episode_id"): limits.EPISODE_ID_CHARS,
    ("trajectory_index", "finish_reason"): limits.FINISH_REASON_CHARS,
    ("trajectory_index", "arm"): limits.STATE_CHARS,
    ("trajectory_index", "user_id"): limits.USER_CHARS,
    ("trajectory_index", "identity"): limits.IDENTITY_CHARS,
    ("feedback_claims", "target"): limits.KEY_CHARS,
    ("feedback_claims", "state"): limits.STATE_CHARS,
    ("feedback_claims", "feedback_id"): limits.ID_CHARS,
    ("feedback_claims", "superseded_id"): limits.ID_CHARS,
    ("log_records", "topic"): limits.NAME_CHARS,
    ("log_records", "key"): limits.PROMPT_ID_CHARS,
    ("policy_versions", "sha256"): limits.SHA256_CHARS,
    ("policy_versions", "status"): limits.STATE_CHARS,
    ("policy_versions", "lifecycle"): limits.STATE_CHARS,
    ("version_status_events", "from_status"): limits.STATE_CHARS,
    ("version_status_events", "to_status"): limits.STATE_CHARS,
    ("version_status_events", "actor"): limits.NAME_CHARS,
    ("quarantined_samples", "sample_id"): limits.KEY_CHARS,
    ("consumer_offsets", "consumer"): limits.NAME_CHARS,
    ("consumer_offsets", "topic"): limits.NAME_CHARS,
    ("pending_joins", "key"): limits.KEY_CHARS,
    ("pending_joins", "kind"): limits.STATE_CHARS,
    ("pending_joins", "prompt_id"): limits.PROMPT_ID_CHARS,
    ("learner_steps", "run_id"): limits.NAME_CHARS,
    ("prompt_evidence", "prompt_id"): limits.PROMPT_ID_CHARS,
    ("learner_samples", "id"): limits.KEY_CHARS,
    ("learner_samples", "prompt_id"): limits.PROMPT_ID_CHARS,
    ("learner_counters", "name"): limits.NAME_CHARS,
    ("dead_letters", "kind"): limits.NAME_CHARS,
    ("dead_letters", "key"): limits.KEY_CHARS,
    ("dead_letters", "prompt_id"): limits.PROMPT_ID_CHARS,
    ("dead_letters", "topic"): limits.NAME_CHARS,
    ("control_flags", "name"): limits.NAME_CHARS,
    ("episodes", "episode_id"): limits.EPISODE_ID_CHARS,
    ("episode_turns", "trajectory_id"): limits.ID_CHARS,
    ("episode_turns", "episode_id"): limits.EPISODE_ID_CHARS,
    ("forgotten_records", "key"): limits.KEY_CHARS,
    ("learner_samples", "identity"): limits.IDENTITY_CHARS,
    ("api_keys", "id"): limits.NAME_CHARS,
    ("api_keys", "tenant"): limits.NAME_CHARS,
    ("api_keys", "key_sha256"): limits.SHA256_CHARS,
    ("subject_keys", "id"): limits.NAME_CHARS,
    ("subject_keys", "holder"): limits.SHA256_CHARS,
    ("subject_keys", "key_id"): limits.NAME_CHARS,
    ("subject_keys", "user_id"): limits.USER_CHARS,
    ("forget_requests", "id"): limits.NAME_CHARS,
    ("forget_requests", "kind"): limits.STATE_CHARS,
    ("forget_requests", "subject"): limits.USER_CHARS,
    ("forget_requests", "subject_hash"): limits.SHA256_CHARS,
    ("tenant_policies", "name"): limits.NAME_CHARS,
}


def migrated_lengths(url: str) -> dict[tuple[str, str], int]:
    migrate(url)
    engine = make_engine(url)
    insp = inspect(engine)
    out = {
        (table, c["name"]): c["type"].length
        for table in insp.get_table_names()
        if table != "alembic_version"
        for c in insp.get_columns(table)
        if getattr(c["type"], "length", None) is not None
    }
    engine.dispose()
    return out


def join_long_ids(url: str) -> None:
    """An episode id of 100 characters (turn + its episode's feedback), and another user's
    completion with feedback in the same read: both join."""
    migrate(url)
    engine, log = make_engine(url), SqlLog(url)
    now = utcnow()
    episode = "e" * 100
    turn = traj("c-0", "q", episode_id=episode, turn=0, created_at=now)
    other = traj("c-other", "p", created_at=now)
    rated = fb(episode=episode, prompt_id="q").model_copy(update={"turn_ids": ["c-0"]})
    for topic, rec in (
        (TOPIC_TRAJECTORIES, turn),
        (TOPIC_TRAJECTORIES, other),
        (TOPIC_FEEDBACK, rated),
        (TOPIC_FEEDBACK, fb("c-other")),
    ):
        log.append(topic, rec.prompt_id, rec.to_json())
    stats = Joiner(log, engine, 3600).poll_once()
    with engine.connect() as conn:
        samples = sorted(conn.execute(select(LearnerSample.id)).scalars())
        pending = sorted(conn.execute(select(PendingJoin.key, PendingJoin.kind)).all())
    log.close()
    engine.dispose()
    assert stats.samples == 2 and stats.counters == {}
    assert samples == ["c-other", f"e:{episode}"]
    # Tombstones: the two trajectories and the episode's key, 2 + 100 = 102 characters.
    assert pending == [("c-0", "joined"), ("c-other", "joined"), (f"e:{episode}", "joined")]
    assert len(f"e:{episode}") == 102
