"""Headless Chromium for the dashboard's tests and screenshots (Debian's ``chromium`` and
``chromium-driver``, driven by selenium; nothing downloads a browser).

:func:`require_browser` skips locally and fails in CI (``CI=true``) when the browser is missing:
``.ci/install-browser`` installs it.  :class:`Browser` runs every selenium call in a thread, so
the reactor keeps serving the in-process frontend the browser talks to.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

import pytest
from twisted.internet import threads

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
#: The machine's network is closed: these flags keep Chromium from stalling on its own calls.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000")


def missing() -> list[str]:
    gaps = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if importlib.util.find_spec("selenium") is None:
        gaps.append("selenium (pip install 'localai-tw[test]')")
    return gaps


def require_browser() -> None:
    gaps = missing()
    if not gaps:
        return
    message = f"needs {', '.join(gaps)}: bash .ci/install-browser"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + " [failing because CI=true]", pytrace=False)
    pytest.skip(message)


def start_chromium():
    """A new headless Chromium with a profile of its own (removed by :func:`quit`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="localai-chromium-")
    for flag in FLAGS + (f"--user-data-dir={profile}",):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.localai_profile = profile
    return driver


def quit(driver) -> None:
    try:
        driver.quit()
    finally:
        shutil.rmtree(driver.localai_profile, ignore_errors=True)


class Browser:
    """A Chromium whose every call runs in a thread (``await browser.call(fn, *args)``)."""

    def __init__(self, driver):
        self.driver = driver

    @classmethod
    async def start(cls) -> "Browser":
        return cls(await threads.deferToThread(start_chromium))

    def call(self, fn, *args):
        return threads.deferToThread(fn, self.driver, *args)

    def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition"):
        """Wait (in a thread) until ``predicate(driver)`` is truthy and return its value."""
        from selenium.webdriver.support.ui import WebDriverWait

        def wait(driver):
            return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
                lambda d: predicate(d), message=f"timed out waiting for {what}")
        return self.call(wait)

    def stop(self):
        return threads.deferToThread(quit, self.driver)
