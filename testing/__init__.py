"""What the tests and the benchmarks share: servers, fakes, dependencies, record builders, tiny
models, and (``testing.backends``) the tests that run on both SQLite and PostgreSQL.

An installable package (``pip install -e .`` ships it beside the product's packages) so that
``tests/`` and ``bench/`` import one copy of each helper and never a test module. pytest fixtures
stay in the ``conftest.py`` files of ``tests/``; they build on what is here. Its modules import
the dev extra's packages (pytest, typer's runner, yaml): a test or benchmark dependency.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The checkout's root (an editable install: ``testing/`` is read from the checkout)."""
