"""``saoserve admin status`` shows the guard (issue 22): its switches, the lineage on probation and
the learner's last verdict on it (``guard_verdict``, as ``learner.guard.guard.Guard._record_verdict`` writes it),
read as the dashboard reads it (``server.db_figures.read_lifecycle``): a verdict on an earlier
lineage is not shown. Text in the verdict is printed through ``saoserve.admin.output.shown``.

The real app under uvicorn with ``testing.fakes.FakeEngine``; the versions and the flag are
written into its database as the learner writes them (no learner runs).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from core.control import GUARD_OFF, GUARD_PIN, GUARD_VERDICT, set_flag
from core.db import PolicyVersion, make_engine
from saoserve.cli import app
from testing.fakes import FakeEngine
from testing.guard import add_version
from testing.servers import make_settings, running_server

KEY = "test-admin-key"
runner = CliRunner()
AT = datetime(2026, 12, 7, 10, 0, 3, 250000, tzinfo=UTC)


def verdict(lineage: list[int], **changes) -> dict:
    """A ``guard_verdict`` flag's value: ``{"lineage", "at", **asdict(Verdict)}``."""
    return {
        "lineage": lineage,
        "at": AT.isoformat(),
        "decision": "continue",
        "lower": -0.25,
        "upper": 0.125,
        "candidate": {"n": 12, "mean": 0.75, "lower": 0.5, "upper": 0.875},
        "promoted": {"n": 30, "mean": 0.7, "lower": 0.6, "upper": 0.8},
        "timed_out": False,
        "reason": "the lineage's mean is within 0.05 of the promoted one's",
    } | changes


def flat(text: str) -> list[str]:
    """The output's lines with runs of whitespace as one space."""
    return [" ".join(line.split()) for line in text.splitlines()]


@pytest.fixture
async def server(tmp_path):
    """Versions 0 and 1 promoted, 2 and 3 on probation (canary): the lineage is [2, 3]."""
    settings = make_settings(tmp_path)
    async with running_server(settings, FakeEngine(version=3), watch_policy=False) as url:
        db = make_engine(settings.resolved_database_url)
        with db.begin() as conn:
            for v, stage in ((0, "promoted"), (1, "promoted"), (2, "canary"), (3, "canary")):
                add_version(conn, v, stage, at=AT, root="/policies")
        yield url, db
        db.dispose()


async def status(url: str, *extra: str):
    result = await asyncio.to_thread(
        runner.invoke, app, ["admin", "status", "--url", url, "--key", KEY, *extra], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 0, result.output
    return result


async def test_status_shows_the_last_verdict_on_the_lineage(server):
    url, db = server
    set_flag(db, GUARD_VERDICT, json.dumps(verdict([2, 3])))
    out = flat((await status(url)).stdout)
    i = out.index(
        "guard only watches: this engine serves one full-weight version at a time, so each new version "
        "serves all traffic on probation, compared with the promoted version's earlier ratings (no live "
        "control arm: drift between the two windows is confounded with the version)"
    )
    assert out[i + 1] == "promoted version 1; on probation: versions 2, 3"
    assert out[i + 2 : i + 6] == [
        "verdict continue on versions 2, 3 at 2026-12-07 10:00:03 UTC",
        "Δ (lineage − promoted) in [-0.250, 0.125]",
        "ratings: lineage 12 (mean 0.750, in [0.500, 0.875]); promoted 30 (mean 0.700, in [0.600, 0.800])",
        "reason: the lineage's mean is within 0.05 of the promoted one's",
    ]
    report = json.loads((await status(url, "--json")).stdout)
    assert report["guard"] == {
        "on": True,
        "pinned": None,
        "promoted": 1,
        "lineage": [2, 3],
        "stages": {"promoted": 2, "canary": 2, "candidate": 0, "rejected": 0},
        "verdict": verdict([2, 3]),
        "mode": "probation",
        "can": "watch",
        "says": report["guard"]["says"],
    }


async def test_a_timed_out_verdict_with_a_bound_stored_as_null(server):
    """``learner.publish.storable`` writes a non-finite bound as null: printed ``-``."""
    url, db = server
    flag = verdict([2, 3], decision="reject", lower=None, timed_out=True, reason="time-out")
    set_flag(db, GUARD_VERDICT, json.dumps(flag))
    out = flat((await status(url)).stdout)
    assert "verdict reject on versions 2, 3 at 2026-12-07 10:00:03 UTC; timed out" in out
    assert "Δ (lineage − promoted) in [-, 0.125]" in out


async def test_client_text_in_a_verdict_cannot_drive_the_terminal(server):
    url, db = server
    reason = "\x1b]0;pwned\x07\x1b[2J[bold red]alarm[/] evil[/]\u202e"
    set_flag(db, GUARD_VERDICT, json.dumps(verdict([2, 3], reason=reason)))
    stdout = (await status(url)).stdout
    assert "\x1b" not in stdout and "\x07" not in stdout and "\u202e" not in stdout
    assert "reason: \\x1b]0;pwned\\x07\\x1b[2J[bold red]alarm[/] evil[/]\\u202e" in flat(stdout)


async def test_a_verdict_on_an_earlier_lineage_is_not_shown(server):
    url, db = server
    set_flag(db, GUARD_VERDICT, json.dumps(verdict([1], decision="promote")))
    out = flat((await status(url)).stdout)
    assert "verdict none on this lineage yet" in out
    assert json.loads((await status(url, "--json")).stdout)["guard"]["verdict"] is None


async def test_the_guard_off_and_pinned_and_nothing_on_probation(server):
    url, db = server
    with db.begin() as conn:
        conn.execute(PolicyVersion.__table__.update().values(lifecycle="promoted"))
    set_flag(db, GUARD_OFF, "1")
    set_flag(db, GUARD_PIN, "3")
    out = flat((await status(url)).stdout)
    i = out.index(
        "guard off: every new version is promoted as it is recorded, with no comparison; pinned to version 3"
    )
    assert out[i + 1] == "promoted version 3; nothing under watch"
    assert "verdict -" in out


async def test_status_shows_who_holds_each_arm_s_ratings(server):
    """The verdict's ``senders`` (learner.guard.guard_votes.Senders), which the alert
    SaoserveGuardVotesHeldByOneSender watches: one key 4 of the lineage's 10 ratings (40.0%)
    among 5 identified senders, 12 more held back by the identity cap; 1 of 30 (3.3%) among 30,
    none held back (a verdict recorded before the cap held any: no figure)."""
    url, db = server
    held = {
        "candidate": {"votes": 10, "identified": 5, "top_share": 0.4, "held_back": 12},
        "promoted": {"votes": 30, "identified": 30, "top_share": 1 / 30},
    }
    set_flag(db, GUARD_VERDICT, json.dumps(verdict([2, 3], senders=held)))
    out = flat((await status(url)).stdout)
    i = out.index("Δ (lineage − promoted) in [-0.250, 0.125]")
    assert (
        out[i + 2] == "senders: lineage 5 identified, the largest 40.0%, 12 held back by the cap; "
        "promoted 30 identified, the largest 3.3%"
    )
    assert json.loads((await status(url, "--json")).stdout)["guard"]["verdict"]["senders"] == held
