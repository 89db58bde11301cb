"""``saoserve admin``: operators' commands over a running server's admin routes.

Each command makes one to four blocking HTTP calls to the server at ``Settings.server_url``
(``/readyz``, ``/dashboard/state`` and ``/admin/*`` with ``Authorization: Bearer
<Settings.admin_key>``; ``--url`` and ``--key`` override both), prints rich tables, or with
``--json`` the JSON a script reads, and exits with a code naming the outcome (the ``EXIT_*``
constants). A failure is one line on stderr, ``error: ...``, and nothing on stdout.

The server's answers (server/routes/admin.py, server/responses.py) are printed as given; this
module only chooses columns and formats numbers. Text in them may come from any client (a
chat's ``prompt_id``): every string is printed through ``shown``, so it can neither drive the
terminal (escape sequences, bell, newlines, bidi overrides) nor be read as rich markup.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any
from urllib.parse import quote

import httpx
import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.dead_letters import KINDS as DEAD_LETTER_KINDS
from core.evidence import uncertainty_weight
from core.settings import Settings, get_settings

EXIT_OK = 0
EXIT_USAGE = 2  # click's code for a bad command line; also a request the server refused as invalid
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4
EXIT_NOT_FOUND = 5
EXIT_SERVER = 6

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 2 bad usage (the command line, or a request the server refused as invalid: "
    "400/413/422); 3 server unreachable (connection refused, no answer in time); 4 admin key "
    "missing or refused (401), or admin routes disabled (403); 5 not found or not usable (unknown "
    "version or prompt route 404, a version whose weights were pruned 409); 6 server error or not "
    "ready (5xx, 503 storage unavailable, /readyz not ready)."
)

# Every admin route answers from the database within a second; /readyz cuts its probes at 2 s.
TIMEOUT_S = 10.0

admin_app = typer.Typer(
    help="Operators' commands over a running server's admin routes (URL and key from "
    f"SAOSERVE_SERVER_URL and SAOSERVE_ADMIN_KEY, or --url/--key). {EXIT_CODES_HELP}",
    no_args_is_help=True,
)


# Format characters that reorder or hide what follows (bidi embeddings, overrides, isolates,
# marks): shown as escapes like the control characters.
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def visible(value: object) -> str:
    """``value`` as text with every control character (C0, DEL, C1: ESC, BEL, CR, newline, tab),
    line or paragraph separator and bidi control written as its escape (``\\x1b``, ``\\u202e``),
    so text from a client cannot drive the terminal it is printed on."""
    out = []
    for ch in str(value):
        cp = ord(ch)
        if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in BIDI_CONTROLS:
            out.append(f"\\x{cp:02x}" if cp < 0x100 else f"\\u{cp:04x}")
        else:
            out.append(ch)
    return "".join(out)


def shown(value: object) -> Text:
    """``visible(value)`` as a rich ``Text``: printed as it is, never parsed as markup (a
    ``[bold]`` or ``[/]`` in a prompt id is text, not a style or a syntax error)."""
    return Text(visible(value))


class AdminError(Exception):
    """A command's failure: the process exit code (``EXIT_*``) and a one-line message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def server_message(response: httpx.Response) -> str:
    """The message of an error answer: ``error.message`` of the OpenAI error shape the server
    answers, else the body's first line (cut to 200 characters), else the reason phrase."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        text = response.text.strip().splitlines()
        return text[0][:200] if text else response.reason_phrase


def error_for(response: httpx.Response) -> AdminError:
    """The AdminError of a non-2xx answer: 401/403 auth, 404/409 not found or not usable,
    400/413/422 usage, anything else a server error."""
    status, message = response.status_code, server_message(response)
    if status == 401:
        return AdminError(EXIT_AUTH, "the admin key was refused (401): check SAOSERVE_ADMIN_KEY or --key")
    if status == 403:
        return AdminError(EXIT_AUTH, f"permission denied (403): {message}")
    if status == 404:
        return AdminError(EXIT_NOT_FOUND, f"not found (404): {message}")
    if status == 409:
        return AdminError(EXIT_NOT_FOUND, f"unavailable (409): {message}")
    if status in (400, 413, 422):
        return AdminError(EXIT_USAGE, f"the server refused the request ({status}): {message}")
    if status == 503:
        retry = response.headers.get("retry-after")
        later = f"; retry after {retry} s" if retry else ""
        return AdminError(EXIT_SERVER, f"the server is unavailable (503): {message}{later}")
    return AdminError(EXIT_SERVER, f"the server answered {status}: {message}")


def _reason(exc: Exception) -> str:
    """``[Errno 111] Connection refused`` → ``connection refused``."""
    text = re.sub(r"^\[Errno -?\d+\]\s*", "", str(exc)).strip() or exc.__class__.__name__
    return text[0].lower() + text[1:]


class AdminClient:
    """Blocking calls to one server (``settings.server_url``, ``settings.admin_key``); every
    failure is raised as an AdminError."""

    def __init__(self, settings: Settings, timeout_s: float = TIMEOUT_S):
        self.url = settings.server_url.rstrip("/")
        self.key = settings.admin_key
        self.timeout_s = timeout_s

    def call(
        self,
        method: str,
        path: str,
        *,
        params: dict | None = None,
        body: dict | None = None,
        admin: bool = True,
        ok: tuple[int, ...] = (200,),
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """``(status, JSON body)`` of ``method path``; a status outside ``ok`` raises its
        AdminError (``error_for``). ``admin``: send the key (refused locally when there is none);
        ``headers``: more headers (``X-Operator``)."""
        if admin and not self.key:
            raise AdminError(EXIT_AUTH, "no admin key: set SAOSERVE_ADMIN_KEY or pass --key")
        headers = ({"Authorization": f"Bearer {self.key}"} if admin else {}) | (headers or {})
        try:
            r = httpx.request(
                method, self.url + path, params=params, json=body, headers=headers, timeout=self.timeout_s
            )
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise AdminError(
                EXIT_USAGE, f"bad server URL {self.url!r} ({exc}): give http://host:port"
            ) from None
        except httpx.TimeoutException:
            raise AdminError(
                EXIT_UNREACHABLE, f"the server at {self.url} did not answer within {self.timeout_s:g} s"
            ) from None
        except httpx.TransportError as exc:
            raise AdminError(
                EXIT_UNREACHABLE, f"cannot reach the server at {self.url}: {_reason(exc)}"
            ) from None
        if r.status_code not in ok:
            raise error_for(r)
        try:
            return r.status_code, r.json()
        except ValueError:
            raise AdminError(
                EXIT_SERVER,
                f"{method} {self.url}{path} answered {r.status_code} without JSON: is it saoserve?",
            ) from None


# ------------------------------------------------------------------ command plumbing
UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Server base URL (default: $SAOSERVE_SERVER_URL, else http://127.0.0.1:8000).",
        show_default=False,
    ),
]
KeyOption = Annotated[
    str | None, typer.Option("--key", help="Admin key (default: $SAOSERVE_ADMIN_KEY).", show_default=False)
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]


def client(url: str | None, key: str | None) -> AdminClient:
    """A client on the process settings with ``--url``/``--key`` applied over them."""
    update = {k: v for k, v in (("server_url", url), ("admin_key", key)) if v is not None}
    return AdminClient(get_settings().model_copy(update=update))


@contextmanager
def reported() -> Iterator[None]:
    """Turn an AdminError into its one-line message on stderr and its exit code."""
    try:
        yield
    except AdminError as exc:
        typer.secho(f"error: {visible(exc)}", fg="red", err=True)
        raise typer.Exit(exc.code) from None


def emit_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2))


def _num(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool) or x is None:
        return "-" if x is None else str(x)
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _when(iso: str | None) -> str:
    """``2025-06-01T12:00:03.123+00:00`` → ``2025-06-01 12:00:03`` (the database's UTC time)."""
    return "-" if not iso else iso[:19].replace("T", " ")


# ------------------------------------------------------------------ commands
@admin_app.command(epilog=EXIT_CODES_HELP)
def status(
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    steps: Annotated[int, typer.Option("--steps", min=1, max=1000, help="Learner steps to show.")] = 5,
) -> None:
    """Readiness, the version served, learning running or paused, the guard and its last verdict
    on the lineage on probation, the last learner steps.

    Exit 6 when /readyz says the server is not ready (the report is printed first).
    """
    with reported():
        c = client(url, key)
        code, ready = c.call("GET", "/readyz", admin=False, ok=(200, 503))
        not_ready = f"the server at {c.url} is not ready (503): {_down(ready)}"
        try:
            _, versions = c.call("GET", "/admin/policy_versions")
            _, learner = c.call("GET", "/admin/learner", params={"limit": steps})
            # The lifecycle as the dashboard reads it (server.metrics.read_lifecycle): the verdict
            # is the learner's last one on *this* lineage, none once it was promoted or rejected.
            _, dashboard = c.call("GET", "/dashboard/state", admin=False)
        except AdminError as exc:
            # A storage outage fails the admin routes too: name what /readyz found down.
            if code == 200 or exc.code != EXIT_SERVER:
                raise
            raise AdminError(EXIT_SERVER, f"{not_ready}; {exc}") from None
        rows = versions["versions"]
        newest = rows[-1] if rows else None
        report = {
            "server_url": c.url,
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
                    _num(s.get("reward_mean")),
                    _num(s.get("kept_fraction")),
                    _num(s.get("policy_loss"), 4),
                    _num(s.get("staleness_mean"), 2),
                    _num(s.get("step_time_s"), 1),
                    _when(s.get("created_at"))[11:],
                ),
            )
        )
    console.print(table)


