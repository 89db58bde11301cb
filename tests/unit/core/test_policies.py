"""Tenant policy namespaces (core/policies.py, Settings.for_tenant): each tenant policy's database,
log and folder are derived from the global ones and never coincide with them or with another
tenant's (docs/tenants.md, "A policy per tenant")."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect

from core.db import TENANT_SCHEMA, make_engine, migrate, search_path_schema
from core.keys import BadTenant
from core.logbus import KafkaLog
from core.policies import (
    GLOBAL,
    check_policy_tenant,
    schema_name,
    tenant_database_url,
    tenant_log_url,
    tenant_policy_dir,
)
from core.policy_store import version_dirs
from core.settings import Settings, adapter_slots, tenant_policy_limit


def test_a_sqlite_namespace_is_a_file_beside_the_global_one():
    assert tenant_database_url("sqlite:////srv/var/saoserve.db", "acme") == (
        "sqlite:////srv/var/tenants/acme/saoserve.db"
    )


def test_a_postgres_namespace_is_a_schema_of_the_same_database():
    url = tenant_database_url("postgresql+psycopg://u:pw@db:5432/sao", "acme")
    assert url.startswith("postgresql+psycopg://u:pw@db:5432/sao?options=")
    assert search_path_schema(url) == schema_name("acme")
    assert search_path_schema("postgresql+psycopg://u@db/sao") is None


def test_schema_names_differ_where_the_tenants_differ_and_need_no_quoting():
    # "a.b" and "a_b" both read "a_b" once the dot is replaced: the hash keeps them apart.
    assert schema_name("a.b") != schema_name("a_b")
    long = schema_name("x" * 64)
    assert len(long) == 2 + 40 + 1 + 8 and long.startswith("t_") and long.replace("_", "").isalnum()


def test_migrate_makes_only_a_tenant_namespaces_schema():
    # An operator's own search path (a list, a quoted name, one that exists) is used as it is.
    assert TENANT_SCHEMA.fullmatch(schema_name("acme")) and TENANT_SCHEMA.fullmatch(schema_name("x" * 64))
    for other in ("app,public", '"$user",public', "public", "t_acme"):
        assert not TENANT_SCHEMA.fullmatch(other)


def test_a_kafka_namespace_prefixes_its_topics():
    url = tenant_log_url("kafka://k1:9092,k2:9092", "acme")
    assert url == "kafka://k1:9092,k2:9092?topic_prefix=acme."
    log = KafkaLog(url)
    assert log.bootstrap == ["k1:9092", "k2:9092"]
    assert log.broker_topic("trajectories") == "acme.trajectories"
    assert KafkaLog("kafka://k1:9092").broker_topic("policy") == "policy"


def test_a_sql_log_namespace_follows_the_database():
    assert (
        tenant_log_url("sqlite:////srv/var/saoserve.db", "acme")
        == "sqlite:////srv/var/tenants/acme/saoserve.db"
    )


def test_the_global_learner_never_lists_a_tenant_folder(tmp_path: Path):
    (tmp_path / "v000001").mkdir()
    tenant_policy_dir(tmp_path, "acme").mkdir(parents=True)
    (tenant_policy_dir(tmp_path, "acme") / "v000001").mkdir()
    assert [v for v, _ in version_dirs(tmp_path)] == [1]
    assert tenant_policy_dir(tmp_path, "acme") == tmp_path / "tenants" / "acme"


@pytest.mark.parametrize(
    "url, why",
    [
        ("sqlite://", "in-memory"),
        ("sqlite:///:memory:", "in-memory"),
        ("postgresql+psycopg://u@db/sao?options=-csearch_path%3Dother", "search_path already"),
        ("mysql://u@db/sao", "SQLite or PostgreSQL"),
    ],
)
def test_urls_that_cannot_hold_a_namespace_are_refused(url, why):
    with pytest.raises(ValueError, match=why):
        tenant_database_url(url, "acme")


@pytest.mark.parametrize("name", [GLOBAL, "Acme", "", "-x", "a" * 65])
def test_a_tenant_policy_needs_a_tenant_name_other_than_global(name):
    with pytest.raises(BadTenant):
        check_policy_tenant(name)


def places(s: Settings) -> tuple:
    return (s.resolved_database_url, s.resolved_log_url, s.resolved_policy_dir, s.home)


def _settings(tmp_path: Path, **kw) -> Settings:
    return Settings(home=tmp_path, adapter_serving="adapter", max_cpu_loras=9, **kw)


def test_for_tenant_moves_every_place_a_policy_keeps_state(tmp_path: Path):
    s = _settings(tmp_path, tenant_policies="acme, beta")
    assert s.tenant_policies == ["acme", "beta"]
    a, b = s.for_tenant("acme"), s.for_tenant("beta")
    for one in (a, b):
        for mine, theirs in zip(places(one), places(s), strict=True):
            assert mine != theirs
    assert set(places(a)).isdisjoint(places(b))
    # The model and every other setting are the global ones; a namespace holds one policy.
    assert a.resolved_model_dir == s.resolved_model_dir
    assert a.served_model_name == s.served_model_name and a.tenant_policies == []
    assert a.resolved_policy_dir == tmp_path / "policies" / "tenants" / "acme"


def test_for_tenant_refuses_a_tenant_without_a_policy_of_its_own(tmp_path: Path):
    with pytest.raises(
        ValueError, match=r"tenant 'zed' has no policy of its own \(SAOSERVE_TENANT_POLICIES: acme\)"
    ):
        _settings(tmp_path, tenant_policies="acme").for_tenant("zed")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"tenant_policies": "acme", "adapter_serving": "merged"}, "needs adapter_serving 'adapter'"),
        ({"tenant_policies": "acme,acme"}, "names acme more than once"),
        ({"tenant_policies": "global"}, "names the shared policy"),
        ({"tenant_policies": "acme", "database_url": "sqlite://"}, "in-memory SQLite database"),
    ],
)
def test_tenant_policy_settings_that_cannot_work_are_refused(tmp_path: Path, kw, message):
    kw = {"adapter_serving": "adapter", **kw}
    with pytest.raises(ValueError, match=message):
        Settings(home=tmp_path, **kw)


def test_slots_are_one_rule_for_the_setting_and_the_list(tmp_path: Path):
    """Review item 7: the validator asked max_cpu_loras ≥ 3·(N+1) of the setting's names, so
    three names with the default 8 slots were refused at start, while the same three from the
    database's list started with ``adapter_slots``' count. Now both start, with the same slots:
    max(8, 3 × (1 + 3 + 2)) = 18 (headroom 2), serving 18 // 3 − 1 = 5 tenant policies; with
    headroom 0, max(8, 3 × 4) = 12, serving 3; with 30 asked, 30 (9)."""
    s = Settings(home=tmp_path, adapter_serving="adapter", tenant_policies="a,b,c")
    assert s.max_cpu_loras == 8 and s.tenant_policies == ["a", "b", "c"]
    assert (adapter_slots(s, 3), tenant_policy_limit(adapter_slots(s, 3))) == (18, 5)
    s0 = Settings(home=tmp_path, adapter_serving="adapter", tenant_policies="a,b,c", tenant_policy_headroom=0)
    assert (adapter_slots(s0, 3), tenant_policy_limit(adapter_slots(s0, 3))) == (12, 3)
    big = Settings(home=tmp_path, adapter_serving="adapter", tenant_policies="a,b,c", max_cpu_loras=30)
    assert (adapter_slots(big, 3), tenant_policy_limit(adapter_slots(big, 3))) == (30, 9)


def test_a_namespace_database_migrates_on_sqlite(tmp_path: Path):
    url = _settings(tmp_path, tenant_policies="acme").for_tenant("acme").resolved_database_url
    migrate(url)
    engine = make_engine(url)
    try:
        assert "policy_versions" in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    assert (tmp_path / "tenants" / "acme" / "saoserve.db").is_file()
