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
"""

from __future__ import annotations

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
