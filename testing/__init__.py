"""What the tests and the benchmarks share: servers, fakes, dependencies, builders (no tests).

An installable package (``pip install -e .`` ships it beside the product's packages) so that
``tests/`` and ``bench/`` import one copy of each helper and never a test module. pytest fixtures
stay in the ``conftest.py`` files of ``tests/``; they build on what is here.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
"""The checkout's root (an editable install: ``testing/`` is read from the checkout)."""
