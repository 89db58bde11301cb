"""The list of tenant policies in the global database (issue 39 item 3; docs/tenants.md, "Adding
and removing a tenant policy"): what every server replica serves and ``saoserve learn
--all-tenants`` trains, read again while they run, so a policy is added or removed without a
restart.

The rule between the setting and the table:

- **Seeded from the setting.** Every server and every ``learn --all-tenants`` adds the names of
  ``SAOSERVE_TENANT_POLICIES`` that the table lacks, at start (``seed``). A name is never removed
  by a start: a process with an older setting cannot drop a policy that another added.
- **Changed by the admin route** (``/admin/tenant_policies``): ``add`` and ``remove``. A name
  removed there but still in the setting comes back at the next start of any process, so an
  operator removes it from the setting too.
- **A removed name is marked, not deleted** (``removed_at``): its namespace keeps the
  trajectories, feedback and evidence it held, and ``ever`` still names it, so a forget and
  retention reach them (docs/privacy.md); adding the name again resumes that namespace.

Writes are atomic under concurrency, as the control flags' are (``core.control``), and each says
what it did by ``RETURNING`` (an INSERT's row count is -1 on PostgreSQL here): two operators
adding one name both get an answer (one ``True``, one ``False``: already there) and one row is
recorded; two removing it, one ``True`` and one ``False`` (nothing to remove). ``add`` with a
``limit`` counts and inserts in one statement under a lock (PostgreSQL: a transaction-scoped
advisory lock; SQLite: the statement's write lock), so two operators adding two names at the
last free place do not both get it.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import func, literal, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from core.db import TenantPolicyRow
from core.policies import check_policy_tenant
from core.records import utcnow

_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
"""The dialects' ``INSERT … ON CONFLICT`` constructs (the two databases saoserve runs on)."""

LOCK_KEY = 0x7E4A_4E70
"""The PostgreSQL advisory lock key that orders ``add``s with a limit (any constant no other
code of saoserve takes)."""


class TenantPolicyLimit(Exception):
    """``add`` refused a name: the table already holds ``limit`` tenant policies."""


def _names(db: Engine | Connection, listed_only: bool) -> list[str]:
    query = select(TenantPolicyRow.name).order_by(TenantPolicyRow.added_at, TenantPolicyRow.name)
    if listed_only:
        query = query.where(TenantPolicyRow.removed_at.is_(None))
    if isinstance(db, Connection):
        return list(db.execute(query).scalars())
    with db.connect() as conn:
        return list(conn.execute(query).scalars())


def read(db: Engine | Connection) -> list[str]:
    """The tenant policies listed now, oldest first (ties by name)."""
    return _names(db, listed_only=True)


def ever(db: Engine | Connection) -> list[str]:
    """Every tenant policy listed now or removed since, oldest first: the namespaces that may
    hold a subject's data (what a forget and retention go through)."""
    return _names(db, listed_only=False)


def _listing(conn: Connection, rows):
    """``INSERT … ON CONFLICT`` of ``rows`` (a ``values`` dict or a select of name, added_at) that
    lists a name: a new one is inserted, a removed one listed again (``removed_at`` cleared, its
    first ``added_at`` kept), a listed one left; ``RETURNING`` the name when this changed it."""
    make = _INSERTS.get(conn.dialect.name)
    if make is None:
        raise ValueError(f"tenant policies need PostgreSQL or SQLite, not {conn.dialect.name}")
    insert = make(TenantPolicyRow)
    stmt = insert.values(**rows) if isinstance(rows, dict) else insert.from_select(["name", "added_at"], rows)
    return stmt.on_conflict_do_update(
        index_elements=[TenantPolicyRow.name],
        set_={"removed_at": None},
        where=TenantPolicyRow.removed_at.is_not(None),
    ).returning(TenantPolicyRow.name)


def seed(db: Engine, names: Iterable[str]) -> list[str]:
    """List each of ``names`` (the setting's) that the list lacks (absent, or removed), in one
    transaction; returns those listed by this call, in the order given. Raises
    core.keys.BadTenant for a name that is not a tenant policy's (``check_policy_tenant``)."""
    names = [check_policy_tenant(n) for n in names]
    added = []
    with db.begin() as conn:
        for name in names:
            if conn.execute(_listing(conn, {"name": name, "added_at": utcnow()})).first() is not None:
                added.append(name)
    return added


def add(db: Engine, name: str, limit: int | None = None) -> bool:
    """List ``name`` (new, or removed before); True if this call listed it, False if it was
    listed already.

    Args:
        limit: the most tenant policies the list may hold (the serving replica's slots), None:
            no limit; removed names do not count. A name listed already is answered False
            whatever the count.

    Raises:
        core.keys.BadTenant (a ValueError): not a tenant policy's name (``check_policy_tenant``).
        TenantPolicyLimit: ``name`` is absent and the table holds ``limit`` names.
    """
    name = check_policy_tenant(name)
    with db.begin() as conn:
        if conn.dialect.name == "postgresql" and limit is not None:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": LOCK_KEY})
        if limit is None:
            rows: dict | object = {"name": name, "added_at": utcnow()}
        else:
            count = (
                select(func.count())
                .select_from(TenantPolicyRow)
                .where(TenantPolicyRow.removed_at.is_(None))
                .scalar_subquery()
            )
            rows = select(literal(name), literal(utcnow(), TenantPolicyRow.added_at.type)).where(
                count < limit
            )
        if conn.execute(_listing(conn, rows)).first() is not None:
            return True
        listed = conn.execute(
            select(TenantPolicyRow.name).where(
                TenantPolicyRow.name == name, TenantPolicyRow.removed_at.is_(None)
            )
        ).first()
    if listed is None:
        raise TenantPolicyLimit(f"{limit} tenant policies are the most this deployment's adapter slots hold")
    return False


def remove(db: Engine, name: str) -> bool:
    """Remove ``name`` from the list (marked ``removed_at``, the row kept: ``ever``); True if
    this call removed it, False if it was not listed (never added, or removed already)."""
    with db.begin() as conn:
        gone = (
            update(TenantPolicyRow)
            .where(TenantPolicyRow.name == name, TenantPolicyRow.removed_at.is_(None))
            .values(removed_at=utcnow())
            .returning(TenantPolicyRow.name)
        )
        return conn.execute(gone).first() is not None
