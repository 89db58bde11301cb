"""Driving the ``saoserve`` CLI in a test: typer's runner, the admin key ``make_settings`` sets,
and the output with its table padding and panel borders flattened (``flat``)."""

from __future__ import annotations

from typer.testing import CliRunner

runner = CliRunner()


KEY = "test-admin-key"


def flat(text: str) -> str:
    """The output with runs of whitespace (table padding, rich's wrapping) as one space and
    without the borders of rich's error panel."""
    return " ".join(text.replace("│", " ").split())
