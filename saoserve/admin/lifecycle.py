"""``saoserve admin promote|reject|pin|unpin|guard|canary``: the operator's actions on the version
lifecycle (docs/guard.md, "The lifecycle"), each recorded with ``--as NAME`` (``X-Operator``).
"""

from __future__ import annotations

from typing import Annotated

import typer

from core.lifecycle import CANARY_SHARE_MAX, CANARY_SHARE_MIN, check_canary_share
from saoserve.admin.client import (
    JsonOption,
    KeyOption,
    TenantOption,
    UrlOption,
    client,
    reported,
)
from saoserve.admin.output import emit_json


def _operator_name(name: str) -> str:
    """``--as``: 1 to 64 printable ASCII characters (an HTTP header carries no other), as the
    server's X-Operator check wants them; anything else is a usage error (exit 2)."""
    stripped = name.strip()
    if not stripped or len(stripped) > 64 or not (stripped.isascii() and stripped.isprintable()):
        raise typer.BadParameter(f"NAME must be 1 to 64 printable ASCII characters, not {name!r}")
    return stripped


AsOption = Annotated[
    str,
    typer.Option(
        "--as",
        help="Who you are, recorded with the action (X-Operator): 1 to 64 printable ASCII characters.",
        metavar="NAME",
        callback=_operator_name,
    ),
]
ReasonOption = Annotated[str, typer.Option("--reason", help="Why, recorded with the action.")]


def _lifecycle_call(
    path: str, body: dict | None, operator: str, url, key, tenant, json_out: bool, done
) -> None:
    with reported():
        _, answer = client(url, key, tenant).call("POST", path, body=body, headers={"X-Operator": operator})
        if json_out:
            emit_json(answer)
        else:
            typer.echo(done(answer))


def promote(
    version: Annotated[int, typer.Argument(min=0, metavar="VERSION")],
    operator: AsOption = "operator",
    reason: ReasonOption = "",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """Promote VERSION (and the versions of its lineage before it). Exit 5 if it is unknown
    (404) or cannot be promoted (409: rejected, or promoted already)."""
    _lifecycle_call(
        "/admin/lifecycle/promote",
        {"version": version, "reason": reason},
        operator,
        url,
        key,
        tenant,
        json_out,
        lambda a: f"versions {a['versions']} promoted by {a['actor']}",
    )


def reject(
    version: Annotated[int, typer.Argument(min=0, metavar="VERSION")],
    operator: AsOption = "operator",
    reason: ReasonOption = "",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """Reject VERSION and the versions trained from it: none serves again (with adapters their
    requests go to the newest promoted version left at once; a full-weight replica swaps back to
    the newest version not rejected at its next poll); the learner restores that version's
    weights as a new version and quarantines their samples. Exit 5 if it is unknown (404) or cannot be rejected (409:
    rejected already, version 0, or moved by another operator or the guard first)."""
    _lifecycle_call(
        "/admin/lifecycle/reject",
        {"version": version, "reason": reason},
        operator,
        url,
        key,
        tenant,
        json_out,
        lambda a: f"versions {a['versions']} rejected by {a['actor']}",
    )


def pin(
    version: Annotated[int, typer.Argument(min=0, metavar="VERSION")],
    operator: AsOption = "operator",
    reason: ReasonOption = "",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """Pin VERSION: the guard decides nothing by itself until `unpin`. A candidate or canary
    VERSION is promoted first; pinning a version older than the promoted one does not serve it
    (`rollback VERSION` does)."""
    _lifecycle_call(
        "/admin/lifecycle/pin",
        {"version": version, "reason": reason},
        operator,
        url,
        key,
        tenant,
        json_out,
        lambda a: f"version {a['pinned']} pinned by {a['actor']}",
    )


def unpin(
    operator: AsOption = "operator",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """Let the guard decide again."""
    _lifecycle_call(
        "/admin/lifecycle/unpin",
        None,
        operator,
        url,
        key,
        tenant,
        json_out,
        lambda a: f"unpinned by {a['actor']}",
    )


def guard(
    state: Annotated[str, typer.Argument(metavar="on|off")],
    operator: AsOption = "operator",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """Turn the guard on or off (off: no gate, every new version is promoted when recorded)."""
    if state not in ("on", "off"):
        raise typer.BadParameter(f"expected on or off, got {state!r}", param_hint="'on|off'")
    _lifecycle_call(
        "/admin/lifecycle/guard",
        {"on": state == "on"},
        operator,
        url,
        key,
        tenant,
        json_out,
        lambda a: f"guard {a['guard']} (by {a['actor']})",
    )


def canary(
    share: Annotated[
        float,
        typer.Argument(
            metavar="SHARE",
            help=f"The canary's share of traffic, in [{CANARY_SHARE_MIN}, {CANARY_SHARE_MAX}].",
        ),
    ],
    operator: AsOption = "operator",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    tenant: TenantOption = None,
) -> None:
    """Set the canary share: replicas serving adapters give the lineage that share of new requests;
    a single full-weight engine has none (probation) and says so."""
    try:
        check_canary_share(share, "SHARE")
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'SHARE'") from None
    _lifecycle_call(
        "/admin/lifecycle/canary",
        {"share": share},
        operator,
        url,
        key,
        tenant,
        json_out,
        lambda a: a["message"],
    )
