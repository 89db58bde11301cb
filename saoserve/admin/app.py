"""The ``saoserve admin`` command group: every command of the subject modules, registered in the
order ``saoserve admin --help`` lists them, and the ``keys`` and ``tenants`` groups last."""

from __future__ import annotations

import typer

from saoserve.admin.client import EXIT_CODES_HELP
from saoserve.admin.evidence import evidence
from saoserve.admin.keys import keys_app
from saoserve.admin.learning import pause, resume, rollback, versions
from saoserve.admin.lifecycle import canary, guard, pin, promote, reject, unpin
from saoserve.admin.records import dead_letters, forget, quarantine
from saoserve.admin.status import policies, status
from saoserve.admin.tenants import tenants_app

admin_app = typer.Typer(
    help="Operators' commands over a running server's admin routes (URL and key from "
    f"SAOSERVE_SERVER_URL and SAOSERVE_ADMIN_KEY, or --url/--key). {EXIT_CODES_HELP}",
    no_args_is_help=True,
)

for command in (status, policies, versions, pause, resume, rollback, evidence, forget):
    admin_app.command(epilog=EXIT_CODES_HELP)(command)
admin_app.command("dead-letters", epilog=EXIT_CODES_HELP)(dead_letters)
for command in (promote, reject, pin, unpin, guard, canary, quarantine):
    admin_app.command(epilog=EXIT_CODES_HELP)(command)
admin_app.add_typer(keys_app, name="keys")
admin_app.add_typer(tenants_app, name="tenants")
