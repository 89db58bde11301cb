"""Field lengths declared once (core/limits.py): the edge, the log records, the database models
and the schema the migrations create agree, on SQLite and PostgreSQL (issue 23, finding 1).

A value the edge accepts must fit every column it reaches: on PostgreSQL a longer one is refused
("value too long"), and before the fix an episode id of 100 characters (the edge took 128) made
the learner's every join commit fail on ``pending_joins.key`` (64): nothing else was joined.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import String, inspect, select

from core import limits
from core.db import Base, LearnerSample, PendingJoin, make_engine, migrate
from core.logbus import SqlLog
from core.records import TOPIC_FEEDBACK, TOPIC_TRAJECTORIES, FeedbackRecord, TrajectoryRecord, utcnow
from learner.joiner import Joiner
from server.schemas import ChatCompletionRequest, FeedbackRequest
from tests.conftest import make_settings
from tests.test_join_plan import fb, traj

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
}

P = len("e:")  # the kind prefix of a key made from an id (limits.KEY_PREFIX_CHARS)
# (model, field) of a value the edge accepts, the record field that carries it, and every
# (column, prefix) it is stored in.
REACHES = [
    (
        (ChatCompletionRequest, "prompt_id"),
        (TrajectoryRecord, "prompt_id"),
        [
            (("trajectory_index", "prompt_id"), 0),
            (("prompt_evidence", "prompt_id"), 0),
            (("pending_joins", "prompt_id"), 0),
            (("learner_samples", "prompt_id"), 0),
            (("log_records", "key"), 0),
            (("dead_letters", "prompt_id"), 0),
        ],
    ),
    (
        (ChatCompletionRequest, "episode_id"),
        (TrajectoryRecord, "episode_id"),
        [
            (("trajectory_index", "episode_id"), 0),
            (("episodes", "episode_id"), 0),
            (("episode_turns", "episode_id"), 0),
            (("pending_joins", "key"), P),  # the episode's tombstone e:<episode id>
            (("feedback_claims", "target"), P),
            (("learner_samples", "id"), P),
            (("forgotten_records", "key"), P),
            (("dead_letters", "key"), P),
        ],
    ),
    (
        (FeedbackRequest, "episode_id"),
        (FeedbackRecord, "episode_id"),
        [(("feedback_claims", "target"), P), (("pending_joins", "key"), P)],
    ),
    (
        (FeedbackRequest, "id"),
        (FeedbackRecord, "trajectory_id"),
        [
            (("trajectory_index", "id"), 0),
            (("feedback_claims", "target"), P),
            (("pending_joins", "key"), 0),
            (("learner_samples", "id"), 0),
            (("episode_turns", "trajectory_id"), 0),
        ],
    ),
    (
        (ChatCompletionRequest, "user"),
        (TrajectoryRecord, "user"),
        [(("trajectory_index", "user_id"), 0)],
    ),
    (
        (ChatCompletionRequest, "user"),
        (TrajectoryRecord, "identity"),
        [(("learner_samples", "identity"), 0)],
    ),
]
# Made by the server, not sent by a client: the record's bound and the columns.
SERVER_MADE = [
    ((TrajectoryRecord, "id"), [(("trajectory_index", "id"), 0), (("pending_joins", "key"), 0)]),
    (
        (FeedbackRecord, "feedback_id"),
        [(("feedback_claims", "feedback_id"), 0), (("pending_joins", "key"), 0)],  # unconfirmed
    ),
    ((FeedbackRecord, "prompt_id"), [(("pending_joins", "prompt_id"), 0)]),
]


def max_len(model, name: str) -> int:
    [bound] = [m.max_length for m in model.model_fields[name].metadata if hasattr(m, "max_length")]
    return bound


def model_lengths() -> dict[tuple[str, str], int]:
    return {
        (t.name, c.name): c.type.length
        for t in Base.metadata.sorted_tables
        for c in t.columns
        if isinstance(c.type, String) and c.type.length is not None
    }


def test_every_string_column_takes_its_length_from_core_limits():
    assert model_lengths() == COLUMNS
    assert limits.KEY_CHARS >= limits.KEY_PREFIX_CHARS + max(limits.ID_CHARS, limits.EPISODE_ID_CHARS) == 130


def test_what_the_edge_accepts_the_records_carry_and_the_columns_hold():
    for (edge, field), (record, rfield), columns in REACHES:
        assert max_len(edge, field) <= max_len(record, rfield), (edge.__name__, field)
        for column, prefix in columns:
            assert max_len(record, rfield) + prefix <= COLUMNS[column], (record.__name__, rfield, column)
    for (record, rfield), columns in SERVER_MADE:
        for column, prefix in columns:
            assert max_len(record, rfield) + prefix <= COLUMNS[column], (record.__name__, rfield, column)
    # The turn list: at most MAX_EPISODE_TURNS ids, the edge numbers turns below it.
    assert max_len(FeedbackRecord, "turn_ids") == limits.MAX_EPISODE_TURNS
    assert ChatCompletionRequest.model_fields["turn"].metadata[-1].lt == limits.MAX_EPISODE_TURNS


def test_the_admin_path_parameters_are_bounded_like_the_columns(tmp_path):
    from server.app import create_app

    spec = create_app(make_settings(tmp_path), engine=SimpleNamespace(), watch_policy=False).openapi()
    bounds = {
        p["name"]: p["schema"]["maxLength"]
        for route in spec["paths"].values()
        for op in route.values()
        for p in op.get("parameters", [])
        if p["in"] == "path" and "maxLength" in p["schema"]
    }
    assert bounds == {
        "trajectory_id": limits.ID_CHARS,
        "prompt_id": limits.PROMPT_ID_CHARS,
        "key_id": limits.NAME_CHARS,  # api_keys.id
        "request_id": limits.NAME_CHARS,  # forget_requests.id
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


def test_the_migrations_create_the_declared_lengths_sqlite(tmp_path):
    assert migrated_lengths(f"sqlite:///{tmp_path / 'm.db'}") == COLUMNS


@pytest.mark.postgres
def test_the_migrations_create_the_declared_lengths_postgres(pg_url):
    assert migrated_lengths(pg_url) == COLUMNS


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


@pytest.mark.postgres
def test_an_episode_id_of_100_characters_joins_on_postgres(pg_url):
    join_long_ids(pg_url)


def test_an_episode_id_of_100_characters_joins_on_sqlite(tmp_path):
    join_long_ids(f"sqlite:///{tmp_path / 'l.db'}")


def test_a_record_with_an_id_longer_than_its_column_is_malformed():
    long_id = {**traj().model_dump(by_alias=True), "id": "x" * (limits.ID_CHARS + 1)}
    with pytest.raises(ValueError, match="at most 64 characters"):
        TrajectoryRecord.model_validate(long_id)
    with pytest.raises(ValueError, match="at most 128 characters"):
        FeedbackRecord.model_validate({**fb().model_dump(), "episode_id": "e" * 129, "trajectory_id": None})
