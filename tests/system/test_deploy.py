"""deploy/'s migrate service run for real: ``saoserve migrate`` with the service's command and
environment, mapped to the local PostgreSQL, brings a fresh database to the head revision, twice.
The static checks of deploy/: tests/unit/deploy/test_deploy.py."""

from __future__ import annotations

import os
import subprocess

from sqlalchemy import create_engine, make_url, text

from testing.deploy import (
    BIN,
    COMPOSE,
    DOCKERFILES,
    ENV_EXAMPLE,
    dockerfile_env,
    environment,
    interpolate,
    load,
    read_env_file,
)


def test_migrate_service_runs_against_a_fresh_database(pg_url, tmp_path):
    """The migrate service's command and environment, with its database URL pointed from the
    compose network's ``postgres`` to the local server (same driver, the test's database)."""
    from alembic.script import ScriptDirectory

    from core.db import alembic_config

    compose = interpolate(load(COMPOSE), read_env_file(ENV_EXAMPLE))
    service = compose["services"]["migrate"]
    env = dockerfile_env(DOCKERFILES[0]) | environment(service)
    local = make_url(pg_url)
    url = make_url(env["SAOSERVE_DATABASE_URL"])
    assert url.drivername == local.drivername
    env["SAOSERVE_DATABASE_URL"] = local.render_as_string(hide_password=False)
    env["SAOSERVE_HOME"] = str(tmp_path)  # the image's /data
    argv = [str(BIN / service["command"][0]), *service["command"][1:]]
    for _ in range(2):  # a restarted one-shot, or a replica migrating at start, finds the head
        run = subprocess.run(
            argv, env=os.environ | env, capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == "database at head"
    head = ScriptDirectory.from_config(alembic_config(pg_url)).get_current_head()
    engine = create_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head
            tables = set(
                conn.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars()
            )
    finally:
        engine.dispose()
    assert {"trajectory_index", "prompt_evidence", "alembic_version"} <= tables
