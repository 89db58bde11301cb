"""The system tier's fixtures: a real browser for the pages (chat page, chat header, dashboard)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from testing.dependencies import IN_CI


@pytest.fixture
def browser() -> Iterator[object]:
    """Headless Chromium under Debian's chromedriver (same version); a failure under CI, a skip
    elsewhere, when either or selenium is missing."""
    chromium, driver_exe = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if chromium is None or driver_exe is None or webdriver is None:
        what = "selenium (the dev extra)" if webdriver is None else "chromium and chromium-driver"
        if IN_CI:
            pytest.fail(f"{what} not installed (apt-get install chromium chromium-driver)")
        pytest.skip(f"{what} not installed")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager never looks for (or downloads) one.
    driver = webdriver.Chrome(options=opts, service=Service(driver_exe))
    try:
        yield driver
    finally:
        driver.quit()