def _versions(vs: list) -> str:
    return ", ".join(map(str, vs))


def _guard_lines(g: dict) -> list[tuple[str, str]]:
    """The rows of the guard's state (``GuardState`` of /dashboard/state; docs/guard.md): the
    switches, the promoted version, the lineage, and the last verdict on it (the decision, its
    time, the bounds on Δ = mean(lineage) − mean(promoted), each arm's ratings, the reason).
    Any value the learner stored as null (a non-finite bound) prints as ``-``."""
    promoted = "none" if g["promoted"] is None else f"version {g['promoted']}"
    state = f"{'on' if g['on'] else 'OFF'}; promoted {promoted}"
    if g["pinned"] is not None:
        state += f"; pinned to version {g['pinned']}"
    lineage = g["lineage"]
    state += f"; on probation: versions {_versions(lineage)}" if lineage else "; nothing on probation"
    rows = [("guard", state)]
    v = g["verdict"]
    if v is None:
        rows.append(("verdict", "none on this lineage yet" if lineage else "-"))
        return rows
    timed_out = "; timed out" if v.get("timed_out") else ""
    rows.append(
        (
            "verdict",
            f"{v.get('decision')} on versions {_versions(v.get('lineage') or [])} at "
            f"{_when(v.get('at'))} UTC{timed_out}",
        )
    )
    rows.append(("", f"Δ (lineage − promoted) in [{_num(v.get('lower'))}, {_num(v.get('upper'))}]"))
    arms = []
    for name, key in (("lineage", "candidate"), ("promoted", "promoted")):
        a = v.get(key) or {}
        arms.append(
            f"{name} {_num(a.get('n'))} (mean {_num(a.get('mean'))}, "
            f"in [{_num(a.get('lower'))}, {_num(a.get('upper'))}])"
        )
    rows.append(("", "ratings: " + "; ".join(arms)))
    rows.append(("", f"reason: {v.get('reason')}"))
    return rows


