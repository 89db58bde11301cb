"""Float settings that take a bound: none takes NaN or an infinity (an infinite read timeout is
no deadline, an infinite poll never follows the policy topic), each error names its variable.
The canary share's bounds: tests/unit/server/test_canary.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.settings import Settings

FINITE = ["kv_cache_gib", "body_read_timeout_s", "header_read_timeout_s", "policy_poll_s"]


@pytest.mark.parametrize("name", FINITE)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_a_float_setting_is_finite(monkeypatch, name, value):
    monkeypatch.setenv(f"SAOSERVE_{name.upper()}", value)
    with pytest.raises(
        ValidationError, match=rf"{name}\n  Input should (be a finite number|be greater than 0)"
    ):
        Settings()


@pytest.mark.parametrize("name", FINITE)
def test_a_finite_value_still_goes(monkeypatch, name):
    monkeypatch.setenv(f"SAOSERVE_{name.upper()}", "0.5")
    assert getattr(Settings(), name) == 0.5
