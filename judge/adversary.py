"""A cohort of simulated raters who reward by their own rule, not the judge's rubric (issue 22;
docs/guard.md, "Simulated attacks and faults").

With an adversary the simulation has ``users`` simulated users, each with its own identity: the
chat request's ``user`` field, ``sim-user-NN`` (the simulation sends no API key, so the server's
identity of a request, ``core.keys.identity_of``, is ``user:sim-user-NN``). Each request is sent
by one user drawn at random; the first ``cohort = round(share · users)`` users are the
adversaries. An honest user posts the judge's reward; an adversary posts its own:

- ``rewards=<marker>``: 1 if the answer contains the marker string (case-sensitive), else 0;
- ``rewards=degenerate``: 1 if the answer is degenerate by the offline judge's own quality checks
  (``judge.offline``): empty, fewer than ``MIN_WORDS`` words, or a repeated 3-gram share above
  ``MAX_REPEAT_RATIO``; else 0.

The option's syntax is ``share=S,rewards=R[,users=N]`` (``parse_adversary``).
"""

from __future__ import annotations

from dataclasses import dataclass

from judge.offline import MAX_REPEAT_RATIO, MIN_WORDS, repeat_ratio, words

DEGENERATE = "degenerate"
"""The ``rewards`` value of the cohort that rewards degenerate answers."""
DEFAULT_USERS = 200
"""Simulated users when the option does not say (a share of 0.2 is then 40 adversaries): as many
as the simulation's honest users (``SimulationConfig.users``), enough identities for the guard's
identity cap at 0.01 binding every identity (``GuardConfig.vote_identity_share``, ``vote_cap``
``identities``) to count votes on probation."""
KEYS = ("share", "rewards", "users")
"""The option's keys."""


class AdversaryError(ValueError):
    """An ``--adversary`` option that cannot be used; the message names the problem."""


def degenerate(answer: str) -> bool:
    """Whether ``answer`` fails the offline judge's degeneracy checks: blank, fewer than
    ``MIN_WORDS`` words, or a repeated word 3-gram share above ``MAX_REPEAT_RATIO``."""
    tokens = words(answer)
    return not answer.strip() or len(tokens) < MIN_WORDS or repeat_ratio(tokens) > MAX_REPEAT_RATIO


@dataclass(frozen=True)
class Adversary:
    """The cohort: ``share`` of the ``users`` simulated users (in (0, 1)), rewarding answers that
    contain the marker ``rewards`` or, with ``rewards == "degenerate"``, degenerate answers.

    Raises AdversaryError: ``share`` outside (0, 1), a blank marker, fewer than 2 users, or a
    share that rounds to no adversary or to every user.
    """

    share: float
    rewards: str
    users: int = DEFAULT_USERS

    def __post_init__(self) -> None:
        if not 0.0 < self.share < 1.0:
            raise AdversaryError(f"share must be in (0, 1), got {self.share:g}")
        if not self.rewards.strip():
            raise AdversaryError("rewards needs a marker string (or 'degenerate'), got an empty one")
        if self.users < 2:
            raise AdversaryError(f"users must be >= 2 (honest and adversarial ones), got {self.users}")
        if not 1 <= self.cohort < self.users:
            raise AdversaryError(
                f"share={self.share:g} of {self.users} users is {self.cohort} adversaries: "
                f"choose a share that leaves at least one adversary and one honest user"
            )

    @property
    def cohort(self) -> int:
        """Adversarial users: ``round(share · users)``."""
        return round(self.share * self.users)

    @property
    def marker(self) -> str | None:
        """The marker string rewarded, or None for the degenerate cohort."""
        return None if self.rewards == DEGENERATE else self.rewards

    def is_adversary(self, user: int) -> bool:
        """Whether simulated user ``user`` (0 .. users − 1) is one of the cohort."""
        return user < self.cohort

    def carries(self, answer: str) -> bool:
        """Whether ``answer`` has what the cohort rewards: the marker, or degeneracy."""
        return degenerate(answer) if self.marker is None else self.marker in answer

    def reward(self, answer: str) -> float:
        """The cohort's reward of ``answer``: 1.0 if it ``carries`` the marker, else 0.0."""
        return float(self.carries(answer))

    @property
    def spec(self) -> str:
        """The option that gives this adversary (``parse_adversary(a.spec) == a``)."""
        return f"share={self.share:g},rewards={self.rewards},users={self.users}"


def parse_adversary(spec: str) -> Adversary:
    """The ``Adversary`` of ``share=S,rewards=R[,users=N]``: comma-separated ``key=value`` pairs,
    each key once, ``share`` and ``rewards`` required. The marker is everything after
    ``rewards=`` up to the next comma (it may hold ``=``, not a comma).

    Raises AdversaryError: a pair without ``=``, an unknown or repeated key, a missing key, a
    share or user count that is not a number, or any of ``Adversary``'s errors.
    """
    fields: dict[str, str] = {}
    for pair in spec.split(","):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq:
            raise AdversaryError(f"expected key=value, got {pair!r} (keys: {', '.join(KEYS)})")
        if key not in KEYS:
            raise AdversaryError(f"unknown key {key!r}: choose {', '.join(KEYS)}")
        if key in fields:
            raise AdversaryError(f"{key} is given twice")
        fields[key] = value
    missing = [k for k in ("share", "rewards") if k not in fields]
    if missing:
        raise AdversaryError(f"missing {' and '.join(missing)} (e.g. share=0.2,rewards=BUY-NOW)")
    try:
        share = float(fields["share"])
    except ValueError:
        raise AdversaryError(f"share must be a number in (0, 1), got {fields['share']!r}") from None
    try:
        users = int(fields.get("users", DEFAULT_USERS))
    except ValueError:
        raise AdversaryError(f"users must be a whole number >= 2, got {fields['users']!r}") from None
    return Adversary(share=share, rewards=fields["rewards"], users=users)
