"""The server's storage health: the database and the log (DESIGN §8).

A storage failure is answered 503 with ``Retry-After`` on every route (``is_storage_error``
names the exceptions that mean "the database or the log is down", as opposed to a bug).
``Health.require`` refuses a chat before any work while a dependency is known to be down, so
no answer is generated whose record could not be stored; ``Health.report`` is ``/readyz``.
"""

from __future__ import annotations

import asyncio

from sqlalchemy import event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from core.breaker import Breaker, Unavailable
from core.logbus import LogTransport

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
    """Breakers for the database and the log of one server."""

    def __init__(self, db: Engine, log: LogTransport, log_required: bool):
        self.engine = db
        self.log = log
        self.log_required = log_required
        self.db = Breaker("the database", self._probe_db, DatabaseUnavailable)
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
        """Raise DatabaseUnavailable or LogUnavailable if a record could not be stored now.

        With ``log_required`` off, records go to the local spool while the log is down, so
        only the database is required.
        """
        self.db.check()
        if self.log_required:
            self.log.check()

    async def report(self, timeout_s: float = 2.0) -> dict[str, str]:
        """``{"database": ..., "log": ...}``, each "ok" or why it is down; probes run in threads
        and are cut off after ``timeout_s`` (a paused server may not answer at all)."""

        async def one(check) -> str:
            try:
                await asyncio.wait_for(asyncio.to_thread(check), timeout_s)
            except TimeoutError:
                return f"no answer within {timeout_s} s"
            except Unavailable as exc:
                return str(exc)
            return "ok"

        db, lg = await asyncio.gather(one(self.db.check), one(self.log.check))
        return {"database": db, "log": lg}
