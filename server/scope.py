"""Which policy's state a request works in, for every API family's routes (``server.chat``,
``server.feedback``, ``server.admin``, ``server.ops``) and ``server.auth``: the app's global
state, a policy's by name (404 ``unknown_policy`` otherwise), and ``?policy=`` as a dependency."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Query, Request

from core.limits import NAME_CHARS
from core.policies import GLOBAL
from server.errors import ApiError
from server.state import ServerState


def state_of(request: Request) -> ServerState:
    """The app's global ``ServerState`` (built in the lifespan): the global policy's, which
    also holds the key registry and the replica's metrics."""
    return request.app.state.s


def policy_names(request: Request) -> list[str]:
    """The policies this app serves: ``GLOBAL``, then the tenant policies in settings order."""
    return [GLOBAL, *state_of(request).settings.tenant_policies]


def unknown_policy(policy: str, names: list[str]) -> ApiError:
    """The 404 ``unknown_policy`` of ``?policy=`` naming no policy in ``names`` (those the
    request may see), which its message lists: ``no policy named 'zed' (policies: global, acme)``."""
    return ApiError(
        404,
        f"no policy named {policy!r} (policies: {', '.join(names)})",
        param="policy",
        code="unknown_policy",
    )


def policy_state(request: Request, policy: str) -> ServerState:
    """The state of ``policy``, one of ``policy_names``: ``state_of`` for ``GLOBAL``, else the
    tenant policy's (``app.state.tenants``, built in the lifespan). Raises ApiError 404
    ``unknown_policy`` naming every policy for any other name."""
    if policy == GLOBAL:
        return state_of(request)
    if policy not in state_of(request).settings.tenant_policies:
        raise unknown_policy(policy, policy_names(request))
    return request.app.state.tenants[policy]


def all_states(request: Request) -> list[ServerState]:
    """Every policy's state, in ``policy_names`` order."""
    return [policy_state(request, p) for p in policy_names(request)]


PolicyQuery = Annotated[
    str | None,
    Query(
        max_length=NAME_CHARS,
        description="The policy whose namespace the route reads or changes: absent or "
        "'global' for the global policy, or a tenant policy's name (docs/tenants.md).",
    ),
]
"""``?policy=``: the admin routes' (``namespace``) and the dashboard's (``server.auth.visible_state``)."""


def namespace(request: Request, policy: PolicyQuery = None) -> ServerState:
    """The state of the policy an admin route works in (``?policy=``): absent or ``global``,
    the global policy's; a name in ``tenant_policies``, that tenant policy's. Raises ApiError
    404 ``unknown_policy`` naming the policies for any other (``server.scope.policy_state``)."""
    return policy_state(request, GLOBAL if policy is None else policy)


PolicyState = Annotated[ServerState, Depends(namespace)]
