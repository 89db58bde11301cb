"""Who calls the API: the API key a chat, feedback or model-list request presents, checked
against the key registry (``core/keys.py``; docs/tenants.md).

``Authorization: Bearer <token>``: a token that begins with ``core.keys.KEY_PREFIX`` is a
saoserve key and must be valid, whether or not keys are required (an unknown, wrong or revoked
key is 401 on its next request). Any other token (the ``api_key="EMPTY"`` an OpenAI client must
send when keys are off) and no header at all are anonymous: served when ``require_keys`` is off,
401 when it is on.

The key's tenant decides the policy that serves the request (``policy_of``): the tenant's own
policy when it is one of ``Settings.tenant_policies``, else the global one; chat, feedback,
episodes and the model list then work in that policy's state (``served_state``).

The key's training setting (``core.keys.KeyInfo.train``) is read with it, on every request: a
key opted out of training makes each answer it is sent ``train: false`` (``server.chat.serving.trains``;
docs/privacy.md).

The pages that need no key (the dashboard, ``/readyz``) show a tenant policy only to a request
that may see it (``visible_policies``): with the admin key, every one; with a valid key of the
tenant, its own; else none, and a policy not shown is as unknown as one that does not exist
(``visible_state``; docs/tenants.md, "What the public pages show").
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass

from fastapi import Request

from core.keys import KeyStore, looks_like_key
from core.policies import GLOBAL
from core.settings import Settings
from server.errors import ApiError
from server.health import is_storage_error
from server.scope import policy_names, policy_state, state_of, unknown_policy
from server.state import ServerState


@dataclass(frozen=True)
class Caller:
    """The authenticated key's id and tenant, or both None (anonymous); ``train`` False when the
    key opts out of training (anonymous callers: True, their ``store`` field decides alone);
    ``policy``: the policy that serves the caller (``policy_of``)."""

    key_id: str | None = None
    tenant: str | None = None
    train: bool = True
    policy: str = GLOBAL
    # The client's address as the server sees it (anonymous callers; the canary arm's key).
    address: str | None = None


ANONYMOUS = Caller()


def policy_of(settings: Settings, tenant: str | None) -> str:
    """The policy that serves a key of ``tenant`` (None: no key): the tenant's own when it is
    in ``settings.tenant_policies``, else ``GLOBAL``."""
    return tenant if tenant is not None and tenant in settings.tenant_policies else GLOBAL


def unauthorized(message: str) -> ApiError:
    """The 401 of a request without a valid key (OpenAI's ``invalid_api_key``)."""
    return ApiError(401, message, "authentication_error", code="invalid_api_key")


def bearer(request: Request) -> str | None:
    """The request's bearer token, or None without an ``Authorization: Bearer`` header."""
    given = request.headers.get("authorization", "")
    return given[7:].strip() if given.startswith("Bearer ") else None


async def authenticate(request: Request) -> Caller:
    """The route dependency of chat, feedback and the model list: the caller, also kept as
    ``request.state.caller``. Raises ApiError 401 (module docstring); a database that does not
    answer is a 503 like any storage failure (``server.errors``)."""
    s = state_of(request)
    token = bearer(request)
    if token is None or not looks_like_key(token):
        if s.settings.require_keys:
            raise unauthorized(
                "this server requires an API key: send 'Authorization: Bearer <API key>' "
                "(keys are made with `saoserve admin keys create TENANT`)"
            )
        caller = Caller(address=request.client.host if request.client is not None else None)
        request.state.caller = caller
        return caller
    checked = await asyncio.to_thread(KeyStore(s.store.engine).check, token)
    if checked.outcome == "revoked":
        raise unauthorized(f"API key {checked.key.id} is revoked")
    if checked.outcome != "ok":
        raise unauthorized("invalid API key: not a key of this server")
    tenant = checked.key.tenant
    caller = Caller(
        key_id=checked.key.id, tenant=tenant, train=checked.key.train, policy=policy_of(s.settings, tenant)
    )
    request.state.caller = caller
    return caller


def caller_of(request: Request) -> Caller:
    """The caller ``authenticate`` found for this request (anonymous if it did not run)."""
    return getattr(request.state, "caller", ANONYMOUS)


def served_state(request: Request) -> ServerState:
    """The state of the policy that serves this request's caller (``Caller.policy``); the global
    policy's if that tenant policy was removed since the caller was authenticated
    (``server.app.TenantPolicySync``), as for the tenant's next request."""
    policy = caller_of(request).policy
    return policy_state(request, policy if policy in policy_names(request) else GLOBAL)


def admin_key_given(request: Request) -> bool:
    """Whether the request carries the admin key (``Authorization: Bearer <admin key>``,
    compared in constant time); always False while no admin key is set."""
    key = state_of(request).settings.admin_key
    given = request.headers.get("authorization", "")
    return bool(key) and given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())


async def visible_policies(request: Request) -> list[str]:
    """The policies the pages without a key (the dashboard, ``/readyz``) show this request, in
    ``policy_names`` order: ``GLOBAL``; then every tenant policy with the admin key
    (``admin_key_given``), else the key's own tenant policy (``policy_of``) when the request
    carries a valid, unrevoked key. No key, another token, a wrong or revoked key, or a key the
    database cannot check (it does not answer) see the global policy alone: these pages need no
    key, so a bad one is never their 401."""
    names = policy_names(request)
    if admin_key_given(request):
        return names
    token = bearer(request)
    # Without tenant policies there is nothing to hide: no key lookup.
    if len(names) == 1 or token is None or not looks_like_key(token):
        return [GLOBAL]
    s = state_of(request)
    try:
        checked = await asyncio.to_thread(KeyStore(s.store.engine).check, token)
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        return [GLOBAL]
    own = policy_of(s.settings, checked.key.tenant) if checked.outcome == "ok" else GLOBAL
    return [GLOBAL] if own == GLOBAL else [GLOBAL, own]


def visible_state(request: Request, visible: list[str], policy: str | None) -> ServerState:
    """The state of ``?policy=`` (None: ``GLOBAL``) when it is one of ``visible``
    (``visible_policies``). Raises ApiError 404 ``unknown_policy`` listing only ``visible`` for
    any other name, a tenant policy not shown to this request as for one that does not exist."""
    name = GLOBAL if policy is None else policy
    if name not in visible:
        raise unknown_policy(name, visible)
    return policy_state(request, name)
