"""``saoserve serve`` refuses secrets anybody can guess (issue 23 finding 4): the placeholders of
the README, docs/ and deploy/ examples, blank ones and short ones (``SECRET_MIN_CHARS``), for
the feedback secret and for the admin key; and the README's by-hand commands make secrets it
accepts."""

from __future__ import annotations

import re
import socket
import subprocess

import pytest
from typer.testing import CliRunner

from core.settings import SECRET_MIN_CHARS, Settings, secret_problem, server_secret_problems
from saoserve.cli import app
from saoserve.ports import free_port
from testing import ROOT

DOCUMENTS = [ROOT / "README.md", ROOT / "deploy" / ".env.example", *sorted((ROOT / "docs").glob("*.md"))]
# VAR=value as the documents write them (shell exports, .env lines); a value taken from a
# command or a variable ($...) is made at run time, not a literal.
ASSIGNMENT = re.compile(r"\b(SAOSERVE_FEEDBACK_SECRET|SAOSERVE_ADMIN_KEY)=([^\s`'\"$][^\s`'\"]*)")
runner = CliRunner()


def documented_values() -> list[tuple[str, str, str]]:
    """``(file, variable, value)`` of every literal secret the documents show."""
    out = []
    for path in DOCUMENTS:
        for name, value in ASSIGNMENT.findall(path.read_text()):
            out.append((path.relative_to(ROOT).as_posix(), name, value))
    return out


def test_the_documents_show_placeholders_only_in_deploy_env_example():
    # deploy/.env.example must name every variable compose interpolates (tests/unit/deploy/test_deploy.py),
    # so its secrets are placeholders; the README generates its own.
    assert documented_values() == [
        ("deploy/.env.example", "SAOSERVE_FEEDBACK_SECRET", "change-me-feedback-secret"),
        ("deploy/.env.example", "SAOSERVE_ADMIN_KEY", "change-me-admin-key"),
    ]


@pytest.mark.parametrize(
    "value",
    [v for _, _, v in documented_values()]
    # The README's by-hand values before issue 23, and the other placeholder of .env.example.
    + [
        "change-me",
        "admin-key",
        "change-me-postgres",
        "CHANGE-ME-please-0123456789",
        "changeme0123456789abcdef",
    ],
)
@pytest.mark.parametrize("name", ["SAOSERVE_FEEDBACK_SECRET", "SAOSERVE_ADMIN_KEY"])
def test_placeholders_are_refused(name, value):
    assert secret_problem(name, value) == (
        f"{name} is a placeholder of the examples ({value!r}): set a secret of your own "
        "(e.g. `openssl rand -hex 32`)"
    )


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "is blank"),
        (" ", "is blank"),
        ("\t\n", "is blank"),
        (" 0123456789abcdef0123", "begins or ends with whitespace"),
        ("0123456789abcdef0123\n", "begins or ends with whitespace"),
        # 15 characters: one fewer than SECRET_MIN_CHARS (16).
        ("0123456789abcde", "has 15 characters, fewer than 16"),
    ],
)
def test_blank_padded_and_short_secrets_are_refused(value, why):
    assert SECRET_MIN_CHARS == 16
    assert why in secret_problem("SAOSERVE_FEEDBACK_SECRET", value)


def test_a_secret_of_16_characters_or_more_passes():
    assert secret_problem("SAOSERVE_ADMIN_KEY", "0123456789abcdef") is None
    settings = Settings(feedback_secret="f" * 64, admin_key="")  # no admin key: admin routes refused
    assert server_secret_problems(settings) == []
    settings = Settings(feedback_secret="f" * 64, admin_key="short")
    assert server_secret_problems(settings) == [
        "SAOSERVE_ADMIN_KEY has 5 characters, fewer than 16: set a longer secret (e.g. `openssl rand -hex 32`)"
    ]


@pytest.fixture
def started(monkeypatch) -> list[str]:
    """What ``serve`` got as far as: the model prepared, the server run (both replaced here)."""
    import uvicorn

    import saoserve.model
    from core.settings import get_settings

    calls: list[str] = []
    monkeypatch.setattr(saoserve.model, "prepare_model", lambda *a, **k: calls.append("prepare"))

    def run(server, sockets) -> None:
        calls.append("run")
        for sock in sockets:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr("server.app.create_app", lambda *a, **k: None)
    get_settings.cache_clear()
    yield calls
    get_settings.cache_clear()


@pytest.mark.parametrize(
    ("feedback", "admin", "named"),
    [
        ("change-me-feedback-secret", "0123456789abcdef0123", "SAOSERVE_FEEDBACK_SECRET"),
        (" ", "0123456789abcdef0123", "SAOSERVE_FEEDBACK_SECRET"),
        ("0123456789abcdef0123", "change-me-admin-key", "SAOSERVE_ADMIN_KEY"),
        ("0123456789abcdef0123", " ", "SAOSERVE_ADMIN_KEY"),
        ("0123456789abcdef0123", "admin-key", "SAOSERVE_ADMIN_KEY"),
    ],
)
def test_serve_refuses_before_preparing_anything(monkeypatch, started, feedback, admin, named):
    monkeypatch.setenv("SAOSERVE_FEEDBACK_SECRET", feedback)
    monkeypatch.setenv("SAOSERVE_ADMIN_KEY", admin)
    result = runner.invoke(app, ["serve", "--port", str(free_port())])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {named} ")
    assert started == []


def test_serve_starts_with_good_secrets(monkeypatch, started):
    monkeypatch.setenv("SAOSERVE_FEEDBACK_SECRET", "0123456789abcdef0123")
    monkeypatch.setenv("SAOSERVE_ADMIN_KEY", "fedcba9876543210")
    result = runner.invoke(app, ["serve", "--port", str(free_port())])
    assert result.exit_code == 0, result.output
    assert started == ["prepare", "run"]


def test_serve_refuses_a_port_in_use_before_preparing_anything(monkeypatch, started):
    """The port is bound before the model is prepared and the engine started (a minute): a port
    another process listens on is one CLI error naming it, at once."""
    monkeypatch.setenv("SAOSERVE_FEEDBACK_SECRET", "0123456789abcdef0123")
    monkeypatch.setenv("SAOSERVE_ADMIN_KEY", "fedcba9876543210")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert result.output == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert started == []


def test_serve_refuses_a_host_it_cannot_listen_on(monkeypatch, started):
    monkeypatch.setenv("SAOSERVE_FEEDBACK_SECRET", "0123456789abcdef0123")
    monkeypatch.setenv("SAOSERVE_ADMIN_KEY", "fedcba9876543210")
    result = runner.invoke(app, ["serve", "--host", "192.0.2.1", "--port", "8000"])
    assert result.exit_code == 2, result.output
    assert result.output == "error: cannot listen on 192.0.2.1:8000: Cannot assign requested address\n"
    assert started == []


def test_the_readme_by_hand_secrets_pass():
    """The README's export line, run by bash as a reader pastes it, gives secrets serve takes."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("export SAOSERVE_FEEDBACK_SECRET=")]
    out = subprocess.run(
        ["bash", "-c", f'{line}; printf "%s\\n%s\\n" "$SAOSERVE_FEEDBACK_SECRET" "$SAOSERVE_ADMIN_KEY"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    feedback, admin = out
    assert len(feedback) == len(admin) == 64 and feedback != admin  # openssl rand -hex 32
    assert server_secret_problems(Settings(feedback_secret=feedback, admin_key=admin)) == []