@admin_app.command(epilog=EXIT_CODES_HELP)
def versions(
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
    last: Annotated[int, typer.Option("--last", min=0, help="Show the newest N versions; 0: all.")] = 20,
) -> None:
    """The policy versions, newest last; * marks the one this server serves.

    A version whose weights are 'pruned' cannot be rolled back to.
    """
    with reported():
        _, body = client(url, key).call("GET", "/admin/policy_versions")
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
                        _num(v["parent_version"]),
                        "present" if v.get("available") else "pruned",
                        _when(v["created_at"]),
                    ),
                )
            )
        if len(rows) < len(body["versions"]):
            table.caption = f"newest {len(rows)} of {len(body['versions'])}; --last 0 shows all"
        console = Console()
        console.print(table if rows else "no versions recorded yet (no learner has started)")


@admin_app.command(epilog=EXIT_CODES_HELP)
def pause(url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False) -> None:
    """Pause learning (chats are still answered).

    The learner finishes the step it is in and trains no more; it keeps joining feedback.
    """
    _set_learning("/admin/pause", url, key, json_out)


@admin_app.command(epilog=EXIT_CODES_HELP)
def resume(url: UrlOption = None, key: KeyOption = None, json_out: JsonOption = False) -> None:
    """Resume learning after a pause."""
    _set_learning("/admin/resume", url, key, json_out)


