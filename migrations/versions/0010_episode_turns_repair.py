"""Episode turns that revision 0006 could not number, numbered; a turn sent twice, the right copy.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

0006 backfilled ``episode_turns`` only from turns logged with a number, one row per number, the
copy with the smallest id. Two kinds of episodes logged before it were left broken:

* turns logged without a number (clients that sent none): no row, so the episode's feedback
  listed no turn (202, never trained), and a later turn started again at 0;
* a number logged twice (a retried turn): the copy kept could be the aborted one, so the episode
  counted an aborted turn and could never be rated.

Here every episode with a turn logged without a number, or a number logged more than once, gets
its logged turns again: of the copies of one number the newest whole answer (else the newest
copy); an episode with unnumbered turns is numbered 0, 1, 2... in the order its turns were
logged (numbered ones included), the others keep their numbers. ``trajectory_index.turn`` of
each turn kept is set to its number; the other copies are no turn of the episode (the learner
drops them as unlisted turns). A turn in flight keeps its row, renumbered after the logged ones
if its number is taken. Downgrade keeps the rows (they are valid at 0006).
"""

from collections import defaultdict

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

NOT_WHOLE = ("abort", "error")

index = sa.table(
    "trajectory_index",
    sa.column("id", sa.String),
    sa.column("episode_id", sa.String),
    sa.column("turn", sa.Integer),
    sa.column("finish_reason", sa.String),
    sa.column("created_at", sa.DateTime(timezone=True)),
)
turns = sa.table(
    "episode_turns",
    sa.column("trajectory_id", sa.String),
    sa.column("episode_id", sa.String),
    sa.column("dispatched_at", sa.DateTime(timezone=True)),
    sa.column("turn", sa.Integer),
    sa.column("logged_at", sa.DateTime(timezone=True)),
)


def _kept(copies: list) -> object:
    """Of the logged copies of one turn: the newest whole answer, else the newest copy."""
    whole = [c for c in copies if c.finish_reason not in NOT_WHOLE]
    return max(whole or copies, key=lambda c: (c.created_at, c.id))


def _numbering(logged: list) -> dict[int, object] | None:
    """Turn number → the copy kept, for an episode 0006 left broken; None for one it did not."""
    by_number: dict[int, list] = defaultdict(list)
    unnumbered = []
    for r in logged:
        (unnumbered if r.turn is None else by_number[r.turn]).append(r)
    if not unnumbered and all(len(c) == 1 for c in by_number.values()):
        return None
    if not unnumbered:
        return {k: _kept(c) for k, c in by_number.items()}
    ordered = sorted([_kept(c) for c in by_number.values()] + unnumbered, key=lambda r: (r.created_at, r.id))
    return dict(enumerate(ordered))


def upgrade() -> None:
    conn = op.get_bind()
    episodes: dict[str, list] = defaultdict(list)
    for r in conn.execute(
        sa.select(
            index.c.episode_id, index.c.id, index.c.turn, index.c.finish_reason, index.c.created_at
        ).where(index.c.episode_id.is_not(None))
    ):
        episodes[r.episode_id].append(r)
    for episode_id, logged in episodes.items():
        numbering = _numbering(logged)
        if numbering is None:
            continue
        kept = {r.id for r in numbering.values()}
        in_flight = conn.execute(
            sa.select(turns.c.trajectory_id, turns.c.turn).where(
                turns.c.episode_id == episode_id,
                turns.c.logged_at.is_(None),
                turns.c.trajectory_id.not_in(kept),
            )
        ).all()
        conn.execute(
            sa.delete(turns).where(
                turns.c.episode_id == episode_id,
                sa.or_(turns.c.logged_at.is_not(None), turns.c.trajectory_id.in_(kept)),
            )
        )
        next_free = max(numbering) + 1
        for tid, number in in_flight:
            if number is not None and number in numbering:
                conn.execute(sa.update(turns).where(turns.c.trajectory_id == tid).values(turn=next_free))
                next_free += 1
        conn.execute(
            sa.insert(turns),
            [
                dict(
                    trajectory_id=r.id,
                    episode_id=episode_id,
                    dispatched_at=r.created_at,
                    turn=k,
                    logged_at=r.created_at,
                )
                for k, r in sorted(numbering.items())
            ],
        )
        for k, r in numbering.items():
            if r.turn != k:
                conn.execute(sa.update(index).where(index.c.id == r.id).values(turn=k))


def downgrade() -> None:
    pass
