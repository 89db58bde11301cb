"""What every ``saoserve`` command shares about its command line: a refusal (``fail``: one line on
stderr, exit 2) and the learner config fields its options set (``given``)."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """Print ``error: message`` in red on stderr and exit 2 (click's code for a bad command line).

    Raises typer.Exit(2), always."""
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def given(top: dict, **sections: dict) -> dict:
    """The learner config fields an option set (not None): ``top``'s, and each section's
    (``optimizer``, ``algorithm``, ``correction``, ``policy``) as a dict of its fields."""
    out = {k: v for k, v in top.items() if v is not None}
    return out | {
        name: {k: v for k, v in fields.items() if v is not None} for name, fields in sections.items()
    }