def _set_learning(path: str, url: str | None, key: str | None, json_out: bool) -> None:
    with reported():
        _, body = client(url, key).call("POST", path)
        if json_out:
            emit_json(body)
        else:
            typer.echo(f"learning {body['learning']}")


@admin_app.command(epilog=EXIT_CODES_HELP)
def rollback(
    version: Annotated[
        int, typer.Argument(min=0, metavar="VERSION", help="The version whose weights to serve again.")
    ],
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Ask the learner to serve VERSION's weights again.

    The learner publishes them as a new version (versions stay monotone). Exit 5 if VERSION is unknown (404) or its weights were pruned (409).
    """
    with reported():
        _, body = client(url, key).call("POST", "/admin/rollback", body={"version": version})
        if json_out:
            emit_json(body)
        else:
            typer.echo(
                f"rollback to version {body['rollback_to']} requested: the learner publishes its "
                "weights as a new version (see `saoserve admin versions`)"
            )


@admin_app.command(epilog=EXIT_CODES_HELP)
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
) -> None:
    """A prompt's success evidence, or the N most uncertain prompts (--top N).

    Read at the served version. A prompt with no results yet is answered with the default prior ('known: no'), the baseline its next request would get. --top lists the prompts the uncertainty sampler favours most.
    """
    if (prompt_id is None) == (top is None):
        raise typer.BadParameter(
            "give a PROMPT_ID or --top N (exactly one)", param_hint="'PROMPT_ID' / '--top'"
        )
    with reported():
        c = client(url, key)
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
        grid.add_row("known", shown(f"yes: {e['n_results']} results, reward sum {_num(e['reward_sum'])}"))
    else:
        grid.add_row("known", "no: no results yet, the default prior")
    grid.add_row("at version", shown(b["version"]))
    grid.add_row("value", shown(_num(b["value"])))
    grid.add_row("alpha, beta", shown(f"{_num(b['alpha'])}, {_num(b['beta'])}"))
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
            shown(_num(p["value"])),
            shown(_num(p["alpha"])),
            shown(_num(p["beta"])),
            shown(_num(uncertainty_weight(p["value"]))),
        )
    console.print(table)


@admin_app.command(epilog=EXIT_CODES_HELP)
def forget(
    user: Annotated[
        str, typer.Argument(metavar="USER", help="The `user` field the user's chat requests sent.")
    ],
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Remove USER's trajectories and feedback from what the learner can ever read.

    Deleted from the database and a SQL-table log; a Kafka log keeps the records until its retention, tombstoned so the learner never uses them (docs/privacy.md). A user with nothing left: zeros, exit 0.
    """
    with reported():
        _, body = client(url, key).call("POST", "/admin/forget", body={"user": user})
        if json_out:
            emit_json(body)
            return
        typer.echo(
            f"forgot user {visible(body['user'])}: {body['trajectories']} trajectories "
            f"({body['episodes']} episodes), {body['tombstones']} new tombstones"
        )
        for name, n in body["deleted"].items():
            typer.echo(f"  deleted {name}: {n}")
        if body["log"] == "kafka":
            typer.echo(
                "the Kafka log keeps these records until its retention.ms; the learner never reads them"
            )


@admin_app.command("dead-letters", epilog=EXIT_CODES_HELP)
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
) -> None:
    """What the learner set aside instead of joining or training it, newest first, and why.

    A record the database refused three times, one that does not parse, feedback whose trajectory had expired, samples whose step kept failing (docs/reliability.md, "Dead letters"). The learner went on without them.
    """
    if kind is not None and kind not in DEAD_LETTER_KINDS:
        raise typer.BadParameter(f"not a kind of dead letter: {kind!r}", param_hint="'--kind'")
    params = {"limit": limit, "payload": payload} | ({"kind": kind} if kind else {})
    with reported():
        _, body = client(url, key).call("GET", "/admin/dead_letters", params=params)
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
                _when(d["created_at"]),
                shown(d["kind"]),
                shown(_num(d["key"])),
                shown(where),
                str(d["attempts"]),
                shown(d["reason"]),
            )
        console.print(table)


