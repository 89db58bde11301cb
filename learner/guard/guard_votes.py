"""Who votes in the guard: the rating and health streams the decision rule and the health veto
read, with each identity's weight bounded and the answers that may not vote left out
(docs/guard.md, "Who votes"; issue 40, items 1 and 6).

A vote is one rated answer (the reward rule) or one ended answer (the health veto), with who
sent the request (``trajectory_index.identity``: ``key:<key id>`` or ``user:<user field>``) and
whether it may train. An answer does not vote when:

- it was logged ``train: false``: ``store: false``, a key that had opted out, and the traffic
  that is not production, which is sent that way (the judge's own probes, a shadow copy of a
  request: docs/guard.md, "Who votes");
- its API key has opted out of training *now* (``api_keys.train`` false), whatever the record
  says: an opt-out reaches the answers logged before it, for votes as for training
  (``learner.data.joiner``);
- the identity cap binds every identity (``GuardConfig.vote_cap`` ``identities``) and it has
  no identity (no key and no ``user``): an unknown sender could vote without bound, since the
  cap counts each anonymous answer as its own identity.

The rest pass the identity cap per arm (``learner.data.identity_cap.admit_stream`` with the
guard's ``vote_identity_share``, ``Electorate.of``): in each window of an arm's stream a bound
identity has at most ``max(1, ⌊share · window⌋)`` votes, as it has at most that many samples
in a batch, and its votes beyond that never count (they are *held back*: ``Tally``). So one
bound identity, whatever it sends, holds at most the share of each arm's votes (up to the last,
partial window), moves each arm's mean by at most the share, and Δ = μ_canary − μ_control by
at most ``share · (1 + |Δ|)``. Which identities are bound (``GuardConfig.vote_cap``): by
default the API keys (``keys``), the identities a client cannot choose once keys are required;
``user`` fields and anonymous answers pass as identities of their own, as they would evade a
cap anyway (a client sets ``user`` as it likes, or leaves it out); ``identities`` binds the
``user`` fields too. A trusted key (``core.keys.trusted_keys``: the operator vouches that its
traffic is many people's, a backend relaying its users, or a judge's) is never bound: each of
its votes passes as an identity of its own, and it is no sender in ``Senders``.

The queries read the caller's connection and apply the exclusions in SQL (so ``limit`` counts
voting answers), given the keys that opted out as read from the key registry; ``ballot`` is
the same rule in pure form, applied again to what they return, and what the simulations of
``bench/bench_guard_votes.py`` call.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy import and_, literal, or_, select
from sqlalchemy.engine import Connection

from core.claims import TRAJECTORY_PREFIX
from core.db import FeedbackClaim, TrajectoryIndex
from core.keys import KEY_IDENTITY
from core.lifecycle import ENDED_FINISHES, Arm, healthy
from core.lifecycle_store import answers_window
from learner.data.identity_cap import admit_stream
from learner.guard.guard_config import GuardConfig, VoteCap

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Electorate:
    """Who votes: ``max_share`` the identity cap (None: off, and anonymous answers vote),
    ``window`` the votes per window of the cap (≥ 1; ``of``), ``binds`` the identities the cap
    bounds (``VoteCap``), ``trusted`` the keys' identities (``key:<key id>``) it never bounds
    (``core.keys.trusted_keys``, read with each check: ``with_trusted``)."""

    max_share: float | None
    window: int
    binds: VoteCap = VoteCap.KEYS
    trusted: frozenset[str] = frozenset()

    def bound(self, identity: str | None) -> str | None:
        """The identity the cap counts ``identity``'s vote under: itself when the cap binds it,
        else None (a vote of its own, as an anonymous one). E.g. with ``binds`` keys,
        ``user:ann`` → None and ``key:k1`` → ``key:k1``, unless ``key:k1`` is trusted."""
        if identity is None or identity in self.trusted:
            return None
        if self.binds == VoteCap.KEYS and not identity.startswith(KEY_IDENTITY):
            return None
        return identity

    def with_trusted(self, trusted: frozenset[str]) -> Electorate:
        """This electorate with the registry's trusted keys now."""
        return replace(self, trusted=trusted)

    @classmethod
    def of(cls, max_share: float | None, batch_size: int, binds: VoteCap = VoteCap.KEYS) -> Electorate:
        """The learner's cap on its votes: windows of ``batch_size`` votes, as its batches, or
        of ``⌈1/max_share⌉`` when that is longer, so that ``k = max(1, ⌊share·window⌋)`` is the
        share itself: a batch cannot hold less than one sample of an identity (k ≥ 1 of B),
        an arm's stream of votes has no such floor. E.g. share 0.01 with batch 16: windows of
        100 votes, one vote of an identity each (a batch: 1 of 16)."""
        if max_share is None:
            return cls(None, batch_size, binds)
        return cls(max_share, max(batch_size, math.ceil(1.0 / max_share - 1e-9)), binds)


