"""Tenant policy namespaces on PostgreSQL (core/policies.py, docs/tenants.md, "A policy per
tenant"): a tenant's schema is made and migrated. The namespaces' derivation:
tests/unit/core/test_policies.py."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from core.db import make_engine, migrate
from core.policies import (
    schema_name,
    tenant_database_url,
)


@pytest.mark.postgres
def test_a_namespace_schema_is_made_and_migrated_on_postgres(pg_url):
    url = tenant_database_url(pg_url, "acme.two")
    migrate(pg_url)
    # A search path of the operator's own is not a schema to make: public exists, nothing is made.
    migrate(f"{pg_url}?options=-csearch_path%3Dpublic")
    migrate(url)
    migrate(url)  # idempotent: the schema and its revision are there
    engine = make_engine(url)
    glob = make_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO control_flags (name, value, updated_at) VALUES ('namespace_probe', '1', now())"
                )
            )
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_schema()")).scalar() == schema_name("acme.two")
        with glob.connect() as conn:
            # The global schema does not see the tenant's flag.
            assert (
                conn.execute(
                    text("SELECT count(*) FROM control_flags WHERE name = 'namespace_probe'")
                ).scalar()
                == 0
            )
    finally:
        with glob.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema_name("acme.two")}" CASCADE'))
        engine.dispose()
        glob.dispose()
