"""A policy per tenant in a test: settings with the tenant policies acme and beta
(``tenant_settings``), their namespaces (``namespaces``), a policy event in one (``publish``),
fake engines per policy (``SharedFakeEngine``, ``RefusingEngine``), API keys (``make_key``,
``bearer``), and the rows of ``GET /admin/policies`` and ``/dashboard/state``'s ``policies`` as a
test expects them (``row``: ``server.admin.protocol.PolicyRow``, built by
``server.admin.queries.policy_overview``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from core.db import migrate
from core.logbus import open_log
from core.policies import GLOBAL
from core.records import POLICY_KEY, TOPIC_POLICY, PolicyEvent
from core.settings import AdapterServing
from server.engine import SwapRefused, SwapResult, TenantPolicyRefused
from testing.fakes import FakeEngine
from testing.servers import ADMIN, make_settings


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


TENANTS = ["acme", "beta"]


def tenant_settings(tmp: Path, **overrides):
    """Settings with the tenant policies acme and beta (adapter serving, 3·3 = 9 slots)."""
    return make_settings(
        tmp,
        tenant_policies=TENANTS,
        adapter_serving=AdapterServing.ADAPTER,
        max_cpu_loras=9,
        policy_poll_s=0.05,
        **overrides,
    )


@dataclass
class RefusingEngine(FakeEngine):
    """A policy whose every swap is refused (its weights, say, are not an adapter)."""

    async def swap(self, version: int, path: Path, sha256: str) -> SwapResult:
        raise SwapRefused(f"version {version} refused")


@dataclass
class SharedFakeEngine(FakeEngine):
    """The global policy's ``FakeEngine`` with ``view(policy)``: a ``FakeEngine`` per tenant
    policy (``views``, made on first use; give one beforehand to set its version or make it
    refuse); ``add_policy``, ``remove_policy`` and ``tenant_policy_refusal`` as the engine's
    (``refusal``: the latter's answer; set, the engine stands for one serving full weights)."""

    views: dict[str, FakeEngine] = field(default_factory=dict)
    refusal: str | None = None

    def view(self, policy: str) -> FakeEngine:
        return self.views.setdefault(policy, FakeEngine())

    async def add_policy(self, policy: str) -> None:
        """A tenant policy added at run time: its view made now (``PolicyEngine.add_policy``);
        TenantPolicyRefused while ``refusal`` is set."""
        if self.refusal is not None:
            raise TenantPolicyRefused(self.refusal)
        self.view(policy)

    async def remove_policy(self, policy: str) -> None:
        """A tenant policy removed at run time: its view dropped (``PolicyEngine.remove_policy``)."""
        self.views.pop(policy)

    def tenant_policy_refusal(self) -> str | None:
        """``refusal`` (``PolicyEngine.tenant_policy_refusal``)."""
        return self.refusal


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def make_key(client, tenant: str) -> str:
    r = client.post("/admin/keys", json={"tenant": tenant}, headers=ADMIN)
    assert r.status_code == 201
    return r.json()["key"]


def namespaces(settings) -> dict:
    """``{policy: that namespace's settings}``, the global one first."""
    return {GLOBAL: settings} | {t: settings.for_tenant(t) for t in settings.tenant_policies}


def publish(settings, version: int, path: Path, sha256: str = "0" * 64) -> None:
    """A policy event for ``version`` in the log of ``settings``' namespace (migrated first)."""
    migrate(settings.resolved_database_url)
    event = PolicyEvent(
        version=version, path=str(path), sha256=sha256, created_at=datetime.now(UTC), parent_version=0
    )
    lt = open_log(settings.resolved_log_url)
    try:
        lt.append(TOPIC_POLICY, POLICY_KEY, event.to_json())
    finally:
        lt.close()


def logged(settings, topic: str) -> list[dict]:
    """Every record of ``topic`` in the log of ``settings``' namespace, as JSON."""
    lt = open_log(settings.resolved_log_url)
    try:
        out = []
        for p in lt.partitions(topic):
            out += [json.loads(e.value) for e in lt.read(topic, p, 0, 1000, 0.2)]
        return out
    finally:
        lt.close()


def gauge(text: str, name: str, **labels) -> float | None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None
