"""The server's storage health: the database and the log (docs/design.md §8).

A storage failure is answered 503 with ``Retry-After`` on every route (``is_storage_error``
names the exceptions that mean "the database or the log is down", as opposed to a bug).
``Health.require`` refuses a chat before any work while a dependency is known to be down, so
no answer is generated whose record could not be stored; ``Health.report`` is ``/readyz``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from core.breaker import Breaker, Unavailable
from core.logbus import LogTransport
from core.policies import GLOBAL
from server.policy_log import PolicyLog

if TYPE_CHECKING:
    from server.policy_watch import PolicyWatcher


# Seconds a client is asked to wait before retrying after a 503 (the breakers' cooldown is 1 s
# and a probe takes at most ~1 s, so by then the server knows whether storage is back).
RETRY_AFTER_S = 2


class DatabaseUnavailable(Unavailable):
    """The database did not answer (stopped, unreachable, or out of connections)."""


def _storage_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [
        Unavailable,
        OperationalError,
        InterfaceError,
        DisconnectionError,
        PoolTimeoutError,
    ]
    try:
        import psycopg
    except ImportError:
        return tuple(types)
    return (*types, psycopg.OperationalError, psycopg.InterfaceError)


# Exceptions meaning "the database or the log is unavailable" (each gets the 503 handler).
STORAGE_ERROR_TYPES = _storage_error_types()


def is_storage_error(exc: BaseException) -> bool:
    """True if ``exc`` means the database or the log is unavailable (retry later)."""
    if isinstance(exc, STORAGE_ERROR_TYPES):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


class Health:
    """Breakers for the database and the log of one policy's state; ``policy`` (``GLOBAL`` or a
    tenant) starts each of its log lines (``server.policy_log``)."""

    def __init__(self, db: Engine, log: LogTransport, log_required: bool, policy: str = GLOBAL):
        self.logger = PolicyLog(logging.getLogger(__name__), policy)
        self.engine = db
        self.log = log
        self.log_required = log_required
        self.db = Breaker("the database", self._probe_db, DatabaseUnavailable)
        # The app's policy watcher, when it follows the policy topic: a replica that has not
        # caught up with it is not ready and takes no chat.
        self.policy: PolicyWatcher | None = None
        # The last state /readyz reported per dependency: a change is logged, a repeat is not.
        self._reported: dict[str, str] = {}
        event.listen(db, "handle_error", self._on_db_error)

    def _probe_db(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def _on_db_error(self, ctx) -> None:
        # Every statement that fails for want of a connection opens the breaker, so the next
        # chat is refused before generating instead of failing after it.
        if ctx.is_disconnect or ctx.connection is None:
            self.db.trip(str(ctx.original_exception))

    def require(self) -> None:
        """Raise DatabaseUnavailable or LogUnavailable if a record could not be stored now,
        CatchingUp (server/policy_watch.py) while the replica has not caught up with the policy
        topic since it started.

        With ``log_required`` off, records go to the local spool while the log is down, so
        only the database is required.
        """
        self.db.check()
        if self.log_required:
            self.log.check()
        if self.policy is not None:
            self.policy.require()

    async def report(self, timeout_s: float = 2.0) -> dict[str, str]:
        """``{"database": ..., "log": ..., "policy": ...}``, each "ok" or which one is down and
        the exception's class (``the SQL log is unavailable (LogUnavailable)``); probes run in
        threads and are cut off after ``timeout_s`` (a paused server may not answer at all).
        ``policy`` is ``PolicyWatcher.readiness`` (``catching up: serves version 0, the policy
        topic's newest is 5``), "ok" when the app does not follow the topic.

        Unauthenticated, so never the failure's text: a breaker tripped by a failed statement
        holds its SQL and bound parameters, another request's data. The text goes to the
        server's log, once each time a dependency's state changes.
        """

        async def one(part: str, name: str, check) -> str:
            try:
                await asyncio.wait_for(asyncio.to_thread(check), timeout_s)
            except TimeoutError:
                state, detail = f"no answer within {timeout_s} s", ""
            except Unavailable as exc:
                state, detail = f"{name} is unavailable ({exc.__class__.__name__})", str(exc)
            else:
                state, detail = "ok", ""
            before = self._reported.get(part, "ok")
            self._reported[part] = state
            if before != state:
                self.logger.log(
                    logging.INFO if state == "ok" else logging.WARNING, "%s: %s %s", part, state, detail
                )
            return state

        log_name = getattr(getattr(self.log, "breaker", None), "name", "the log")
        db, lg = await asyncio.gather(
            one("database", "the database", self.db.check), one("log", log_name, self.log.check)
        )
        policy = "ok" if self.policy is None else self.policy.readiness()
        before = self._reported.get("policy", "ok")
        self._reported["policy"] = policy
        if before != policy:
            self.logger.log(logging.INFO if policy == "ok" else logging.WARNING, "policy: %s", policy)
        return {"database": db, "log": lg, "policy": policy}
