"""The keys that name what feedback rates, spelled once for the server and the learner
(docs/design.md §4, §8).

Three spellings, each for one reader:

* A feedback claim (``core.db.FeedbackClaim.target``, the server's first-wins row; the joiner
  reads it to know which record was confirmed) names a trajectory ``t:<trajectory id>``
  (:func:`trajectory_target`) and an episode ``e:<episode id>`` (:func:`episode_key`): the
  prefixes keep an episode id and a trajectory id that are equal apart in one column.
* The learner's ``pending_joins`` rows and the ``forgotten_records`` tombstones key a
  trajectory by its bare id and an episode by ``e:<episode id>`` (:func:`record_key`); an
  episode's sample has that key as its id.
* A feedback token signs a completion's id or ``episode:<episode id>``
  (:func:`episode_token_subject`), so an episode's token never rates a completion whose id
  is the same string.

Prefixes are :data:`core.limits.KEY_PREFIX_CHARS` characters long.

A claim's life (docs/reliability.md, "A 202 is durable"; issue 40 item 9): the server takes it
(``claimed``, holding the new record's id) before appending the record, marks it ``received``
after the append, and answers 202. A claim still ``claimed`` after :data:`CLAIM_TIMEOUT` belongs
to a request that has ended one way or another (the longest append gives up well before): the
server may let a later record take it over, and keeps the first id it took it from
(``superseded_id``). The joiner trains exactly one record per target, the first in log order of:
the record the claim holds once it is marked or past the timeout, and the record a takeover
superseded (it reached the log, so its request may have answered 202 with its mark lost).
"""

from __future__ import annotations

from datetime import timedelta

CLAIM_TIMEOUT = timedelta(seconds=120)
"""How long a claim stays ``claimed`` before it counts as its request's last word. Longer than
any append can take (the SQL log waits up to 30 s for its database; Kafka's send gives up after
5 s and a delivery after 40 s), so a request still appending never loses its claim to a
later one, and the record of a claim past it is in the log or never will be."""

TRAJECTORY_PREFIX = "t:"
"""The kind prefix of a trajectory's claim target (a SQL join builds the target from it)."""

EPISODE_PREFIX = "e:"
"""The kind prefix of an episode's claim target, tombstone and sample id."""


def trajectory_target(trajectory_id: str) -> str:
    """The claim target of a trajectory's feedback: ``t:<trajectory id>``."""
    return TRAJECTORY_PREFIX + trajectory_id


def episode_key(episode_id: str) -> str:
    """An episode's claim target, ``pending_joins`` and forget tombstone key, and sample id:
    ``e:<episode id>``."""
    return EPISODE_PREFIX + episode_id


def claim_target(trajectory_id: str | None, episode_id: str | None) -> str:
    """The claim target of feedback that names ``trajectory_id`` (when not None) or else
    ``episode_id``: ``t:<trajectory id>`` or ``e:<episode id>``."""
    return trajectory_target(trajectory_id) if trajectory_id is not None else episode_key(episode_id)


def record_key(trajectory_id: str | None, episode_id: str | None) -> str:
    """The key the learner files feedback under: ``e:<episode id>`` for an episode's (when
    ``episode_id`` is not None), else the bare trajectory id."""
    return episode_key(episode_id) if episode_id is not None else trajectory_id


def episode_token_subject(episode_id: str) -> str:
    """What an episode's feedback token signs: ``episode:<episode id>`` (a completion's token
    signs its bare id)."""
    return f"episode:{episode_id}"
