"""What every ``saoserve`` command shares about its command line: a refusal (``fail``: one line on
stderr, exit 2) and the learner config fields its options set (``given``)."""

from __future__ import annotations

from typing import NoReturn

import typer
from pydantic import ValidationError


def fail(message: str) -> NoReturn:
    """Print ``error: message`` in red on stderr and exit 2 (click's code for a bad command line).

    Raises typer.Exit(2), always."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def settings_problems(exc: ValidationError) -> str:
    """The refusal of settings pydantic did not accept: each problem as ``SAOSERVE_<FIELD>:
    message`` (the environment variable to mend), joined with ``; ``."""
    parts = []
    for err in exc.errors():
        field = "_".join(str(x) for x in err["loc"][:1]).upper()
        name = f"SAOSERVE_{field}: " if field else ""
        parts.append(f"{name}{err['msg'].removeprefix('Value error, ')}")
    return "invalid settings: " + "; ".join(parts)


def given(top: dict, **sections: dict) -> dict:
    """The learner config fields an option set (not None): ``top``'s, and each section's
    (``optimizer``, ``algorithm``, ``correction``, ``policy``) as a dict of its fields."""
    out = {k: v for k, v in top.items() if v is not None}
    return out | {
        name: {k: v for k, v in fields.items() if v is not None} for name, fields in sections.items()
    }
