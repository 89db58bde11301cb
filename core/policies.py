"""Policies and their namespaces: the global policy, and one policy of its own per tenant that has
one (docs/tenants.md, "A policy per tenant").

A policy is a lineage of versions with everything that belongs to it: its version folders and
checkpoint, its trajectories, feedback and policy events in the log, its evidence, lifecycle,
pause flag, learner offsets and samples. The global policy keeps the deployment's own database,
log and policy folder. A tenant policy keeps the same tables, topics and folders in a namespace
of its own, derived from the global one by ``tenant_database_url``, ``tenant_log_url`` and
``tenant_policy_dir``:

- **database**: a SQLite file beside the global one (``<dir>/tenants/<tenant>/<file>``); on
  PostgreSQL, a schema of the same database (``search_path`` set per connection, the schema made
  by ``core.db.migrate``);
- **log**: the SQL-table log lives in the namespace's database, so it follows the database; a
  Kafka log gets the topics ``<prefix><tenant>.trajectories`` and so on (``topic_prefix``);
- **policy folder**: ``<policy_dir>/tenants/<tenant>``, which the global learner never lists
  (``core.policy_store.version_dirs`` reads only ``v<digits>`` folders).

So a tenant's feedback can train no other policy and its evidence is its own by construction:
no table, topic or folder is shared. What is shared: the engine (one vLLM with an adapter per
policy, ``server.engine``) and the key registry (``api_keys``, in the global database).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sqlalchemy.engine import make_url

from core.db import search_path_schema
from core.keys import TENANT_REGEX, BadTenant, check_tenant

GLOBAL = "global"
"""The name of the policy every request without a tenant policy of its own is served by."""

POLICY_TENANT_REGEX = rf"^(?!{GLOBAL}$){TENANT_REGEX.removeprefix('^')}"
"""A tenant policy's name as the OpenAPI spec states it (``check_policy_tenant``): a tenant name
(``core.keys.TENANT_REGEX``) other than ``global``. For the spec only: the routes check names with
``check_policy_tenant``, whose message says what is wrong (a pattern's would not)."""

TENANTS_DIR = "tenants"
"""The folder, beside the global database file and inside the global policy folder, that holds
each tenant namespace."""


def check_policy_tenant(name: str) -> str:
    """``name`` as the tenant of a policy of its own: a tenant name (``core.keys.check_tenant``)
    other than ``GLOBAL``.

    Raises:
        core.keys.BadTenant (a ValueError): not a tenant name, or ``global``.
    """
    name = check_tenant(name)
    if name == GLOBAL:
        raise BadTenant(f"{GLOBAL!r} names the shared policy; a tenant policy needs another name")
    return name


def schema_name(tenant: str) -> str:
    """The PostgreSQL schema of ``tenant``'s namespace: ``t_`` + the name with every character
    outside ``[a-z0-9_]`` as ``_`` (cut to 40) + ``_`` + 8 hex digits of its sha256, so two
    tenants never share one (``a.b`` and ``a_b`` differ in the hash) and the identifier needs no
    quoting (at most 51 characters, under PostgreSQL's 63)."""
    safe = re.sub(r"[^a-z0-9_]", "_", tenant)[:40]
    return f"t_{safe}_{hashlib.sha256(tenant.encode()).hexdigest()[:8]}"


def tenant_database_url(url: str, tenant: str) -> str:
    """The database URL of ``tenant``'s namespace, derived from the global ``url``.

    SQLite ``sqlite:///<dir>/<file>`` → ``sqlite:///<dir>/tenants/<tenant>/<file>``; PostgreSQL
    → the same database with ``options=-csearch_path=<schema_name(tenant)>`` (libpq's per-
    connection setting, which psycopg passes on). Raises ValueError for an in-memory SQLite
    database (no file to put beside it), a URL that already sets a search path, or another
    database kind.
    """
    tenant = check_policy_tenant(tenant)
    u = make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        if not u.database or u.database == ":memory:":
            raise ValueError(f"an in-memory SQLite database ({url!r}) has no place for a tenant namespace")
        path = Path(u.database)
        return u.set(database=str(path.parent / TENANTS_DIR / tenant / path.name)).render_as_string(
            hide_password=False
        )
    if backend == "postgresql":
        if search_path_schema(url) is not None:
            raise ValueError(f"{url!r} sets a search_path already; a tenant namespace sets its own")
        options = u.query.get("options", "")
        options = " ".join(options) if isinstance(options, tuple) else options
        options = f"{options} -csearch_path={schema_name(tenant)}".strip()
        return u.update_query_dict({"options": options}).render_as_string(hide_password=False)
    raise ValueError(f"tenant namespaces need SQLite or PostgreSQL, not {backend!r} ({url!r})")


def tenant_log_url(log_url: str, tenant: str) -> str:
    """The log URL of ``tenant``'s namespace: a Kafka URL gets ``topic_prefix=<old prefix><tenant>.``
    (``core.logbus.KafkaLog``); a SQL-table log URL is a database URL (``tenant_database_url``)."""
    tenant = check_policy_tenant(tenant)
    if not log_url.startswith("kafka://"):
        return tenant_database_url(log_url, tenant)
    parts = urlsplit(log_url)
    query = dict(parse_qsl(parts.query))
    query["topic_prefix"] = f"{query.get('topic_prefix', '')}{tenant}."
    return urlunsplit(parts._replace(query=urlencode(query)))


def tenant_policy_dir(policy_dir: Path, tenant: str) -> Path:
    """The folder of ``tenant``'s versions and checkpoint: ``<policy_dir>/tenants/<tenant>``."""
    return Path(policy_dir) / TENANTS_DIR / check_policy_tenant(tenant)
