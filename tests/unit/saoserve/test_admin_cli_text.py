"""Client text in ``saoserve admin`` (issue 23 findings 6 and 9).

A chat's ``prompt_id`` is any string a client sends. Printed by the operators' CLI it must not
drive their terminal (an OSC title and a screen clear: ``\\x1b]0;…\\x07\\x1b[2J``), be read as
rich markup (``[bold red]``), or crash it (``evil[/]``: "closing tag '[/]' has nothing to
close"); and an id holding ``/`` (or ``.``, ``..``) must be found by ``GET
/admin/evidence/{prompt_id}``, which the router answered 404.

The rows are written into the server's database as the learner writes them (a chat with such a
prompt id stores exactly that string); the server is the real app with
``testing.fakes.FakeEngine``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from typer.testing import CliRunner

from core.db import make_engine
from core.evidence_store import EvidenceStore
from saoserve.admin.output import shown, visible
from saoserve.cli import app
from testing.fakes import FakeEngine
from testing.servers import ADMIN, make_settings, running_server

KEY = "test-admin-key"
TERMINAL_ATTACK = "\x1b]0;pwned\x07\x1b[2Jx"
MARKUP = "[bold red]alarm[/]"
BROKEN_MARKUP = "evil[/]"
BIDI = "bidi\u202eevil"
SLASHED = ("team/a.b", "..", ".", "/lead")
PROMPTS = (TERMINAL_ATTACK, MARKUP, BROKEN_MARKUP, BIDI, *SLASHED)
runner = CliRunner()


def test_visible_writes_controls_as_escapes():
    assert visible(TERMINAL_ATTACK) == "\\x1b]0;pwned\\x07\\x1b[2Jx"
    assert visible("a\nb\tc\r\x7f\x9b") == "a\\x0ab\\x09c\\x0d\\x7f\\x9b"
    assert visible(BIDI) == "bidi\\u202eevil"
    assert visible("line\u2028sep") == "line\\u2028sep"
    assert visible("café 🎉 [x]") == "café 🎉 [x]"
    assert shown(MARKUP).plain == MARKUP and shown(MARKUP).spans == []


@pytest.fixture(scope="module")
async def server(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("cli-text"))
    async with running_server(settings, FakeEngine(), watch_policy=False) as url:
        store = EvidenceStore(make_engine(settings.resolved_database_url))
        with store.engine.begin() as conn:
            # Rewards spread the values so --top lists them all: (4 + r)/(8 + 1).
            store.add_results(conn, [(p, i / len(PROMPTS), 0) for i, p in enumerate(PROMPTS)])
        yield url


async def cli(*args: str):
    return await asyncio.to_thread(runner.invoke, app, ["admin", *args])


async def test_top_prints_client_text_as_text(server):
    result = await cli("evidence", "--top", "10", "--url", server, "--key", KEY)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    for printed in ("\\x1b]0;pwned\\x07\\x1b[2Jx", MARKUP, BROKEN_MARKUP, "bidi\\u202eevil", "team/a.b"):
        assert printed in out, (printed, out)


@pytest.mark.parametrize("prompt_id", [BROKEN_MARKUP, MARKUP, TERMINAL_ATTACK])
async def test_one_prompt_prints_client_text_as_text(server, prompt_id):
    result = await cli("evidence", prompt_id, "--url", server, "--key", KEY)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout
    rows = [" ".join(line.split()) for line in result.stdout.splitlines()]
    reward = PROMPTS.index(prompt_id) / len(PROMPTS)  # as the fixture rated it
    assert rows[:2] == [f"prompt {visible(prompt_id)}", f"known yes: 1 results, reward sum {reward:.3f}"]


@pytest.mark.parametrize("prompt_id", SLASHED)
async def test_a_prompt_id_with_a_slash_or_dots_is_found(server, prompt_id):
    result = await cli("evidence", prompt_id, "--json", "--url", server, "--key", KEY)
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert (body["prompt_id"], body["known"], body["n_results"]) == (prompt_id, True, 1)


async def test_the_route_takes_the_rest_of_the_path(server):
    async with httpx.AsyncClient(base_url=server, headers=ADMIN, timeout=30) as http:
        r = await http.get("/admin/evidence/team%2Fa.b")
        assert r.status_code == 200 and r.json()["prompt_id"] == "team/a.b"
        r = await http.get("/admin/evidence/team/a.b")  # unencoded: the same id
        assert r.status_code == 200 and r.json()["prompt_id"] == "team/a.b"
        r = await http.get("/admin/evidence/")
        assert r.status_code == 400 and r.json()["error"]["param"] == "path.prompt_id"
