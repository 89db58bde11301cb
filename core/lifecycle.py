"""The version lifecycle: the stages of a policy version, which moves between them are allowed,
the lineage a candidate belongs to, and the guard's verdict on that lineage.

Pure: rows in, decisions out; the database side is ``core/lifecycle_store.py``. Source:
docs/design.md §9.1 and docs/guard.md, "The lifecycle".

Stages. A new version is a ``candidate`` until the gate (``learner.guard.gate``) has run on it: it
fails → ``rejected`` (never announced, never served); it passes → ``canary``. An engine that
serves adapters gives a canary its share of the requests (below); a single full-weight engine
serves it to all traffic under *probation*. Either way it stays under watch until the decision
rule promotes it (``promoted``) or rejects it (``rejected``).
A rejected version never serves again; ``rejected`` is final. An operator may also reject a
promoted version (other than the base, version 0, the last resort every deployment has).

Lineage. The versions the learner published since the newest promoted version (each trained
from the one before) that are still ``candidate`` or ``canary``: the guard judges them together,
since in probation each serves for a single step's worth of answers. A promotion promotes the
whole lineage (each member was part of the record that earned it); a rejection rejects the whole
lineage, and the learner goes back to the promoted version.

The verdict (``judge_lineage``): the lineage's rated answers are one arm of
``core.sequential.decide`` (the anytime-valid PrPl-EB confidence-sequence comparison), the
promoted versions' most recent rated answers from *before* the lineage started the other.
In probation these are two different time windows: any drift between them (a change of the
target style, of the prompt mix, of the judge) is confounded with the version's effect and
can make a good lineage look worse or a bad one better; the rule's α does not cover that. A
canary share served beside the promoted version takes both arms from one window and is not
confounded this way (docs/guard.md, "The decision rule").

The canary share (``CanarySplit``, ``route``). An engine that serves versions as LoRA adapters
holds the promoted version and the lineage's newest side by side, so each new request draws its
arm: the lineage with probability ``share`` (``canary``), else the promoted version
(``control``). The arm is logged with the trajectory; when the lineage's rated answers carry
arms, the verdict compares the lineage's canary arm with the control arm of the same window
(both drawn from one stream of requests, so drift reaches both alike). The share is bounded
(``CANARY_SHARE_MIN``, ``CANARY_SHARE_MAX``; ``check_canary_share`` is the one check every entry
uses: the control flag, the setting, the split).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from core.sequential import RuleParams, Verdict, decide


class Stage(StrEnum):
    """A policy version's stage in the lifecycle."""

    CANDIDATE = "candidate"
    CANARY = "canary"
    PROMOTED = "promoted"
    REJECTED = "rejected"


ALLOWED: dict[Stage, frozenset[Stage]] = {
    # promoted straight from candidate: the guard is off, or the version carries a promoted
    # version's weights (a rollback), or an operator promotes it.
    Stage.CANDIDATE: frozenset({Stage.CANARY, Stage.PROMOTED, Stage.REJECTED}),
    Stage.CANARY: frozenset({Stage.PROMOTED, Stage.REJECTED}),
    Stage.PROMOTED: frozenset({Stage.REJECTED}),
    Stage.REJECTED: frozenset(),
}
"""The moves allowed from each stage; ``rejected`` is final."""


ENDED_FINISHES = ("stop", "length", "repetition")
"""The finish reasons of answers the model ended or its budget did (not aborted, not failed):
the answers whose health (``healthy``) says something about the version."""


def healthy(finish_reason: str, n_tokens: int, min_tokens: int) -> bool:
    """Whether an answer that ended with ``finish_reason`` after ``n_tokens`` response tokens is
    a sound one, for the guard's health veto (docs/guard.md, "The health veto"): cut by its token
    budget (``length``), or ended by the model (``stop``) after at least ``min_tokens`` tokens.
    An answer the model ends at once (empty, a word) or that vLLM stops as ``repetition`` is
    degenerate, what a broken update produces first. Call it on ``ENDED_FINISHES`` answers only.
    """
    return finish_reason == "length" or (finish_reason == "stop" and n_tokens >= min_tokens)


def drifted(kl_refs: Sequence[float | None], bound: float) -> float | None:
    """The first of a lineage's measured KLs to the base that passes ``bound``, or None (the
    guard's drift veto, docs/guard.md "The drift veto").

    ``kl_refs``: nats per action token, one per version of the lineage in version order, None
    where not measured (e.g. the KL anchor off): the caller's measure of each version's drift
    (``learner.guard.guard.drift_from_promoted``: beyond the promoted version's).
    """
    return next((kl for kl in kl_refs if kl is not None and kl > bound), None)


class Arm(StrEnum):
    """The arm of a canary share a request was routed to (``route``)."""

    CANARY = "canary"
    CONTROL = "control"


GUARD = "guard"
"""The actor of the decision rule's transitions (operators are recorded by name)."""

LEARNER = "learner"
"""The actor of the learner's transitions (the gate's verdict, a rollback's version)."""


