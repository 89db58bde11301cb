"""``saoserve admin`` (saoserve/admin/) without a real server: the exit codes a script reads for
bad usage (2), a server down or never answering (3), no key (4), and each error answer; the URL
and key from the settings. Each subcommand against the real server:
tests/integration/test_admin_cli.py."""

from __future__ import annotations

import socket
import subprocess
import sys

import httpx
import pytest

from core.settings import Settings
from saoserve.admin.client import (
    EXIT_AUTH,
    EXIT_NOT_FOUND,
    EXIT_SERVER,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    AdminClient,
    AdminError,
    error_for,
)
from saoserve.cli import app
from saoserve.ports import free_port
from testing import ROOT
from testing.cli import KEY, flat, runner


@pytest.fixture
def env(monkeypatch):
    """The process settings re-read from a clean environment (no key, no URL)."""
    from core.settings import get_settings

    monkeypatch.delenv("SAOSERVE_ADMIN_KEY", raising=False)
    monkeypatch.delenv("SAOSERVE_SERVER_URL", raising=False)
    get_settings.cache_clear()
    yield monkeypatch
    get_settings.cache_clear()


# ------------------------------------------------------------------ no server
def test_server_down_is_exit_3_naming_the_url(env):
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["status"], ["versions"], ["pause"], ["rollback", "1"], ["evidence", "p"]):
        result = runner.invoke(app, ["admin", *args, "--url", url, "--key", KEY])
        assert result.exit_code == EXIT_UNREACHABLE, (args, result.output)
        assert result.stderr == f"error: cannot reach the server at {url}: connection refused\n"
        assert result.stdout == ""


def test_url_and_key_come_from_the_settings(env):
    url = f"http://127.0.0.1:{free_port()}"
    env.setenv("SAOSERVE_SERVER_URL", url + "/")
    env.setenv("SAOSERVE_ADMIN_KEY", KEY)
    result = runner.invoke(app, ["admin", "versions"])
    assert result.exit_code == EXIT_UNREACHABLE
    assert f"cannot reach the server at {url}: connection refused" in result.stderr
    assert Settings().server_url == url + "/"


def test_the_installed_command_exits_3_when_the_server_is_down():
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [sys.executable, "-m", "saoserve.cli", "admin", "status", "--url", url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == EXIT_UNREACHABLE, proc.stderr
    assert proc.stderr.strip() == f"error: cannot reach the server at {url}: connection refused"


def test_no_key_is_exit_4_before_any_request(env):
    result = runner.invoke(app, ["admin", "pause", "--url", "http://127.0.0.1:1"])
    assert result.exit_code == EXIT_AUTH
    assert result.stderr == "error: no admin key: set SAOSERVE_ADMIN_KEY or pass --key\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["evidence"], "give a PROMPT_ID or --top N (exactly one)"),
        (["evidence", "p", "--top", "3"], "give a PROMPT_ID or --top N (exactly one)"),
        (["evidence", "--top", "0"], "Invalid value for '--top': Input should be greater than or equal to 1"),
        (["rollback"], "Missing argument 'VERSION'"),
        (["rollback", "v1"], "Invalid value for 'VERSION': Input should be a valid integer"),
        (
            ["versions", "--last", "-1"],
            "Invalid value for '--last': Input should be greater than or equal to 0",
        ),
        (["status", "--url", "localhost:8000"], "bad server URL 'localhost:8000'"),
    ],
)
def test_bad_usage_is_exit_2(env, args, needle):
    result = runner.invoke(app, ["admin", *args, "--key", KEY])
    assert result.exit_code == EXIT_USAGE, result.output
    assert needle in flat(result.output)


def test_a_server_that_never_answers_is_exit_3_after_the_timeout():
    # A listening socket nobody accepts on: the connection opens, no answer ever comes.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        client = AdminClient(Settings(server_url=url, admin_key=KEY), timeout_s=0.5)
        with pytest.raises(AdminError) as info:
            client.call("GET", "/admin/policy_versions")
    assert info.value.code == EXIT_UNREACHABLE
    assert str(info.value) == f"the server at {url} did not answer within 0.5 s"


def _answer(status: int, message: str | None = None, **kw) -> httpx.Response:
    body = {"error": {"message": message, "type": "x", "param": None, "code": None}}
    return httpx.Response(status, json=body, **kw) if message is not None else httpx.Response(status, **kw)


@pytest.mark.parametrize(
    ("response", "code", "message"),
    [
        (
            _answer(401, "admin routes need it"),
            EXIT_AUTH,
            "the admin key was refused (401): check SAOSERVE_ADMIN_KEY or --key",
        ),
        (
            _answer(403, "admin routes are disabled"),
            EXIT_AUTH,
            "permission denied (403): admin routes are disabled",
        ),
        (_answer(404, "no policy version 9"), EXIT_NOT_FOUND, "not found (404): no policy version 9"),
        (_answer(409, "weights are gone"), EXIT_NOT_FOUND, "unavailable (409): weights are gone"),
        (
            _answer(400, "version: too big"),
            EXIT_USAGE,
            "the server refused the request (400): version: too big",
        ),
        (
            _answer(503, "storage unavailable (the database)", headers={"Retry-After": "2"}),
            EXIT_SERVER,
            "the server is unavailable (503): storage unavailable (the database); retry after 2 s",
        ),
        (_answer(500, "boom"), EXIT_SERVER, "the server answered 500: boom"),
        (
            httpx.Response(502, text="Bad gateway\n<html>"),
            EXIT_SERVER,
            "the server answered 502: Bad gateway",
        ),
        (_answer(502), EXIT_SERVER, "the server answered 502: Bad Gateway"),
    ],
)
def test_error_answers_map_to_exit_codes(response, code, message):
    err = error_for(response)
    assert (err.code, str(err)) == (code, message)
