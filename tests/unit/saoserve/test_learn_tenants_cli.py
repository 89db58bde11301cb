"""``saoserve learn --tenants A,B`` / ``--all-tenants``: several policies' learners in one process
on one shared base (learner.tenants; docs/tenants.md, "Many tenants in one learner"). What reaches
``run_tenants``, and the refusals (exit 2, one line on stderr)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from saoserve.admin.client import EXIT_OK, EXIT_USAGE
from saoserve.cli import app

runner = CliRunner()


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Settings with the tenant policies acme and beta; ``run_tenants`` and ``run_learner``
    replaced: each call's ``(settings, names, config)``, no model prepared."""
    import learner.process
    import learner.tenants
    import saoserve.model
    from core.settings import get_settings

    for name in ("SAOSERVE_DATABASE_URL", "SAOSERVE_LOG_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SAOSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("SAOSERVE_ADAPTER_SERVING", "adapter")
    monkeypatch.setenv("SAOSERVE_TENANT_POLICIES", "acme,beta")
    monkeypatch.setenv("SAOSERVE_MAX_CPU_LORAS", "9")
    get_settings.cache_clear()
    seen: list = []
    monkeypatch.setattr(learner.tenants, "run_tenants", lambda s, names, c: seen.append((s, names, c)))
    monkeypatch.setattr(learner.process, "run_learner", lambda s, c: seen.append((s, None, c)))
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda path: path)
    yield seen
    get_settings.cache_clear()


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--tenants", "beta,acme"], ["beta", "acme"]),
        (["--tenants", "acme,global"], ["acme", "global"]),
        (["--all-tenants"], None),  # the database's list, read by run_tenants
    ],
)
def test_learn_tenants_runs_the_named_policies_in_one_process(runs, args, names):
    from core.settings import get_settings

    result = runner.invoke(app, ["learn", "--policy", "lora", "--lora-rank", "4", *args])
    assert result.exit_code == EXIT_OK, result.output
    [(settings, got, config)] = runs
    assert settings == get_settings() and got == names
    assert (config.policy.kind, config.policy.rank) == ("lora", 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--tenants", "acme,zeta", "--policy", "lora"],
            "tenant 'zeta' has no policy of its own (SAOSERVE_TENANT_POLICIES: acme, beta)",
        ),
        (["--tenants", "acme,beta,acme", "--policy", "lora"], "--tenants names acme more than once"),
        (["--tenants", ",", "--policy", "lora"], "--tenants names no policy"),
        (["--tenants", "acme", "--all-tenants", "--policy", "lora"], "give --tenants A,B or --all-tenants"),
        (
            ["--tenants", "acme,beta"],
            "policies trained in one process are adapters over one shared base: run with --policy lora "
            "(the config's policy is 'full')",
        ),
        (
            ["--all-tenants", "--tenant", "acme", "--policy", "lora"],
            "--tenants trains several policies in one process, --tenant one: give one of them",
        ),
        (
            ["--tenants", "acme,beta", "--ranks", "2", "--policy", "lora"],
            "--tenants trains in one process; --ranks shards one policy's learner over several: give one",
        ),
        (
            ["--tenants", "acme,beta", "--policy", "lora", "--critic-trainable", "all"],
            "policies trained in one process share the critic's body (an adapter on its MLP "
            "projections): --critic-trainable all would train the body, run with mlp",
        ),
    ],
)
def test_learn_tenants_refusals_name_the_problem(runs, args, message):
    result = runner.invoke(app, ["learn", *args])
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr == f"error: {message}\n"
    assert runs == []


def test_learn_all_tenants_without_tenant_policies_starts_and_follows_the_list(runs, monkeypatch):
    """With no tenant policy yet, ``--all-tenants`` still starts: it trains those an operator adds."""
    monkeypatch.delenv("SAOSERVE_TENANT_POLICIES")
    from core.settings import get_settings

    get_settings.cache_clear()
    result = runner.invoke(app, ["learn", "--all-tenants", "--policy", "lora"])
    assert result.exit_code == EXIT_OK, result.output
    [(_, names, _)] = runs
    assert names is None


def test_learn_tenant_alone_is_unchanged(runs):
    result = runner.invoke(app, ["learn", "--tenant", "acme", "--policy", "lora"])
    assert result.exit_code == EXIT_OK, result.output
    [(settings, names, _)] = runs
    assert names is None and settings.resolved_policy_dir.name == "acme"


def test_a_policy_whose_state_does_not_load_is_named(runs, monkeypatch):
    """A state written by a learner of its own (its critic has a body) does not load into the
    shared-base learner: exit 2 naming the policy and the cause, not a traceback."""
    import learner.tenants

    def refuse(settings, names, config):
        raise learner.tenants.TenantLoadError("policy 'beta' cannot be loaded: 20 unexpected keys")

    monkeypatch.setattr(learner.tenants, "run_tenants", refuse)
    result = runner.invoke(app, ["learn", "--tenants", "acme,beta", "--policy", "lora"])
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr == "error: policy 'beta' cannot be loaded: 20 unexpected keys\n"


def test_learn_tenant_takes_a_tenant_policy_added_at_run_time(runs, tmp_path):
    """A tenant added by ``saoserve admin tenants add`` (the database's list), not in the
    setting, has its own learner as one of the setting has."""
    from core import tenant_store
    from core.db import make_engine, migrate

    url = f"sqlite:///{tmp_path / 'saoserve.db'}"
    migrate(url)
    db = make_engine(url)
    tenant_store.add(db, "zeta")
    db.dispose()
    result = runner.invoke(app, ["learn", "--tenant", "zeta", "--policy", "lora"])
    assert result.exit_code == EXIT_OK, result.output
    [(settings, _, _)] = runs
    assert settings.resolved_policy_dir == tmp_path / "policies" / "tenants" / "zeta"
    refused = runner.invoke(app, ["learn", "--tenant", "eta", "--policy", "lora"])
    assert (
        refused.stderr
        == "error: tenant 'eta' has no policy of its own (SAOSERVE_TENANT_POLICIES: acme, beta, zeta)\n"
    )
