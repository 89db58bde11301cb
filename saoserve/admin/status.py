"""``saoserve admin status``: readiness (``/readyz``), the version served and the newest recorded,
learning running or paused, the learner's counters, what the guard can do (decide against a live
control arm, or only watch on probation), its state and its last verdict on the lineage
(``/dashboard/state``), and the learner's last steps; of the global
policy, or of a tenant's own (``--tenant``). ``saoserve admin policies``: one row per policy
the server serves (``/admin/policies``).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from core.policies import GLOBAL
from saoserve.admin.client import (
    EXIT_SERVER,
    AdminError,
    JsonOption,
    KeyOption,
    TenantOption,
    UrlOption,
    client,
    reported,
)
from saoserve.admin.output import emit_json, num, shown, when


def status(
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    steps: Annotated[int, typer.Option("--steps", min=1, max=1000, help="Learner steps to show.")] = 5,
    tenant: TenantOption = None,
) -> None:
    """Readiness, the version served, learning running or paused, what the guard can do (decide
    against a live control arm, or only watch on probation) and its last verdict on the lineage,
    the last learner steps.

    Exit 6 when /readyz says the server is not ready (the report is printed first).
    """
    with reported():
        c = client(url, key, tenant)
        # The admin key, when there is one: /readyz names the tenant policies only to it.
        code, ready = c.call("GET", "/readyz", admin=bool(c.key), ok=(200, 503))
        not_ready = f"the server at {c.url} is not ready (503): {_down(ready)}"
        try:
            _, versions = c.call("GET", "/admin/policy_versions")
            _, learner = c.call("GET", "/admin/learner", params={"limit": steps})
            # The lifecycle as the dashboard reads it (server.db_figures.read_lifecycle): the verdict
            # is the learner's last one on *this* lineage, none once it was promoted or rejected.
            _, dashboard = c.call("GET", "/dashboard/state")
        except AdminError as exc:
            # A storage outage fails the admin routes too: name what /readyz found down.
            if code == 200 or exc.code != EXIT_SERVER:
                raise
            raise AdminError(EXIT_SERVER, f"{not_ready}; {exc}") from None
        rows = versions["versions"]
        newest = rows[-1] if rows else None
        report = {
            "server_url": c.url,
            "policy": tenant or GLOBAL,
            "ready": code == 200,
            "readiness": ready,
            "serving": versions["serving"],
            "newest_version": newest,
            "learning": learner["learning"],
            "rollback_to": learner["rollback_to"],
            "counters": learner["counters"],
            "guard": dashboard["guard"],
            "steps": learner["steps"],
        }
        if json_out:
            emit_json(report)
        else:
            _print_status(report)
        if code != 200:
            raise AdminError(EXIT_SERVER, not_ready)


POLICY_COLUMNS = (
    "policy",
    "tenant",
    "version",
    "lifecycle",
    "paused",
    "steps",
    "reward mean",
    "staleness",
    "last step (UTC)",
)


def policies(url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False) -> None:
    """The policies the server serves, one row each: the global policy, then each tenant's own.

    Each row: the version it serves and that version's lifecycle, whether its learning is paused, the learner steps recorded, and the newest step's reward mean, staleness and time. A tenant without a policy of its own is served by the global one.
    """
    with reported():
        _, body = client(url, key).call("GET", "/admin/policies")
        if json_out:
            emit_json(body)
            return
        table = Table(title=f"policies ({len(body['policies'])})", box=box.SIMPLE_HEAD)
        for col in POLICY_COLUMNS:
            table.add_column(
                col, justify="left" if col in ("policy", "tenant", "last step (UTC)") else "right"
            )
        for p in body["policies"]:
            table.add_row(
                *map(
                    shown,
                    (
                        p["policy"],
                        num(p["tenant"]),
                        p["version"],
                        num(p["lifecycle"]),
                        "yes" if p["paused"] else "no",
                        p["steps"],
                        num(p["reward_mean"]),
                        num(p["staleness_mean"], 2),
                        when(p["last_step_at"]),
                    ),
                )
            )
        Console().print(table)


READINESS_PARTS = ("database", "log", "engine", "policy")


def _down(readiness: dict) -> str:
    """``log: <why>, engine: not running`` from a /readyz body: the parts not ``ok``."""
    return ", ".join(f"{k}: {readiness.get(k)}" for k in READINESS_PARTS if readiness.get(k) != "ok")


def _print_status(r: dict) -> None:
    console = Console()
    parts = ", ".join(
        f"{k} ok" if r["readiness"].get(k) == "ok" else f"{k}: {r['readiness'].get(k)}"
        for k in READINESS_PARTS
    )
    grid = Table.grid(padding=(0, 2))
    grid.add_row("server", shown(f"{r['server_url']}: {'ready' if r['ready'] else 'NOT READY'} ({parts})"))
    if r["policy"] != GLOBAL:
        # A tenant policy's status says whose it is; the global one's reads as it always did.
        grid.add_row("policy", shown(r["policy"]))
    newest = r["newest_version"]
    if newest is None:
        published = "no versions recorded yet (no learner has started)"
    else:
        published = f"newest version {newest['version']} ({newest['status']})"
    grid.add_row("serving", shown(f"version {r['serving']}; {published}"))
    learning = r["learning"]
    if r["rollback_to"] is not None:
        learning += f"; rollback to version {r['rollback_to']} requested, not yet carried out"
    grid.add_row("learning", shown(learning))
    counters = ", ".join(f"{k} {v}" for k, v in sorted(r["counters"].items())) or "none"
    grid.add_row("counters", shown(counters))
    for label, line in _guard_lines(r["guard"]):
        grid.add_row(label, shown(line))
    console.print(grid)
    if not r["steps"]:
        console.print("no learner steps yet")
        return
    table = Table(title=f"last {len(r['steps'])} learner steps", box=box.SIMPLE_HEAD)
    for col in ("step", "version", "reward", "kept", "policy loss", "staleness", "step s", "at (UTC)"):
        table.add_column(col, justify="left" if col == "at (UTC)" else "right")
    for s in r["steps"]:
        table.add_row(
            *map(
                shown,
                (
                    s["step"],
                    s["version"],
                    num(s.get("reward_mean")),
                    num(s.get("kept_fraction")),
                    num(s.get("policy_loss"), 4),
                    num(s.get("staleness_mean"), 2),
                    num(s.get("step_time_s"), 1),
                    when(s.get("created_at"))[11:],
                ),
            )
        )
    console.print(table)


def _versions(vs: list) -> str:
    return ", ".join(map(str, vs))


ARMS = (("lineage", "candidate"), ("promoted", "promoted"))
"""The verdict's two arms: (the name printed, the key in the guard_verdict flag)."""