# ------------------------------------------------------------------ the version lifecycle
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


def _lifecycle_call(path: str, body: dict | None, operator: str, url, key, json_out: bool, done) -> None:
    with reported():
        _, answer = client(url, key).call("POST", path, body=body, headers={"X-Operator": operator})
        if json_out:
            emit_json(answer)
        else:
            typer.echo(done(answer))


@admin_app.command(epilog=EXIT_CODES_HELP)
def promote(
    version: Annotated[int, typer.Argument(min=0, metavar="VERSION")],
    operator: AsOption = "operator",
    reason: ReasonOption = "",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Promote VERSION (and the versions of its lineage before it). Exit 5 if it is unknown
    (404) or cannot be promoted (409: rejected, or promoted already)."""
    _lifecycle_call(
        "/admin/lifecycle/promote",
        {"version": version, "reason": reason},
        operator,
        url,
        key,
        json_out,
        lambda a: f"versions {a['versions']} promoted by {a['actor']}",
    )


@admin_app.command(epilog=EXIT_CODES_HELP)
def reject(
    version: Annotated[int, typer.Argument(min=0, metavar="VERSION")],
    operator: AsOption = "operator",
    reason: ReasonOption = "",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Reject VERSION: it never serves again; if it serves now, the learner restores the promoted
    version's weights as a new version and quarantines its samples. Exit 5 if it is unknown
    (404) or cannot be rejected (409: rejected already, or version 0)."""
    _lifecycle_call(
        "/admin/lifecycle/reject",
        {"version": version, "reason": reason},
        operator,
        url,
        key,
        json_out,
        lambda a: f"version {version} rejected by {a['actor']}",
    )


@admin_app.command(epilog=EXIT_CODES_HELP)
def pin(
    version: Annotated[int, typer.Argument(min=0, metavar="VERSION")],
    operator: AsOption = "operator",
    reason: ReasonOption = "",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
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
        json_out,
        lambda a: f"version {a['pinned']} pinned by {a['actor']}",
    )


@admin_app.command(epilog=EXIT_CODES_HELP)
def unpin(
    operator: AsOption = "operator",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Let the guard decide again."""
    _lifecycle_call(
        "/admin/lifecycle/unpin", None, operator, url, key, json_out, lambda a: f"unpinned by {a['actor']}"
    )


@admin_app.command(epilog=EXIT_CODES_HELP)
def guard(
    state: Annotated[str, typer.Argument(metavar="on|off")],
    operator: AsOption = "operator",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
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
        json_out,
        lambda a: f"guard {a['guard']} (by {a['actor']})",
    )


@admin_app.command(epilog=EXIT_CODES_HELP)
def canary(
    share: Annotated[
        float, typer.Argument(metavar="SHARE", help="The canary's share of traffic, in (0, 1].")
    ],
    operator: AsOption = "operator",
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Set the canary share: replicas serving adapters give the lineage that share of new requests;
    a single full-weight engine has none (probation) and says so."""
    if not 0.0 < share <= 1.0:
        raise typer.BadParameter(f"the share must be in (0, 1], got {share:g}", param_hint="'SHARE'")
    _lifecycle_call(
        "/admin/lifecycle/canary", {"share": share}, operator, url, key, json_out, lambda a: a["message"]
    )


@admin_app.command(epilog=EXIT_CODES_HELP)
def quarantine(
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Show the newest N.")] = 20,
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """The samples that trained a rejected version, which the learner never trains again."""
    with reported():
        _, body = client(url, key).call("GET", "/admin/quarantine", params={"limit": limit})
        if json_out:
            emit_json(body)
            return
        table = Table(title=f"quarantined samples ({body['total']})", box=box.SIMPLE_HEAD)
        for col in ("sample", "version", "reason", "at (UTC)"):
            table.add_column(col, justify="right" if col == "version" else "left")
        for r in body["samples"]:
            table.add_row(*map(shown, (r["sample_id"], r["version"], r["reason"], _when(r["at"]))))
        Console().print(table if body["samples"] else "no sample is quarantined")


# ------------------------------------------------------------------ API keys and tenants
keys_app = typer.Typer(
    help="API keys of tenants (docs/tenants.md): create (the key is shown once), list, revoke, and "
    f"opt a key out of training or back in (docs/privacy.md). {EXIT_CODES_HELP}",
    no_args_is_help=True,
)
admin_app.add_typer(keys_app, name="keys")


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
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Create an API key of TENANT and print it: this is the only time it is shown (the server
    keeps its hash). Exit 2 for a tenant name the server refuses."""
    with reported():
        _, body = client(url, key).call(
            "POST", "/admin/keys", body={"tenant": tenant, "train": train}, ok=(201,)
        )
        if json_out:
            emit_json(body)
            return
        opted = "" if body["train"] else " (opted out of training)"
        typer.echo(f"API key {visible(body['id'])} of tenant {visible(body['tenant'])}{opted}:")
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
        for col in ("id", "tenant", "train", "created (UTC)", "revoked (UTC)"):
            table.add_column(col)
        for k in body["keys"]:
            train = "yes" if k["train"] else "no (opted out)"
            row = (k["id"], k["tenant"], train, _when(k["created_at"]), _when(k["revoked_at"]))
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
            f"{_when(body['revoked_at'])} UTC"
        )


@keys_app.command("train", epilog=EXIT_CODES_HELP)
def keys_train(
    key_id: Annotated[str, typer.Argument(metavar="KEY_ID", help="The key's id (`keys list`).")],
    state: Annotated[str, typer.Argument(metavar="on|off")],
    url: UrlOption = None,
    key: KeyOption = None,
    json_out: JsonOption = False,
) -> None:
    """Opt the key KEY_ID out of training (off) or back in (on), from its next request; answers
    logged before keep their setting (docs/privacy.md). Exit 5 for an unknown id."""
    if state not in ("on", "off"):
        raise typer.BadParameter(f"expected on or off, got {state!r}", param_hint="'on|off'")
    with reported():
        _, body = client(url, key).call(
            "PATCH", f"/admin/keys/{quote(key_id, safe='')}", body={"train": state == "on"}
        )
        if json_out:
            emit_json(body)
            return
        now = "trained" if body["train"] else "opted out of training: its answers are never trained"
        typer.echo(f"API key {visible(body['id'])} of tenant {visible(body['tenant'])}: {now}")
