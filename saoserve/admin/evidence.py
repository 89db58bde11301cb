"""``saoserve admin evidence``: a prompt's success evidence at the served version, or the prompts
the uncertainty sampler favours most (``--top N``).
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from core.evidence import uncertainty_weight
from saoserve.admin.client import (
    JsonOption,
    KeyOption,
    TenantOption,
    UrlOption,
    client,
    reported,
)
from saoserve.admin.output import emit_json, num, shown


def evidence(
    prompt_id: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPT_ID", help="A prompt id, as sent in chat requests.", show_default=False
        ),
    ] = None,
    top: Annotated[
        int | None, typer.Option("--top", min=1, max=1000, help="Instead: the N most uncertain prompts.")
    ] = None,
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """A prompt's success evidence, or the N most uncertain prompts (--top N).

    Read at the served version. A prompt with no results yet is answered with the default prior ('known: no'), the baseline its next request would get. --top lists the prompts the uncertainty sampler favours most.
    """
    if (prompt_id is None) == (top is None):
        raise typer.BadParameter(
            "give a PROMPT_ID or --top N (exactly one)", param_hint="'PROMPT_ID' / '--top'"
        )
    with reported():
        c = client(url, key, tenant)
        if top is not None:
            _, body = c.call("GET", "/admin/evidence", params={"top": top})
        else:
            # Every character percent-encoded, '.' too: a client would resolve an id "." or ".."
            # as a path segment (RFC 3986 dot segments) before sending it.
            path = quote(prompt_id, safe="").replace(".", "%2E")
            _, body = c.call("GET", f"/admin/evidence/{path}")
        if json_out:
            emit_json(body)
        elif top is not None:
            _print_uncertain(body)
        else:
            _print_evidence(body)


def _print_evidence(e: dict) -> None:
    b = e["at_version"]
    grid = Table.grid(padding=(0, 2))
    grid.add_row("prompt", shown(e["prompt_id"]))
    if e["known"]:
        grid.add_row("known", shown(f"yes: {e['n_results']} results, reward sum {num(e['reward_sum'])}"))
    else:
        grid.add_row("known", "no: no results yet, the default prior")
    grid.add_row("at version", shown(b["version"]))
    grid.add_row("value", shown(num(b["value"])))
    grid.add_row("alpha, beta", shown(f"{num(b['alpha'])}, {num(b['beta'])}"))
    Console().print(grid)


def _print_uncertain(body: dict) -> None:
    console = Console()
    if not body["prompts"]:
        console.print(f"no prompt has evidence yet (version {body['version']})")
        return
    table = Table(title=f"most uncertain prompts at version {body['version']}", box=box.SIMPLE_HEAD)
    for col in ("prompt", "value", "alpha", "beta", "weight"):
        table.add_column(col, justify="left" if col == "prompt" else "right")
    for p in body["prompts"]:
        table.add_row(
            shown(p["prompt_id"]),
            shown(num(p["value"])),
            shown(num(p["alpha"])),
            shown(num(p["beta"])),
            shown(num(uncertainty_weight(p["value"]))),
        )
    console.print(table)
