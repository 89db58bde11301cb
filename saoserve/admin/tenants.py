"""``saoserve admin tenants list|add|remove``: the tenants with a policy of their own, changed at
run time (``/admin/tenant_policies``; docs/tenants.md, "Adding and removing a tenant policy"), a
command group of its own.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

import typer

from saoserve.admin.client import EXIT_CODES_HELP, JsonOption, KeyOption, UrlOption, client, reported
from saoserve.admin.output import emit_json, visible

tenants_app = typer.Typer(
    help="Tenant policies (docs/tenants.md): list them, give a tenant a policy of its own or take it "
    "away, without a restart; every server replica and `saoserve learn --all-tenants` follow the "
    f"list. {EXIT_CODES_HELP}",
    no_args_is_help=True,
)

TenantArgument = Annotated[
    str, typer.Argument(metavar="TENANT", help="The tenant (a-z, 0-9, '.', '_', '-'; not 'global').")
]


def listed(names: list[str]) -> str:
    return ", ".join(visible(n) for n in names) or "none"


@tenants_app.command("list", epilog=EXIT_CODES_HELP)
def tenants_list(url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False) -> None:
    """The tenant policies of the database's list, those the server answering serves now, and how
    many its adapter slots serve."""
    with reported():
        _, body = client(url, key).call("GET", "/admin/tenant_policies")
        if json_out:
            emit_json(body)
            return
        typer.echo(f"tenant policies: {listed(body['tenant_policies'])}")
        typer.echo(f"served by this replica: {listed(body['served'])} (at most {body['limit']})")


@tenants_app.command("add", epilog=EXIT_CODES_HELP)
def tenants_add(
    tenant: TenantArgument, url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False
) -> None:
    """Give TENANT a policy of its own: the servers serve it within SAOSERVE_TENANT_POLL_S and
    `learn --all-tenants` trains it. Exit 2 for a name the server refuses; 5 when the servers'
    adapter slots are all used (409: restart them with more) or the global policy serves full
    weights (409: its message says what to do)."""
    with reported():
        _, body = client(url, key).call("POST", "/admin/tenant_policies", body={"tenant": tenant})
        if json_out:
            emit_json(body)
            return
        done = "added" if body["changed"] else "already had a policy of its own"
        typer.echo(
            f"tenant {visible(body['tenant'])}: {done} (tenant policies: {listed(body['tenant_policies'])})"
        )


@tenants_app.command("remove", epilog=EXIT_CODES_HELP)
def tenants_remove(
    tenant: TenantArgument, url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False
) -> None:
    """Take TENANT's policy of its own away: its keys are served by the global policy within
    SAOSERVE_TENANT_POLL_S; its namespace is kept (added again, it resumes). Remove it from
    SAOSERVE_TENANT_POLICIES too, or the next start adds it back. Exit 5 for a tenant without one."""
    with reported():
        _, body = client(url, key).call("DELETE", f"/admin/tenant_policies/{quote(tenant, safe='')}")
        if json_out:
            emit_json(body)
            return
        typer.echo(
            f"tenant {visible(body['tenant'])}: removed (tenant policies: {listed(body['tenant_policies'])})"
        )
