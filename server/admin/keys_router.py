"""``/admin/keys``: create, list, revoke API keys and set their training opt-out and whether they
are trusted (behind the admin key, as every ``/admin`` route; ``saoserve admin keys`` is their
client). ``core/keys.py`` holds the registry; docs/tenants.md the model, docs/privacy.md the
opt-out, docs/guard.md ("Who votes") trusted keys."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam

from core.keys import TENANT_REGEX, KeyRevoked, KeyStore
from core.limits import NAME_CHARS
from core.records import utcnow
from server.admin.api_router import ADMIN_ERRORS, require_admin
from server.admin.protocol import ApiKeyCreated, ApiKeyInfo, ApiKeyList, CreateKey, KeySettings
from server.errors import ApiError, errors
from server.schemas import EdgeStr
from server.scope import state_of

router = APIRouter(prefix="/admin/keys", dependencies=[Depends(require_admin)])


def store_of(request: Request) -> KeyStore:
    return KeyStore(state_of(request).store.engine)


@router.post("", status_code=201, response_model=ApiKeyCreated, responses=ADMIN_ERRORS | errors(413))
async def create_key(body: CreateKey, request: Request) -> dict:
    """A new key of ``tenant`` (opted out of training with ``train: false``; unbounded by the
    identity caps with ``trusted: true``): ``key`` is the key itself, shown this once (only its
    hash is stored); ``id`` names it from now on."""
    info, key = await asyncio.to_thread(
        store_of(request).create, body.tenant, utcnow(), body.train, body.trusted
    )
    return info.to_json() | {"key": key}


@router.get("", response_model=ApiKeyList, responses=ADMIN_ERRORS)
async def list_keys(
    request: Request,
    tenant: Annotated[str | None, Query(pattern=TENANT_REGEX, max_length=NAME_CHARS)] = None,
) -> dict:
    """Every key (of ``tenant``), oldest first, revoked ones included: ids, tenants, times, the
    training setting and whether it is trusted; never a key or its hash."""
    keys = await asyncio.to_thread(store_of(request).listed, tenant)
    return {"keys": [k.to_json() for k in keys]}


@router.post("/{key_id}/revoke", response_model=ApiKeyInfo, responses=ADMIN_ERRORS | errors(404))
async def revoke_key(
    key_id: Annotated[EdgeStr, PathParam(min_length=1, max_length=NAME_CHARS)], request: Request
) -> dict:
    """Revoke a key: its next request is refused (401), on every replica. Idempotent (a revoked
    key keeps its first ``revoked_at``); 404 for an unknown id."""
    info = await asyncio.to_thread(store_of(request).revoke, key_id, utcnow())
    if info is None:
        raise ApiError(404, f"no API key {key_id!r}", code="not_found", param="key_id")
    return info.to_json()


@router.patch("/{key_id}", response_model=ApiKeyInfo, responses=ADMIN_ERRORS | errors(404, 409, 413))
async def set_key(
    body: KeySettings,
    key_id: Annotated[EdgeStr, PathParam(min_length=1, max_length=NAME_CHARS)],
    request: Request,
) -> dict:
    """Set a key's training setting, whether it is trusted, or both (a setting left out stays).
    ``train: false`` opts it out: each answer it is sent from its next request on, on every
    replica, is logged ``train: false``, and the learner trains none of its answers not yet
    trained, logged before included (it reads the setting when it joins and before each batch);
    ``true`` opts it back in (answers logged while it was out stay out). ``trusted: true``: the
    identity caps on training batches and on the guard's votes no longer bound it, from the
    learner's next batch and check (docs/guard.md, "Who votes"). Idempotent; 404 for an unknown
    id; 409 ``key_revoked`` for a revoked key (a revocation is final: nothing is changed)."""
    try:
        info = await asyncio.to_thread(
            store_of(request).configure, key_id, train=body.train, trusted=body.trusted
        )
    except KeyRevoked as exc:
        raise ApiError(409, str(exc), code="key_revoked", param="key_id") from None
    if info is None:
        raise ApiError(404, f"no API key {key_id!r}", code="not_found", param="key_id")
    return info.to_json()