class TransitionError(ValueError):
    """A move the lifecycle does not allow; the message names the version and both stages."""


@dataclass(frozen=True)
class VersionStage:
    """One version's place in the lifecycle: ``version`` (int >= 0) and its ``stage``."""

    version: int
    stage: Stage


def check_transition(version: int, current: Stage | str, target: Stage | str) -> Stage:
    """The target stage if ``version`` may move from ``current`` to it.

    Raises:
        TransitionError: an unknown stage, the same stage, a move ``ALLOWED`` lacks, or the
            rejection of version 0 (the base model, the fallback of every rejection).
    """
    try:
        cur, tgt = Stage(current), Stage(target)
    except ValueError:
        raise TransitionError(
            f"unknown stage in {current!r} -> {target!r}: stages are {', '.join(Stage)}"
        ) from None
    if cur == tgt:
        raise TransitionError(f"version {version} is already {cur}")
    if version == 0 and tgt == Stage.REJECTED:
        raise TransitionError(
            "version 0 (the base model) cannot be rejected: every rejection falls back to it"
        )
    if tgt not in ALLOWED[cur]:
        raise TransitionError(f"version {version} cannot go from {cur} to {tgt}")
    return tgt


def promoted(versions: Iterable[VersionStage]) -> int:
    """The promoted version: the newest one whose stage is ``promoted``.

    Raises:
        ValueError: none is promoted (a database always has version 0, recorded promoted).
    """
    best = max((v.version for v in versions if v.stage == Stage.PROMOTED), default=None)
    if best is None:
        raise ValueError("no promoted version is recorded")
    return best


def descendants(parents: Mapping[int, int | None], version: int) -> list[int]:
    """The versions trained from ``version``, directly or through others, oldest first
    (``parents``: each recorded version → the version it was trained from, or whose weights it
    restores; None for the base).

    The rule of a rejection (docs/guard.md, "Rejecting a version"): a rejected version's
    descendants carry its update (a rollback's version carries its weights), so they are
    rejected with it, whatever their stage. Versions are numbered in the order they were made
    and a parent is always older, so one pass in version order finds them all.
    """
    out: list[int] = []
    tainted = {version}
    for v in sorted(parents):
        if v > version and parents[v] in tainted:
            tainted.add(v)
            out.append(v)
    return out


def lineage(versions: Iterable[VersionStage]) -> list[int]:
    """The candidate lineage, oldest first: the versions newer than the promoted one whose stage
    is ``candidate`` or ``canary`` (rejected versions are out of it). Empty when the promoted
    version is the newest not rejected. Raises ``ValueError`` as :func:`promoted` does."""
    rows = list(versions)
    top = promoted(rows)
    return sorted(v.version for v in rows if v.version > top and v.stage in (Stage.CANDIDATE, Stage.CANARY))


def judge_lineage(
    lineage_rewards: Sequence[float],
    promoted_rewards: Sequence[float],
    params: RuleParams,
    elapsed_s: float | None = None,
) -> Verdict:
    """The decision rule on the lineage's rated answers against the promoted record.

    Args:
        lineage_rewards: rewards in [0, 1] of the answers the lineage's versions served, in the
            order their ratings were received.
        promoted_rewards: rewards in [0, 1] of the promoted versions' answers (in probation:
            rated before the lineage's first version was published; the confound above).
        params: δ, α, minimum samples, time-outs (``core.sequential.RuleParams``).
        elapsed_s: seconds since the lineage's first version was published (time-out).

    Returns:
        ``core.sequential.decide``'s verdict: ``promote`` when the lineage is not worse by more
        than δ, ``reject`` when it is worse, ``params.on_timeout`` at a time-out, else
        ``continue``.

    Raises:
        ValueError: a reward outside [0, 1] or not finite, a negative ``elapsed_s``.
    """
    return decide(lineage_rewards, promoted_rewards, params, elapsed_s=elapsed_s)


CANARY_SHARE_MIN = 0.01
CANARY_SHARE_MAX = 0.99
"""The canary share's bounds, both included: each arm of a split gets at least 1% of new requests.

Why: the verdict of a split compares the canary arm's rated answers with the control arm's of
the same window, and neither bound decides until each arm has ``min_samples`` ratings
(``core.sequential.RuleParams``, 20 by default). At a share ``s`` that takes at least
``min_samples / min(s, 1 − s)`` rated answers in all: 100 at the default 0.2, 2 000 at 0.01,
about 4·10^325 at 5e-324, which no deployment ever collects; a decision needs many more
(docs/log/2026-12-03-guard-runs.md). A share below 1% is a misconfiguration, not a cautious canary. At the other end a share of 1 routes every
request to the canary (``route``: a draw in [0, 1) is always below it), so the control arm gets
no rating, the bounds never decide, and the lineage waits for the time-out: the share must leave
the control arm its own 1%.
"""


