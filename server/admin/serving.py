"""The admin family's handling besides its routes (``server.admin.api_router``): whether a
version may be loaded or rolled back to, the policies' rows, a forget's receipt and the
namespaces a forget reaches that this replica does not serve."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import inspect, make_url
from sqlalchemy.engine import Engine

from core import tenant_store
from core.db import ForgetRequest, make_engine
from core.forget import ForgetKind, ForgetReceipt, ForgetTarget
from core.lifecycle import Stage
from core.policies import GLOBAL
from core.policy_store import layout
from core.records import as_utc
from core.settings import Settings
from server.admin.protocol import Forgotten, LoadPolicyRequest
from server.admin.queries import policy_overview
from server.errors import ApiError
from server.health import is_storage_error
from server.state import ServerState

log = logging.getLogger(__name__)


def weights_present(path: str) -> bool:
    """Whether the version folder ``path`` still holds the weights a rollback loads
    (``core.policy_store``; the learner prunes whole folders, ``keep_versions``)."""
    return layout(path) is not None


def check_loadable(body: LoadPolicyRequest, recorded: dict | None, serving: int) -> None:
    """Raise ApiError unless ``body`` names a version this server may serve: one recorded in
    ``policy_versions`` (``recorded``: its row; version 0, the prepared model, also before any
    learner recorded it) with that checksum, and not older than ``serving``. Versions only go
    forward: evidence and staleness are computed from them (a version ahead of the recorded
    chain would outweigh every later result, one older would read evidence from the future)."""
    if body.version < serving:
        raise ApiError(
            409,
            f"policy version {body.version} is older than the version served ({serving}): versions only "
            "go forward; POST /admin/rollback publishes an old version's weights as a new version",
            param="version",
            code="version_behind",
        )
    if recorded is None and body.version != 0:
        raise ApiError(
            404,
            f"no policy version {body.version} is recorded (GET /admin/policy_versions lists them): "
            "only a version the learner published can be served",
            param="version",
            code="not_found",
        )
    if recorded is not None and recorded.get("lifecycle") == Stage.REJECTED:
        raise ApiError(
            409,
            f"policy version {body.version} is rejected: a rejected version never serves",
            param="version",
            code="version_rejected",
        )
    if recorded is not None and recorded["sha256"] != body.sha256:
        raise ApiError(
            422,
            f"sha256 {body.sha256} is not policy version {body.version}'s recorded checksum {recorded['sha256']}",
            param="sha256",
            code="swap_refused",
        )


async def policy_rows(states: list[ServerState]) -> list[dict]:
    """The row (``policy_overview``) of each policy of ``states``, in their order: every
    policy's for ``/admin/policies``, those the request may see for the dashboard. A tenant
    policy whose database does not answer gets a row of what the server knows without it (the
    version it serves; ``unavailable`` says why the rest is null), so one namespace's outage does
    not take the others' rows (nor the dashboard) with it; the global one's raises, a 503."""
    rows = []
    for s in states:
        try:
            rows.append(await asyncio.to_thread(policy_overview, s.store.engine, s.policy, s.engine.version))
        except Exception as exc:
            if s.policy == GLOBAL or not is_storage_error(exc):
                raise
            log.warning("policy %s: its row is not readable: %s", s.policy, exc)
            rows.append(
                {"policy": s.policy, "tenant": s.policy, "version": s.engine.version}
                | {"unavailable": f"its database does not answer ({exc.__class__.__name__})"}
                | dict.fromkeys(
                    ("lifecycle", "paused", "steps", "reward_mean", "staleness_mean", "last_step_at")
                )
            )
    return rows


def receipt_body(receipts: list[ForgetReceipt], logs: list[bool], target: ForgetTarget | None) -> Forgotten:
    """One answer of the receipts of one request in each namespace (``logs``: whether each
    namespace's log keeps records): counts summed, ``deleted`` summed by store."""
    first = receipts[0]
    deleted: dict[str, int] = {}
    for r in receipts:
        for table, n in r.deleted.items():
            deleted[table] = deleted.get(table, 0) + n
    done = [r.completed_at for r in receipts]
    return Forgotten(
        id=first.id,
        kind=first.kind.value,
        user=target.subject if target is not None and target.kind is ForgetKind.USER else None,
        key=target.subject if target is not None and target.kind is ForgetKind.KEY else None,
        subject_hash=first.subject_hash,
        requested_at=as_utc(first.requested_at).isoformat(),
        completed_at=None if None in done else max(done).isoformat(),
        completed=None not in done,
        trajectories=sum(r.trajectories for r in receipts),
        episodes=sum(r.episodes for r in receipts),
        tombstones=sum(r.tombstones for r in receipts),
        deleted=dict(sorted(deleted.items())),
        log="kafka" if any(logs) else "sql",
    )


@dataclass(frozen=True)
class Unserved:
    """The stores of a tenant policy's namespace that this replica does not serve (removed from
    the list, or listed but not opened here): ``db`` its database, ``log_db`` its SQL-table
    log's (None: Kafka, ``keeps_records``)."""

    name: str
    db: Engine
    log_db: Engine | None
    keeps_records: bool


def _exists(url: str) -> bool:
    """Whether the namespace database at ``url`` was ever made: a SQLite file that exists; on
    PostgreSQL, a schema holding the forget table (a namespace never served has neither)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        return bool(u.database) and Path(u.database).is_file()
    engine = make_engine(url)
    try:
        return inspect(engine).has_table(ForgetRequest.__tablename__)
    finally:
        engine.dispose()


def _open_unserved(settings: Settings, served: list[str]) -> list[Unserved]:
    global_db = make_engine(settings.resolved_database_url)
    try:
        names = [n for n in tenant_store.ever(global_db) if n not in served]
    finally:
        global_db.dispose()
    opened: list[Unserved] = []
    try:
        for name in names:
            space = settings.model_copy(update={"tenant_policies": [name]}).for_tenant(name)
            if not _exists(space.resolved_database_url):
                continue
            kafka = space.resolved_log_url.startswith("kafka://")
            log_db = None if kafka else make_engine(space.resolved_log_url)
            opened.append(Unserved(name, make_engine(space.resolved_database_url), log_db, kafka))
    except BaseException:
        _close_unserved(opened)  # what opened before the failure, not left to the pool
        raise
    return opened


def _close_unserved(opened: list[Unserved]) -> None:
    for u in opened:
        u.db.dispose()
        if u.log_db is not None:
            u.log_db.dispose()


@asynccontextmanager
async def unserved_namespaces(settings: Settings, served: Iterable[str]) -> AsyncIterator[list[Unserved]]:
    """The namespaces of every tenant policy ever listed (``core.tenant_store.ever``, read from
    the global database of ``settings``) that are not in ``served`` and exist, opened (in a
    thread: it reads the databases) for the time of the ``async with``, their engines disposed
    after: what a forget must reach besides the states this replica serves (docs/privacy.md,
    "What forget removes"). Raises what the global database raises."""
    opened = await asyncio.to_thread(_open_unserved, settings, list(served))
    try:
        yield opened
    finally:
        await asyncio.to_thread(_close_unserved, opened)
