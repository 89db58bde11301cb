"""``saoserve admin versions|pause|resume|rollback``: the policy versions the learner published,
and the operator's controls of its training (pause and resume; a rollback to an older version's
weights, published as a new version).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from saoserve.admin.client import (
    JsonOption,
    KeyOption,
    TenantOption,
    UrlOption,
    client,
    reported,
)
from saoserve.admin.output import emit_json, num, shown, when


def versions(
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    last: Annotated[int, typer.Option("--last", min=0, help="Show the newest N versions; 0: all.")] = 20,
    tenant: TenantOption = None,
) -> None:
    """The policy versions, newest last; * marks the one this server serves.

    A version whose weights are 'pruned' cannot be rolled back to.
    """
    with reported():
        _, body = client(url, key, tenant).call("GET", "/admin/policy_versions")
        rows = body["versions"][-last:] if last else body["versions"]
        if json_out:
            emit_json({"serving": body["serving"], "versions": rows})
            return
        table = Table(title=f"policy versions (serving {body['serving']})", box=box.SIMPLE_HEAD)
        for col in ("", "version", "status", "lifecycle", "parent", "weights", "created (UTC)"):
            table.add_column(col, justify="right" if col in ("version", "parent") else "left")
        for v in rows:
            table.add_row(
                *map(
                    shown,
                    (
                        "*" if v["version"] == body["serving"] else "",
                        v["version"],
                        v["status"],
                        v.get("lifecycle", ""),
                        num(v["parent_version"]),
                        "present" if v.get("available") else "pruned",
                        when(v["created_at"]),
                    ),
                )
            )
        if len(rows) < len(body["versions"]):
            table.caption = f"newest {len(rows)} of {len(body['versions'])}; --last 0 shows all"
        console = Console()
        console.print(table if rows else "no versions recorded yet (no learner has started)")


def pause(
    url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False, tenant: TenantOption = None
) -> None:
    """Pause learning (chats are still answered).

    The learner finishes the step it is in and trains no more; it keeps joining feedback.
    """
    _set_learning("/admin/pause", url, key, json_out, tenant)


def resume(
    url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False, tenant: TenantOption = None
) -> None:
    """Resume learning after a pause."""
    _set_learning("/admin/resume", url, key, json_out, tenant)


def _set_learning(path: str, url: str | None, key: str | None, json_out: bool, tenant: str | None) -> None:
    with reported():
        _, body = client(url, key, tenant).call("POST", path)
        if json_out:
            emit_json(body)
        else:
            typer.echo(f"learning {body['learning']}")


def rollback(
    version: Annotated[
        int, typer.Argument(min=0, metavar="VERSION", help="The version whose weights to serve again.")
    ],
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """Ask the learner to serve VERSION's weights again.

    The learner publishes them as a new version (versions stay monotone). Exit 5 if VERSION is unknown (404) or its weights were pruned (409).
    """
    with reported():
        _, body = client(url, key, tenant).call("POST", "/admin/rollback", body={"version": version})
        if json_out:
            emit_json(body)
        else:
            typer.echo(
                f"rollback to version {body['rollback_to']} requested: the learner publishes its "
                "weights as a new version (see `saoserve admin versions`)"
            )