@dataclass(frozen=True)
class Vote:
    """One answer's vote: ``value`` in [0, 1] (a reward, or 1.0/0.0 for a sound/degenerate
    answer), ``identity`` who sent the request (None: nobody known), ``train`` the record's
    flag (None: indexed before revision 0016), ``key_train`` the key's setting now (None: not a
    key, or a key the registry does not hold)."""

    value: float
    identity: str | None
    train: bool | None = None
    key_train: bool | None = None


@dataclass(frozen=True)
class Tally:
    """One arm's stream after the cap: ``votes`` those that count, in order; ``held_back`` how
    many of those that may vote it did not count (a bound sender past its share, waiting for a
    window the others' votes cannot fill): what shows an operator that the cap, not the
    ratings, is holding a verdict (docs/guard.md, "Watching who votes")."""

    votes: list[Vote]
    held_back: int = 0


def may_vote(vote: Vote, electorate: Electorate) -> bool:
    """Whether ``vote`` may vote at all (module docstring): not opted out by its record or by
    its key now, and, with a cap that binds every identity, from a known identity."""
    if vote.train is False or vote.key_train is False:
        return False
    return not _identified_only(electorate) or vote.identity is not None


def _identified_only(electorate: Electorate) -> bool:
    return electorate.max_share is not None and electorate.binds == VoteCap.IDENTITIES


def counted(votes: Sequence[Vote], electorate: Electorate) -> list[Vote]:
    """The votes that count, in order: those that ``may_vote``, then the identity cap over them
    (``admit_stream``) on the identities it binds (``Electorate.bound``). Raises ValueError for
    a cap ``admit_stream`` refuses.

    E.g. share 0.5, window 2 (a sender's one vote per window): votes t, t, t, t, a count t, a
    (window 1), then t (the partial window 2): 3 of 5, the last two t wait for a window they
    cannot fill; with ``key:t`` trusted, all 5 count (t, t | t, t | a)."""
    return tally(votes, electorate).votes


def tally(votes: Sequence[Vote], electorate: Electorate) -> Tally:
    """``counted``, with how many of the votes that may vote the cap held back."""
    eligible = [v for v in votes if may_vote(v, electorate)]
    if electorate.max_share is None:
        return Tally(eligible)
    bound = [electorate.bound(v.identity) for v in eligible]
    kept = [eligible[i] for i in admit_stream(bound, electorate.window, electorate.max_share)]
    return Tally(kept, len(eligible) - len(kept))


def ballot(votes: Sequence[Vote], electorate: Electorate) -> list[float]:
    """The values of the votes that count (``counted``), in order."""
    return values(counted(votes, electorate))


def values(votes: Sequence[Vote]) -> list[float]:
    """The values of ``votes``, in order (what the decision rule reads)."""
    return [v.value for v in votes]


@dataclass(frozen=True)
class Senders:
    """Who holds one arm's counted votes (docs/guard.md, "Watching who votes"): ``votes`` the
    arm's counted votes; ``identified`` the distinct senders among them with an identity (an
    API key, or a ``user`` field); ``top_share`` the largest share of the ``votes`` one of them
    holds (0.0 when none is identified); ``held_back`` the votes the cap did not count
    (``Tally``). Anonymous votes count in ``votes`` and for no sender:
    an anonymous flood cannot be told from many anonymous users."""

    votes: int
    identified: int
    top_share: float
    held_back: int = 0

    @classmethod
    def of(cls, tally: Tally, trusted: frozenset[str] = frozenset()) -> Senders:
        """Who holds ``tally``'s counted votes, and how many it held back; a ``trusted`` key's
        votes count for no sender, as anonymous ones (the operator vouched that they are many
        people's). E.g. votes of a, a, a, b and one anonymous: 5 votes, 2 identified, a holds
        3/5 = 0.6; with a trusted: 1 identified, b holds 1/5 = 0.2."""
        votes = tally.votes
        held = Counter(v.identity for v in votes if v.identity is not None and v.identity not in trusted)
        top = max(held.values(), default=0)
        return cls(len(votes), len(held), top / len(votes) if votes else 0.0, tally.held_back)


def _voters(q, electorate: Electorate, opted_out: frozenset[str]):
    """``q`` without the answers that may not vote (``may_vote``): ``train`` false, a sender in
    ``opted_out`` (keys whose training is off now), and, with a cap that binds every identity,
    no sender."""
    q = q.where(or_(TrajectoryIndex.train.is_(None), TrajectoryIndex.train.is_(True)))
    if opted_out:
        q = q.where(
            or_(TrajectoryIndex.identity.is_(None), TrajectoryIndex.identity.not_in(sorted(opted_out)))
        )
    if _identified_only(electorate):
        q = q.where(TrajectoryIndex.identity.is_not(None))
    return q


