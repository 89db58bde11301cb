"""The admin family's handling besides its routes (``server.admin.api_router``): whether a
version may be loaded or rolled back to, the policies' rows, a forget's receipt."""

from __future__ import annotations

import asyncio
import logging

from core.forget import ForgetKind, ForgetReceipt, ForgetTarget
from core.lifecycle import Stage
from core.policies import GLOBAL
from core.policy_store import layout
from core.records import as_utc
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
