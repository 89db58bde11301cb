"""``saoserve admin keys create|list|revoke|train|trust``: the API keys of tenants
(docs/tenants.md), their training setting (docs/privacy.md) and whether they are trusted
(docs/guard.md, "Who votes"), a command group of its own.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from saoserve.admin.client import (
    EXIT_CODES_HELP,
    JsonOption,
    KeyOption,
    UrlOption,
    client,
    reported,
)
from saoserve.admin.output import emit_json, shown, visible, when

TRUSTED_HELP = (
    "The key is trusted: the operator vouches that the key's traffic is many people's (a backend relaying its users) or "
    "a judge's, so the identity caps on training batches and on the guard's votes do not bound it "
    "(docs/guard.md, 'Who votes')."
)

keys_app = typer.Typer(
    help="API keys of tenants (docs/tenants.md): create (the key is shown once), list, revoke, "
    "opt a key out of training or back in (docs/privacy.md), and trust a key the identity caps "
    f"should not bound (docs/guard.md). {EXIT_CODES_HELP}",
    no_args_is_help=True,
)


@keys_app.command("create", epilog=EXIT_CODES_HELP)
def keys_create(
    tenant: Annotated[
        str, typer.Argument(metavar="TENANT", help="The tenant the key belongs to (a-z, 0-9, '.', '_', '-').")
    ],
    train: Annotated[
        bool,
        typer.Option(
            "--train/--no-train",
            help="--no-train: the key opts out of training; every answer it is sent is logged "
            "marked train: false and never trained (docs/privacy.md).",
        ),
    ] = True,
    trusted: Annotated[bool, typer.Option("--trusted", help=TRUSTED_HELP)] = False,
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Create an API key of TENANT and print it: this is the only time it is shown (the server
    keeps its hash). Exit 2 for a tenant name the server refuses."""
    # Sent only when asked for: a server from before trusted keys refuses the field.
    trusting = {"trusted": True} if trusted else {}
    with reported():
        _, body = client(url, key).call(
            "POST", "/admin/keys", body={"tenant": tenant, "train": train} | trusting, ok=(201,)
        )
        if json_out:
            emit_json(body)
            return
        notes = [
            n for n, on in (("opted out of training", not body["train"]), ("trusted", body["trusted"])) if on
        ]
        said = f" ({', '.join(notes)})" if notes else ""
        typer.echo(f"API key {visible(body['id'])} of tenant {visible(body['tenant'])}{said}:")
        typer.echo(visible(body["key"]))
        typer.echo("keep it now: it is not stored and cannot be shown again")


@keys_app.command("list", epilog=EXIT_CODES_HELP)
def keys_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's keys.")] = None,
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """The API keys, oldest first, revoked ones included (ids, tenants, whether the answers they
    are sent are trained; never a key)."""
    with reported():
        params = {"tenant": tenant} if tenant else None
        _, body = client(url, key).call("GET", "/admin/keys", params=params)
        if json_out:
            emit_json(body)
            return
        if not body["keys"]:
            Console().print("no API keys")
            return
        table = Table(title=f"API keys ({len(body['keys'])})", box=box.SIMPLE_HEAD)
        for col in ("id", "tenant", "train", "trusted", "created (UTC)", "revoked (UTC)"):
            table.add_column(col)
        for k in body["keys"]:
            train = "yes" if k["train"] else "no (opted out)"
            trust = "yes" if k.get("trusted") else "no"
            row = (k["id"], k["tenant"], train, trust, when(k["created_at"]), when(k["revoked_at"]))
            table.add_row(*map(shown, row))
        Console().print(table)


@keys_app.command("revoke", epilog=EXIT_CODES_HELP)
def keys_revoke(
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="The key's id (`keys list`).")],
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Revoke the key KEY_ID: its next request is refused (401). Exit 5 for an unknown id."""
    with reported():
        _, body = client(url, key).call("POST", f"/admin/keys/{quote(key_id, safe='')}/revoke")
        if json_out:
            emit_json(body)
            return
        typer.echo(
            f"API key {visible(body['id'])} of tenant {visible(body['tenant'])} revoked at "
            f"{when(body['revoked_at'])} UTC"
        )


@keys_app.command("train", epilog=EXIT_CODES_HELP)
def keys_train(
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="The key's id (`keys list`).")],
    state: Annotated[str, typer.Argument(metavar="on|off")],
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Opt the key KEY_ID out of training (off) or back in (on), from its next request; its
    answers not yet trained, logged before included, are not trained while it is out
    (docs/privacy.md). Exit 5 for an unknown id, or a revoked key (409: a revoked key is final,
    its setting no longer changes)."""
    body = _configure(key_id, "train", _on_off(state), url, key)
    now = "trained" if body["train"] else "opted out of training: its answers are never trained"
    _said(body, now, json_out)


@keys_app.command("trust", epilog=EXIT_CODES_HELP)
def keys_trust(
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="The key's id (`keys list`).")],
    state: Annotated[str, typer.Argument(metavar="on|off")],
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Trust the key KEY_ID (on) or no longer (off): the operator vouches that its traffic is many
    people's (a backend relaying its users) or a judge's, so the identity caps on training
    batches and on the guard's votes do not bound it (docs/guard.md, "Who votes"), from the
    learner's next batch and check. Exit 5 for an unknown id, or a revoked key (409)."""
    body = _configure(key_id, "trusted", _on_off(state), url, key)
    now = (
        "trusted: the identity caps do not bound it"
        if body["trusted"]
        else "not trusted: the identity caps bound it"
    )
    _said(body, now, json_out)


def _on_off(state: str) -> bool:
    if state not in ("on", "off"):
        raise typer.BadParameter(f"expected on or off, got {state!r}", param_hint="'on|off'")
    return state == "on"


def _configure(key_id: str, setting: str, value: bool, url: str | None, key: str | None) -> dict:
    """``PATCH /admin/keys/KEY_ID`` with one setting; the key's listing."""
    with reported():
        _, body = client(url, key).call(
            "PATCH", f"/admin/keys/{quote(key_id, safe='')}", body={setting: value}
        )
    return body


def _said(body: dict, now: str, json_out: bool) -> None:
    """Print a key's listing after a change: the JSON, or what the key is ``now``."""
    if json_out:
        emit_json(body)
        return
    typer.echo(f"API key {visible(body['id'])} of tenant {visible(body['tenant'])}: {now}")