def _vote(value: float, identity: str | None, train: bool | None, opted_out: frozenset[str]) -> Vote:
    return Vote(value, identity, train, False if identity in opted_out else None)


def rated_votes(
    conn: Connection,
    versions: Iterable[int],
    electorate: Electorate,
    opted_out: frozenset[str] = frozenset(),
    *,
    before: datetime | None = None,
    since: datetime | None = None,
    arm: Arm | None = None,
    limit: int | None = None,
) -> Tally:
    """The votes (rewards) that count, of the rated single-turn answers ``versions`` dispatched
    (``trajectory_index.dispatch_version``), oldest rating first, after ``counted``; ``opted_out``
    the senders whose key's training is off now (``core.keys.opted_out_keys``, read from the
    key registry, which a tenant namespace does not hold).

    ``before`` / ``since``: answers dispatched before / at or after this time; ``arm``: routed
    to that canary arm; ``limit``: the newest ``limit`` voting ratings before the cap. Episodes'
    feedback rates several answers at once and is not counted (docs/guard.md, "The lifecycle").
    """
    wanted = list(versions)
    if not wanted:
        return []
    q = (
        select(
            FeedbackClaim.reward,
            TrajectoryIndex.identity,
            TrajectoryIndex.train,
        )
        .select_from(FeedbackClaim)
        .join(TrajectoryIndex, FeedbackClaim.target == literal(TRAJECTORY_PREFIX) + TrajectoryIndex.id)
        .where(
            FeedbackClaim.state == "received",
            FeedbackClaim.reward.is_not(None),
            TrajectoryIndex.dispatch_version.in_(wanted),
        )
    )
    q = answers_window(_voters(q, electorate, opted_out), before, since, arm)
    q = q.order_by(FeedbackClaim.received_at.desc(), FeedbackClaim.target.desc())
    if limit is not None:
        q = q.limit(limit)
    rows = reversed(conn.execute(q).all())
    return tally([_vote(float(r.reward), r.identity, r.train, opted_out) for r in rows], electorate)


def health_votes(
    conn: Connection,
    versions: Iterable[int],
    min_tokens: int,
    electorate: Electorate,
    opted_out: frozenset[str] = frozenset(),
    *,
    before: datetime | None = None,
    since: datetime | None = None,
    arm: Arm | None = None,
    limit: int | None = None,
) -> Tally:
    """The votes that count, 1.0 for each sound answer ``versions`` dispatched, 0.0 for each
    degenerate one (``core.lifecycle.healthy``), rated or not, oldest first, after ``counted``: every answer
    that ended (``ENDED_FINISHES``). ``before``, ``since``, ``arm`` and ``limit`` as for
    ``rated_votes``."""
    wanted = list(versions)
    if not wanted:
        return []
    q = (
        select(
            TrajectoryIndex.finish_reason,
            TrajectoryIndex.n_response_tokens,
            TrajectoryIndex.identity,
            TrajectoryIndex.train,
        )
        .select_from(TrajectoryIndex)
        .where(
            and_(
                TrajectoryIndex.dispatch_version.in_(wanted),
                TrajectoryIndex.finish_reason.in_(ENDED_FINISHES),
            )
        )
    )
    q = answers_window(_voters(q, electorate, opted_out), before, since, arm)
    q = q.order_by(TrajectoryIndex.created_at.desc(), TrajectoryIndex.id.desc())
    if limit is not None:
        q = q.limit(limit)
    rows = reversed(conn.execute(q).all())
    votes = [
        _vote(
            float(healthy(r.finish_reason, r.n_response_tokens, min_tokens)), r.identity, r.train, opted_out
        )
        for r in rows
    ]
    return tally(votes, electorate)


def warn_vote_cap_scope(guard: GuardConfig) -> None:
    """Warn when a config sets the vote cap's share but not which senders it binds: before
    ``GuardConfig.vote_cap`` the cap bound every identity, ``user`` fields included; now it binds
    API keys unless ``vote_cap`` says ``identities`` (docs/guard.md, "Who votes")."""
    given = guard.model_fields_set
    if guard.vote_identity_share is not None and "vote_identity_share" in given and "vote_cap" not in given:
        log.warning(
            "guard.vote_identity_share is set and guard.vote_cap is not: the cap binds API keys only "
            '(vote_cap "%s"); "user" fields and anonymous answers vote unbound. Set vote_cap '
            '"identities" to bind them too, as the cap did before vote_cap existed',
            guard.vote_cap,
        )
