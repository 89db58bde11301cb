"""Field lengths, declared once: what the HTTP edge accepts is what the log records and the
database columns hold (docs/design.md §8).

The request schemas (each API family's ``protocol`` module, e.g. ``server/chat/protocol.py``; the
admin routes' path parameters), the log records (``core/records.py``) and the database models (``core/db.py``) take their bounds from here; the
migrations keep the literal widths of their day, and ``tests/unit/core/test_field_lengths.py`` checks that
the edge, the records, the models and the schema the migrations create agree (on SQLite and
PostgreSQL). A value the edge accepts must fit every column it reaches: PostgreSQL refuses a
longer one ("value too long"), and a record the learner cannot store would stop its joins.
Lengths are in characters (PostgreSQL's ``VARCHAR(n)`` counts characters; SQLite does not
enforce them).
"""

from __future__ import annotations

ID_CHARS = 64
"""A completion (trajectory) id or a feedback id: the server makes ``chatcmpl-`` + 32 hex digits
(41) and UUIDs (36); ``POST /v1/feedback``'s ``id`` takes up to this."""

PROMPT_ID_CHARS = 128
"""A prompt id: the client's ``prompt_id`` (or ``p-`` + 32 hex digits, 34, made by the server)."""

EPISODE_ID_CHARS = 128
"""A client's ``episode_id``."""

KEY_PREFIX_CHARS = 2
"""The kind prefix of a key built from an id: ``t:`` (a trajectory), ``e:`` (an episode)."""

KEY_CHARS = 160
"""A key built from an id and its kind prefix: feedback claim targets, pending-join keys (also an
episode's tombstone ``e:<episode id>``), sample ids, forget tombstones; at least
``KEY_PREFIX_CHARS + max(ID_CHARS, EPISODE_ID_CHARS)`` (130)."""

USER_CHARS = 256
"""The OpenAI ``user`` field of a chat request, kept with its trajectory."""

NAME_CHARS = 64
"""Names the code makes: topics, consumers, counters, control flags, run ids, dead-letter kinds;
API key ids and tenant names (``core/keys.py``)."""

IDENTITY_CHARS = len("user:") + USER_CHARS
"""Who sent a trajectory (``core.keys.identity_of``): ``key:<key id>`` or ``user:<user field>``."""

STATE_CHARS = 16
"""Short states: a version's status, a claim's state, a pending row's kind."""

FINISH_REASON_CHARS = 32
"""A trajectory's finish reason (``stop``, ``length``, ``abort``, ``error``)."""

SHA256_CHARS = 64
"""A sha256 digest in hex."""

MAX_EPISODE_TURNS = 1024
"""Turns of one episode, numbered 0 .. MAX_EPISODE_TURNS - 1: episode feedback lists its turns'
ids (``core.records.FeedbackRecord.turn_ids``), which bounds the record (about 40 KiB)."""
