"""Rows the guard reads, written by hand: a rated single-turn answer as the server records it
(``add_rated``: its trajectory index row and its received feedback claim), a policy version as
the learner writes it (``add_version``), and a lineage with quarantined samples (``seed``); and
docs/guard.md's lower bound written out one rating at a time (``prpl_eb_lower``). Shared by the
lifecycle and canary tests and the fault harness."""

from __future__ import annotations

import math

from sqlalchemy import insert

from core.claims import trajectory_target
from core.db import (
    FeedbackClaim,
    PolicyVersion,
    TrajectoryIndex,
    make_engine,
    migrate,
)
from core.lifecycle_store import (
    quarantine,
)
from core.records import utcnow

OWN = "own"
"""``add_rated``'s default sender: the row's own identity."""


def add_rated(
    conn,
    tid: str,
    version: int,
    reward: float | None,
    at,
    state: str = "received",
    arm: str | None = None,
    n_tokens: int = 8,
    finish_reason: str = "stop",
    identity: str | None = OWN,
    train: bool | None = True,
) -> None:
    """Insert trajectory ``tid`` dispatched and finished by ``version`` at ``at`` (``n_tokens``
    tokens, ``finish_reason``, routed to the canary ``arm``, sent by ``identity``, with the
    record's ``train`` flag) and, unless ``reward`` and ``state`` are both None, its feedback
    claim in ``state`` with ``reward``, in the caller's transaction. ``identity`` ``OWN`` (the
    default): ``user:<tid>``, a sender of its own, so hand-written rows vote under the guard's
    default identity cap as many distinct raters do; None: anonymous (never votes under it)."""
    if identity == OWN:
        identity = f"user:{tid}"
    conn.execute(
        insert(TrajectoryIndex).values(
            id=tid,
            prompt_id="p",
            dispatch_version=version,
            last_version=version,
            n_response_tokens=n_tokens,
            finish_reason=finish_reason,
            log_partition=0,
            log_offset=0,
            created_at=at,
            arm=arm,
            identity=identity,
            train=train,
        )
    )
    if reward is None and state is None:
        return  # served, never rated
    conn.execute(
        insert(FeedbackClaim).values(
            target=trajectory_target(tid), state=state, reward=reward, claimed_at=at, received_at=at
        )
    )


# ------------------------------------------------------------------ the verdict
def prpl_eb_lower(xs: list[float], alpha_side: float, cap: float = 0.5) -> float:
    """docs/guard.md's formulas written out one rating at a time (lower bound, no intersection
    needed for a constant stream... kept anyway: the running max)."""
    log_inv = math.log(1 / alpha_side)
    s_x = s_sq = s_lam = s_lamx = s_pen = 0.0
    best = 0.0
    for i, x in enumerate(xs, start=1):
        mu_prev = (0.5 + s_x) / i  # μ̂_{i−1}
        var_prev = (0.25 + s_sq) / i  # σ̂²_{i−1}
        lam = min(cap, math.sqrt(2 * log_inv / (var_prev * i * math.log(1 + i))))
        s_x += x
        s_sq += (x - (0.5 + s_x) / (i + 1)) ** 2
        s_lam += lam
        s_lamx += lam * x
        s_pen += (x - mu_prev) ** 2 * (-math.log(1 - lam) - lam)
        best = max(best, (s_lamx - log_inv - s_pen) / s_lam)
    return min(max(best, 0.0), 1.0)


def add_version(
    conn, version: int, lifecycle: str = "canary", at=None, root: str = "/p", sha256: str = "0" * 64
) -> None:
    """A ``policy_versions`` row as the learner writes it: published at ``root``/v<version>, the
    parent the version before, recorded ``at`` (default now) in stage ``lifecycle``."""
    conn.execute(
        insert(PolicyVersion).values(
            version=version,
            path=f"{root}/v{version}",
            sha256=sha256,
            status="published",
            parent_version=version - 1 if version else None,
            metrics={},
            created_at=at or utcnow(),
            lifecycle=lifecycle,
        )
    )


def seed(url: str) -> None:
    """Versions 0, 1 promoted; 2, 3 canary (the lineage); 4 rejected; two quarantined samples."""
    migrate(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        for v, stage in enumerate(("promoted", "promoted", "canary", "canary", "rejected")):
            add_version(conn, v, stage)
        quarantine(conn, {4: ["t00001", "t00002"]}, "trained a version the gate rejected", utcnow())
    engine.dispose()
