"""``saoserve admin forget|dead-letters|quarantine``: what the learner never trains: a user's
records, removed (docs/privacy.md); the records it set aside instead of joining or training them
(docs/reliability.md, "Dead letters"); the samples that trained a rejected version.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from core.dead_letters import KINDS as DEAD_LETTER_KINDS
from saoserve.admin.client import (
    JsonOption,
    KeyOption,
    TenantOption,
    UrlOption,
    client,
    reported,
)
from saoserve.admin.output import emit_json, num, shown, visible, when


def forget(
    user: Annotated[
        str | None,
        typer.Argument(metavar="[USER]", help="The `user` field the user's chat requests sent."),
    ] = None,
    key_id: Annotated[
        str | None,
        typer.Option(
            "--api-key", help="Forget an API key instead: every request it authenticated (its id, k…)."
        ),
    ] = None,
    receipt: Annotated[
        str | None, typer.Option("--receipt", help="Show the receipt of a past forget (its id, f…).")
    ] = None,
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Remove USER's (or an API key's) trajectories and feedback from what the learner can ever read.

    Deleted from the database and a SQL-table log; their data keys destroyed, so a Kafka log's copies can no longer be read (docs/privacy.md). Prints the receipt: what was removed, per store. Nothing left: zeros, exit 0.
    """
    if sum(x is not None for x in (user, key_id, receipt)) != 1:
        raise typer.BadParameter("give exactly one of USER, --api-key and --receipt")
    with reported():
        if receipt is not None:
            _, body = client(url, key).call("GET", f"/admin/forget/{quote(receipt, safe='')}")
        else:
            subject = {"user": user} if user is not None else {"key": key_id}
            _, body = client(url, key).call("POST", "/admin/forget", body=subject)
        if json_out:
            emit_json(body)
            return
        whom = (
            f"user {visible(body['user'])}"
            if body.get("user")
            else (
                f"key {visible(body['key'])}"
                if body.get("key")
                else f"{body['kind']} sha256:{body['subject_hash'][:12]}…"
            )
        )
        state = (
            "" if body["completed"] else " (not completed yet: the next forget or retention run finishes it)"
        )
        typer.echo(
            f"forget {body['id']} of {whom}{state}: {body['trajectories']} trajectories "
            f"({body['episodes']} episodes), {body['tombstones']} new tombstones"
        )
        for name, n in body["deleted"].items():
            typer.echo(f"  {'destroyed' if name == 'subject_keys' else 'removed'} {name}: {n}")
        if body["log"] == "kafka":
            typer.echo(
                "the Kafka log keeps these records until its retention.ms, sealed under the destroyed "
                "keys: nobody can read them, and the learner skips them"
            )


def dead_letters(
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Show the newest N.")] = 20,
    kind: Annotated[
        str | None, typer.Option("--kind", help=f"Only this kind: {', '.join(DEAD_LETTER_KINDS)}.")
    ] = None,
    payload: Annotated[
        bool, typer.Option("--payload", help="With --json: the records themselves too.")
    ] = False,
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """What the learner set aside instead of joining or training it, newest first, and why.

    A record the database refused three times, one that does not parse, feedback whose trajectory had expired, samples whose step kept failing (docs/reliability.md, "Dead letters"). The learner went on without them.
    """
    if kind is not None and kind not in DEAD_LETTER_KINDS:
        raise typer.BadParameter(f"not a kind of dead letter: {kind!r}", param_hint="'--kind'")
    params = {"limit": limit, "payload": payload} | ({"kind": kind} if kind else {})
    with reported():
        _, body = client(url, key, tenant).call("GET", "/admin/dead_letters", params=params)
        if json_out:
            emit_json(body)
            return
        console = Console()
        rows = body["dead_letters"]
        if not rows:
            console.print("no dead letters: the learner has set nothing aside")
            return
        table = Table(title=f"newest {len(rows)} of {body['total']} dead letters", box=box.SIMPLE_HEAD)
        for col in ("id", "at (UTC)", "kind", "key", "log position", "tries", "reason"):
            table.add_column(col, justify="right" if col in ("id", "tries") else "left")
        for d in rows:
            where = "-" if d["topic"] is None else f"{d['topic']} {d['log_partition']}:{d['log_offset']}"
            table.add_row(
                str(d["id"]),
                when(d["created_at"]),
                shown(d["kind"]),
                shown(num(d["key"])),
                shown(where),
                str(d["attempts"]),
                shown(d["reason"]),
            )
        console.print(table)


def quarantine(
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Show the newest N.")] = 20,
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """The samples that trained a rejected version, which the learner never trains again."""
    with reported():
        _, body = client(url, key, tenant).call("GET", "/admin/quarantine", params={"limit": limit})
        if json_out:
            emit_json(body)
            return
        table = Table(title=f"quarantined samples ({body['total']})", box=box.SIMPLE_HEAD)
        for col in ("sample", "version", "reason", "at (UTC)"):
            table.add_column(col, justify="right" if col == "version" else "left")
        for r in body["samples"]:
            table.add_row(*map(shown, (r["sample_id"], r["version"], r["reason"], when(r["at"]))))
        Console().print(table if body["samples"] else "no sample is quarantined")
