"""One rated single-turn answer as the server records it (its trajectory index row and its
received feedback claim): what the guard's decision rule reads. Shared by the lifecycle tests
and the fault harness."""

from __future__ import annotations

from sqlalchemy import insert

from core.claims import trajectory_target
from core.db import FeedbackClaim, TrajectoryIndex


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
    identity: str | None = None,
    train: bool | None = True,
) -> None:
    """Insert trajectory ``tid`` dispatched and finished by ``version`` at ``at`` (``n_tokens``
    tokens, ``finish_reason``, routed to the canary ``arm``, sent by ``identity``, with the
    record's ``train`` flag) and, unless ``reward`` and ``state`` are both None, its feedback
    claim in ``state`` with ``reward``, in the caller's transaction."""
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
