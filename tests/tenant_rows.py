"""The rows of ``GET /admin/policies`` and ``/dashboard/state``'s ``policies`` as a test expects
them (``server.admin_schemas.PolicyRow``, built by ``server.routes.admin.policy_overview``),
shared by tests/test_tenant_policies.py (the admin key's rows) and tests/test_tenant_visibility.py
(the rows each key may see)."""

from __future__ import annotations

from core.policies import GLOBAL


def row(policy: str, version: int, **figures) -> dict:
    """A policy's row serving ``version`` with nothing recorded but ``figures`` (any of the row's
    keys: ``lifecycle``, ``paused``, ``steps``, ``reward_mean``, ...), its database answering."""
    return {
        "policy": policy,
        "tenant": None if policy == GLOBAL else policy,
        "version": version,
        "unavailable": None,
        "lifecycle": None,
        "paused": False,
        "steps": 0,
        "reward_mean": None,
        "staleness_mean": None,
        "last_step_at": None,
    } | figures
