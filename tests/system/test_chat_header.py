"""The chat page's header follows the served version (issue 23 finding 11): it kept the version
it read when the page loaded, after the learner's next version was served. It now reads the
served version every ``SERVED_POLL_MS`` (5 s) and from each answer's ``policy_version``.

Headless Chromium (the ``browser`` fixture of tests/system/test_chat_page.py) on the real app with
``testing.fakes.FakeEngine``, whose version the test moves as a swap would.
"""

from __future__ import annotations

import asyncio

import pytest

from testing.fakes import FakeEngine
from testing.servers import make_settings, running_server

# Two of the page's polls, and room for a loaded machine.
HEADER_TIMEOUT_S = 30


# Chromium with the app in this process: a heavy test, run with the integration tier.
pytestmark = pytest.mark.slow


async def header_shows(driver, version: int) -> None:
    from selenium.webdriver.common.by import By

    def shown() -> str:
        return driver.find_element(By.ID, "served").text

    for _ in range(HEADER_TIMEOUT_S * 4):
        text = await asyncio.to_thread(shown)
        if text == f"serving smollm2-135m-instruct, policy version {version}":
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"the header still says {text!r}")


async def test_the_header_follows_the_served_version(browser, tmp_path):
    engine = FakeEngine(version=0)
    async with running_server(make_settings(tmp_path), engine, watch_policy=False) as url:
        await asyncio.to_thread(browser.get, f"{url}/chat")
        await header_shows(browser, 0)
        engine.version = 1  # what the policy watcher's swap does
        await header_shows(browser, 1)
