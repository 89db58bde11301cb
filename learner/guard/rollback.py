"""A rollback: an earlier version's weights published as a new version (docs/design.md §8,
§9.1; docs/guard.md, "The lifecycle").

Versions stay monotone: a rollback to version V commits version N + 1 whose weights are V's,
recorded ``promoted`` (an operator chose those weights, or the guard restores the promoted
version's) with its parent V and metrics ``{"rollback_to": V}``. An operator asks for one
through the ``rollback_to`` control flag (``POST /admin/rollback``); the guard asks directly
when it rejects a lineage. The flag is cleared in the commit of the new version only if it
still holds the request that was taken up (``core.control.clear_if``): a rollback requested
meanwhile is carried out next. A version unknown, rejected or whose weights were pruned can
never be restored: its request is refused and cleared at once, and counted.

The learner loads the weights and publishes (``learner.process.Learner.rollback``); this module
reads the request and the target and writes what the rollback commits beside its version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.engine import Connection, Engine, Row

from core import lifecycle_store
from core.control import ROLLBACK_TO, Flag, clear_if, read_flag
from core.db import bump_counter
from core.lifecycle import Stage
from core.policy_store import layout
from learner.publish import AlsoCommit, version_row

log = logging.getLogger(__name__)


def requested(db: Engine) -> tuple[int, Flag] | None:
    """The version the ``rollback_to`` flag asks for, with the flag as read; None when it is not
    set. A value that is not a version number asks for version -1, which no version is (it is
    refused like an unknown version)."""
    request = read_flag(db, ROLLBACK_TO)
    if request is None:
        return None
    try:
        version = int(request.value)
    except ValueError:
        version = -1
    return version, request


def restorable(db: Engine, version: int) -> Row | None:
    """The row of ``version`` when its weights can be published again; None when the database
    does not know it, it is ``rejected`` (it never serves again), or its folder holds no weights
    (pruned)."""
    row = version_row(db, version)
    if row is None or row.lifecycle == Stage.REJECTED or layout(row.path) is None:
        return None
    return row


@dataclass(frozen=True)
class Order:
    """A rollback taken up: to ``version``, by ``actor``, answering ``request`` (the
    ``rollback_to`` flag as read; None: not asked by the flag), committing ``also(conn,
    new_version, now)`` beside the new version (the guard's rejection of the lineage; None:
    nothing)."""

    version: int
    actor: str
    request: Flag | None
    also: AlsoCommit | None

    @classmethod
    def take(
        cls, db: Engine, version: int, request: Flag | None, actor: str, also: AlsoCommit | None
    ) -> Order:
        """The order for ``version``; with ``request`` None the flag is read now, and answered
        only if it asks for ``version``."""
        if request is None:
            current = read_flag(db, ROLLBACK_TO)
            request = current if current is not None and current.value == str(version) else None
        return cls(version, actor, request, also)

    def refuse(self, db: Engine) -> None:
        """Refuse it (``restorable`` found nothing): clear its request and count it
        (``rollback_refused``), in one transaction."""
        log.error("rollback to version %d refused: unknown, rejected, or its weights are gone", self.version)
        with db.begin() as conn:
            self._clear(conn)
            bump_counter(conn, "rollback_refused", 1)

    def commit(self, conn: Connection, new_version: int, now) -> None:
        """What the new version's commit holds beside its row (``learner.publish.AlsoCommit``):
        the request cleared, ``also``, and the new version's ``promoted`` event by ``actor``."""
        self._clear(conn)
        if self.also is not None:
            self.also(conn, new_version, now)
        reason = f"the weights of version {self.version} (rollback)"
        lifecycle_store.record_event(conn, new_version, None, Stage.PROMOTED, self.actor, reason, now)

    def _clear(self, conn: Connection) -> None:
        if self.request is not None:
            clear_if(conn, ROLLBACK_TO, self.request)
