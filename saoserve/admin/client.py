"""The HTTP client of ``saoserve admin`` and how its failures end a command.

Each command makes one to four blocking HTTP calls to the server at ``Settings.server_url``
(``/readyz``, ``/dashboard/state`` and ``/admin/*`` with ``Authorization: Bearer
<Settings.admin_key>``; ``--url`` and ``--key`` override both) and exits with a code naming the
outcome (the ``EXIT_*`` constants). A failure is an ``AdminError``, printed as one line on
stderr, ``error: ...``, with nothing on stdout (``reported``).

A command about one policy takes ``--tenant T``: its client sends ``?policy=T`` on every call
about a policy (``takes_policy``), so the server answers from that tenant policy's namespace
(docs/tenants.md, "A policy per tenant"); a name the server does not serve is its 404
``unknown_policy``, exit 5 with the server's message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import httpx
import typer

from core.settings import Settings, get_settings
from saoserve.admin.output import visible

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


# The paths that answer about one policy: the admin routes and the dashboard's state, but not
# the key registry (the global database's, one for every policy) nor the table of every policy.
# /readyz answers for every policy at once.
POLICY_PATHS = ("/admin/", "/dashboard/")
GLOBAL_PATHS = ("/admin/keys", "/admin/policies")


def takes_policy(path: str) -> bool:
    """Whether a call to ``path`` is about one policy, and so carries ``?policy=``."""
    return path.startswith(POLICY_PATHS) and not path.startswith(GLOBAL_PATHS)


class AdminClient:
    """Blocking calls to one server (``settings.server_url``, ``settings.admin_key``); every
    failure is raised as an AdminError. ``policy``: the tenant policy the calls are about
    (``?policy=``, ``takes_policy``); None: the global policy, no parameter sent."""

    def __init__(self, settings: Settings, timeout_s: float = TIMEOUT_S, policy: str | None = None):
        self.url = settings.server_url.rstrip("/")
        self.key = settings.admin_key
        self.timeout_s = timeout_s
        self.policy = policy

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
        if self.policy is not None and takes_policy(path):
            params = (params or {}) | {"policy": self.policy}
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


# The options every command takes.
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
TenantOption = Annotated[
    str | None,
    typer.Option(
        "--tenant",
        help="The tenant whose own policy this is about (one of the server's SAOSERVE_TENANT_POLICIES; "
        "`saoserve admin policies` lists them). Default: the global policy.",
        show_default=False,
    ),
]


def client(url: str | None, key: str | None, tenant: str | None = None) -> AdminClient:
    """A client on the process settings with ``--url``/``--key`` applied over them, about the
    policy of ``--tenant`` (None: the global one)."""
    update = {k: v for k, v in (("server_url", url), ("admin_key", key)) if v is not None}
    return AdminClient(get_settings().model_copy(update=update), policy=tenant)


@contextmanager
def reported() -> Iterator[None]:
    """Turn an AdminError into its one-line message on stderr and its exit code."""
    try:
        yield
    except AdminError as exc:
        typer.secho(f"error: {visible(exc)}", fg="red", err=True)
        raise typer.Exit(exc.code) from None