def _held(name: str, s: dict | None) -> str:
    """Who holds one arm's counted ratings (``learner.guard.guard_votes.Senders``), e.g.
    ``lineage 11 identified, the largest 13.0%, 74 held back by the cap``."""
    if not s:
        return f"{name} -"
    said = f"{name} {s.get('identified', 0)} identified, the largest {100 * (s.get('top_share') or 0.0):.1f}%"
    held_back = s.get("held_back") or 0
    return f"{said}, {held_back} held back by the cap" if held_back else said


def _guard_lines(g: dict) -> list[tuple[str, str]]:
    """The rows of the guard's state (``GuardState`` of /dashboard/state; docs/guard.md): what the
    guard can do on this replica, in the server's words (decide against a live control arm, or
    only watch on probation; off; pinned), the promoted version, the lineage, and the last
    verdict on it (the decision, its time, the bounds on Δ = mean(lineage) − mean(promoted),
    each arm's ratings and who holds them, the reason). Any value the learner stored as null (a non-finite bound)
    prints as ``-``."""
    promoted = "none" if g["promoted"] is None else f"version {g['promoted']}"
    lineage = g["lineage"]
    where = {"decide": "on canary", "watch": "on probation"}.get(g["can"], "under watch")
    versions = f"{where}: versions {_versions(lineage)}" if lineage else "nothing under watch"
    rows = [("guard", g["says"]), ("", f"promoted {promoted}; {versions}")]
    v = g["verdict"]
    if v is None:
        rows.append(("verdict", "none on this lineage yet" if lineage else "-"))
        return rows
    timed_out = "; timed out" if v.get("timed_out") else ""
    rows.append(
        (
            "verdict",
            f"{v.get('decision')} on versions {_versions(v.get('lineage') or [])} at "
            f"{when(v.get('at'))} UTC{timed_out}",
        )
    )
    rows.append(("", f"Δ (lineage − promoted) in [{num(v.get('lower'))}, {num(v.get('upper'))}]"))
    arms = []
    for name, key in ARMS:
        a = v.get(key) or {}
        arms.append(
            f"{name} {num(a.get('n'))} (mean {num(a.get('mean'))}, "
            f"in [{num(a.get('lower'))}, {num(a.get('upper'))}])"
        )
    rows.append(("", "ratings: " + "; ".join(arms)))
    held = v.get("senders") or {}
    if held:
        rows.append(("", "senders: " + "; ".join(_held(name, held.get(key)) for name, key in ARMS)))
    rows.append(("", f"reason: {v.get('reason')}"))
    return rows
