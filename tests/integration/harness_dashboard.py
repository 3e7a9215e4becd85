"""Reading and driving the dashboard's pages in the browser of ``browser.py``: the ``browser``
fixture, elements by CSS selector, their text while the page re-renders, clicks, and the
operator's key typed once (``test_dashboard.py``, ``test_jobs.py``, ``test_webui.py``)."""

from __future__ import annotations

import pytest_twisted

from .browser import Browser, require_browser
from .inference_harness import ADMIN


@pytest_twisted.async_yield_fixture
async def browser():
    """A headless Chromium for one test (skipped locally, failed in CI, when missing)."""
    require_browser()
    b = await Browser.start()
    try:
        yield b
    finally:
        await b.stop()


def by_css(selector):
    from selenium.webdriver.common.by import By

    def find(driver):
        found = driver.find_elements(By.CSS_SELECTOR, selector)
        return found[0] if found else None
    return find


def text_of(selector):
    """The element's text, or "" while it is missing or being replaced (every poll re-renders
    the tables, so an element found a moment ago may be stale)."""
    from selenium.common.exceptions import StaleElementReferenceException

    find = by_css(selector)

    def read(driver):
        try:
            element = find(driver)
            return element.text if element is not None else ""
        except StaleElementReferenceException:
            return ""
    return read


def click(selector):
    """Click the element, trying again when a poll replaced it between finding and clicking."""
    from selenium.common.exceptions import StaleElementReferenceException

    find = by_css(selector)

    def act(driver):
        try:
            element = find(driver)
            if element is None:
                return False
            element.click()
            return True
        except StaleElementReferenceException:
            return False
    return act


async def open_with_key(browser, url):
    """Load the page and type the admin key into its form, as an operator does once."""
    await browser.call(lambda d: d.get(url))
    field = await browser.wait_for(by_css("#api-key"), what="the key field")
    await browser.call(lambda d: (field.send_keys(ADMIN), d.find_element(
        "css selector", "#key-save").click()))