def check_canary_share(share: object, name: str = "share") -> float:
    """``share`` as a float if it is a number in [``CANARY_SHARE_MIN``, ``CANARY_SHARE_MAX``].

    ``name`` names the field in the message (``canary_share`` for the setting and the flag).

    Raises:
        ValueError: not a number (a bool is none), NaN, infinite, or outside the bounds; the
            message names the field, the bounds and why.
    """
    number = isinstance(share, int | float) and not isinstance(share, bool)
    if not number or not CANARY_SHARE_MIN <= share <= CANARY_SHARE_MAX:
        raise ValueError(
            f"{name} must be a number in [{CANARY_SHARE_MIN}, {CANARY_SHARE_MAX}], not {share!r}: below "
            f"{CANARY_SHARE_MIN} the canary arm cannot collect its min_samples ratings in any sensible "
            f"time, above {CANARY_SHARE_MAX} the control arm cannot (docs/guard.md, 'The canary share')"
        )
    return float(share)


@dataclass(frozen=True)
class CanarySplit:
    """A canary share in effect on one engine.

    ``lineage``: the versions of the candidate lineage (any may be the engine's current
    version); ``control``: the promoted version, held loaded beside them (0: the base weights);
    ``share``: the probability that a new request goes to the lineage, in
    [``CANARY_SHARE_MIN``, ``CANARY_SHARE_MAX``].

    Raises ValueError for a share ``check_canary_share`` refuses, an empty lineage, or a control
    version inside the lineage.
    """

    lineage: frozenset[int]
    control: int
    share: float

    def __post_init__(self) -> None:
        check_canary_share(self.share)
        if not self.lineage:
            raise ValueError("a canary split needs a lineage")
        if self.control in self.lineage:
            raise ValueError(f"the control version {self.control} is in the lineage {sorted(self.lineage)}")


def arm_key(key_id: str | None, user: str | None, address: str | None) -> str | None:
    """What a request's canary arm is sticky to (``sticky_draw``), or None (no way to tell).

    The API key's id when a key authenticated the request: every retry, turn and episode of a
    key lands in one arm per lineage. Else the request's ``user`` field: without keys the
    server trusts it as the identity everywhere (the identity cap, forget), and a deployment
    that must resist clients choosing who they are requires keys (``require_keys``: then a
    request with ``user`` and no key is refused). Else the client's address, which a client
    cannot change cheaply from one request to the next, where the request body (prompt,
    episode id) is the client's to vary at will. Episode turns follow from these: all turns
    come from one key, user or address.
    """
    if key_id is not None:
        return f"key:{key_id}"
    if user is not None:
        return f"user:{user}"
    if address is not None:
        return f"addr:{address}"
    return None


def sticky_draw(secret: str, salt: str, key: str) -> float:
    """A uniform number in [0, 1) fixed by ``key`` within ``salt``, unknowable without ``secret``.

    ``HMAC-SHA256(secret, salt | key)``'s first 8 bytes as an integer / 2**64. ``salt`` names the
    lineage (its policy and first version: ``CanaryRouter``), so each lineage draws its canary
    cohort afresh and no key is the canary of every lineage; ``secret`` (the server's feedback
    secret, shared by the replicas, so they agree on every key's arm) keeps a client from
    computing which keys fall in which arm. A retry draws the same number, so it gets the same
    arm; over distinct keys the draws are uniform, so the canary's share of keys is ``share``
    in expectation (of requests, when keys send alike).
    """
    digest = hmac.new(secret.encode(), f"{salt}|{key}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def route(
    split: CanarySplit | None,
    current: int,
    draw: float,
    rejected: frozenset[int] = frozenset(),
    fallback: int | None = None,
) -> tuple[int, Arm | None]:
    """The version a new request is dispatched at, and its arm.

    Args:
        split: the canary share in effect, or None (no split: probation, the guard off, an
            engine without adapters).
        current: the version the engine serves new requests with (its newest loaded).
        draw: a number in [0, 1): ``sticky_draw`` of the request's ``arm_key``, or a uniform
            draw per request when it has none.
        rejected: the versions known rejected; a new request never goes to one.
        fallback: where a request goes when ``current`` is rejected (the promoted version the
            engine holds, else the base weights); None: nothing else can serve.

    Returns:
        ``(fallback, None)`` when ``current`` is rejected and a fallback exists (issue 40: from
        the instant of a rejection its requests go to the control); ``(current, None)`` without
        a split or when ``current`` is not in the split's lineage (the engine has moved past it:
        a promotion or a rollback the split has not seen yet); else ``(current, Arm.CANARY)``
        when ``draw < share``, ``(control, Arm.CONTROL)`` otherwise. So over n requests the
        canary's count is Binomial(n, share).

    Raises:
        ValueError: ``draw`` outside [0, 1).
    """
    if not 0.0 <= draw < 1.0:
        raise ValueError(f"a draw is in [0, 1), not {draw!r}")
    if current in rejected and fallback is not None:
        return fallback, None
    if split is None or current not in split.lineage:
        return current, None
    if draw < split.share:
        return current, Arm.CANARY
    return split.control, Arm.CONTROL
