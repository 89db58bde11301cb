"""``/admin/tenant_policies``: list, add and remove the tenants with a policy of their own, at run
time (behind the admin key, as every ``/admin`` route; ``saoserve admin tenants`` is their
client). The list is the global database's (``core.tenant_store``); each server replica and
``saoserve learn --all-tenants`` follow it (docs/tenants.md, "Adding and removing a tenant
policy").

Errors: a name that is not a tenant policy's (``core.policies.check_policy_tenant``: not a tenant
name, or ``global``) is 400 with its message; removing a name not in the list is 404; adding one
beyond what this replica's adapter slots serve (``app.state.tenant_limit``, fixed at start:
``core.settings.adapter_slots``) is 409, saying to restart with more slots; adding one while
this replica's global policy serves full weights (tenant adapters apply to the base weights) is
409, saying what to do.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi import Path as PathParam

from core import tenant_store
from core.keys import BadTenant
from core.limits import NAME_CHARS
from core.policies import POLICY_TENANT_REGEX, check_policy_tenant
from server.admin.api_router import ADMIN_ERRORS, require_admin
from server.admin.protocol import AddTenantPolicy, TenantPolicyChanged, TenantPolicyList
from server.errors import ApiError, errors
from server.scope import state_of

router = APIRouter(prefix="/admin/tenant_policies", dependencies=[Depends(require_admin)])


def checked(tenant: str) -> str:
    """``tenant`` as a tenant policy's name; raises ApiError 400 with ``check_policy_tenant``'s
    message."""
    try:
        return check_policy_tenant(tenant)
    except BadTenant as exc:
        raise ApiError(400, str(exc), param="tenant", code="invalid_value") from None


@router.get("", response_model=TenantPolicyList, responses=ADMIN_ERRORS)
async def list_tenant_policies(request: Request) -> dict:
    """The database's list, the tenant policies this replica serves now, and how many its slots
    serve."""
    listed = await asyncio.to_thread(tenant_store.read, state_of(request).store.engine)
    return {
        "tenant_policies": listed,
        "served": list(state_of(request).settings.tenant_policies),
        "limit": request.app.state.tenant_limit,
    }


@router.post("", response_model=TenantPolicyChanged, responses=ADMIN_ERRORS | errors(409, 413))
async def add_tenant_policy(body: AddTenantPolicy, request: Request) -> dict:
    """Give ``tenant`` a policy of its own: every replica serves it within
    ``SAOSERVE_TENANT_POLL_S`` (its namespace made, version 0 the base weights until its learner
    publishes) and ``learn --all-tenants`` trains it from its next round. ``changed`` false: the
    list held it already (nothing changed). 409 ``no_tenant_slots`` when the list already holds
    as many tenant policies as this replica's adapter slots serve; 409 ``full_weights_served``
    for a name not listed while this replica's global policy serves full weights
    (``PolicyEngine.tenant_policy_refusal``: the message says what the operator does)."""
    tenant = checked(body.tenant)
    limit = request.app.state.tenant_limit
    if limit == 0:
        raise ApiError(
            409,
            "this server serves no tenant policy: tenant policies need SAOSERVE_ADAPTER_SERVING=adapter; "
            "restart the servers with it",
            param="tenant",
            code="no_tenant_slots",
        )
    db = state_of(request).store.engine
    why = state_of(request).engine.tenant_policy_refusal()
    if why is not None and tenant not in await asyncio.to_thread(tenant_store.read, db):
        raise ApiError(
            409, f"no tenant policy can be added now: {why}", param="tenant", code="full_weights_served"
        )
    try:
        changed = await asyncio.to_thread(tenant_store.add, db, tenant, limit)
    except tenant_store.TenantPolicyLimit:
        raise ApiError(
            409,
            f"no adapter slots for another tenant policy: this server's {request.app.state.adapter_slots} "
            f"slots serve the global policy and {limit} tenant policies; restart the servers with more "
            "slots (SAOSERVE_TENANT_POLICY_HEADROOM or SAOSERVE_MAX_CPU_LORAS) to add one",
            param="tenant",
            code="no_tenant_slots",
        ) from None
    return {
        "tenant": tenant,
        "changed": changed,
        "tenant_policies": await asyncio.to_thread(tenant_store.read, db),
    }


@router.delete("/{tenant}", response_model=TenantPolicyChanged, responses=ADMIN_ERRORS | errors(404))
async def remove_tenant_policy(
    # A plain str: the spec's pattern is the name's (an EdgeStr's NUL pattern would replace it);
    # the route checks the name itself (``checked``), NUL included, to say what is wrong with it.
    tenant: Annotated[
        str, PathParam(max_length=NAME_CHARS, json_schema_extra={"pattern": POLICY_TENANT_REGEX})
    ],
    request: Request,
) -> dict:
    """Take ``tenant``'s policy of its own away: every replica closes its state within
    ``SAOSERVE_TENANT_POLL_S`` and serves the tenant's keys with the global policy from then on;
    ``learn --all-tenants`` checkpoints and drops its learner at its next round. Its namespace
    (versions, records, evidence) is kept: added again, it resumes. 404 for a name not in the
    list."""
    tenant = checked(tenant)
    db = state_of(request).store.engine
    if not await asyncio.to_thread(tenant_store.remove, db, tenant):
        raise ApiError(404, f"no tenant policy {tenant!r}", param="tenant", code="not_found")
    return {
        "tenant": tenant,
        "changed": True,
        "tenant_policies": await asyncio.to_thread(tenant_store.read, db),
    }
