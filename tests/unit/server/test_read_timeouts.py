"""Slowloris without a socket (the edge's contracts, finding 6; docs/reliability.md): the
deadlines' settings (30 s each, and never 0). Headers or a body trickled in to a real uvicorn:
tests/integration/test_read_timeouts.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.settings import Settings


def test_the_read_timeouts_default_to_30_s():
    assert (Settings().header_read_timeout_s, Settings().body_read_timeout_s) == (30.0, 30.0)
    for name in ("header_read_timeout_s", "body_read_timeout_s"):
        with pytest.raises(ValidationError):
            Settings(**{name: 0})
