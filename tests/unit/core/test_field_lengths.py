"""Field lengths declared once (core/limits.py): the edge, the log records, the database models
and the schema the migrations create agree, on SQLite here and on PostgreSQL in
tests/integration/test_field_lengths.py (issue 23, finding 1).

A value the edge accepts must fit every column it reaches: on PostgreSQL a longer one is refused
("value too long"), and before the fix an episode id of 100 characters (the edge took 128) made
the learner's every join commit fail on ``pending_joins.key`` (64): nothing else was joined.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlalchemy import String

from core import limits
from core.db import Base
from core.records import FeedbackRecord, TrajectoryRecord
from server.chat.protocol import ChatCompletionRequest
from server.feedback.protocol import FeedbackRequest
from testing.backends.field_lengths import COLUMNS, join_long_ids, migrated_lengths
from testing.builders import fb, traj
from testing.servers import make_settings

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
        "tenant": limits.NAME_CHARS,  # tenant_policies.name
    }


def test_the_migrations_create_the_declared_lengths_sqlite(tmp_path):
    assert migrated_lengths(f"sqlite:///{tmp_path / 'm.db'}") == COLUMNS


def test_an_episode_id_of_100_characters_joins_on_sqlite(tmp_path):
    join_long_ids(f"sqlite:///{tmp_path / 'l.db'}")


def test_a_record_with_an_id_longer_than_its_column_is_malformed():
    long_id = {**traj().model_dump(by_alias=True), "id": "x" * (limits.ID_CHARS + 1)}
    with pytest.raises(ValueError, match="at most 64 characters"):
        TrajectoryRecord.model_validate(long_id)
    with pytest.raises(ValueError, match="at most 128 characters"):
        FeedbackRecord.model_validate({**fb().model_dump(), "episode_id": "e" * 129, "trajectory_id": None})
