"""A real Chromium (Debian's chromium and chromium-driver), driven by Selenium.

Without them the browser tests are skipped with the packages to install,
except under CI=true, where a missing browser is a failure (.ci/run installs
it). Each test's screenshots go to ``SCREENSHOTS`` (the best are copied to docs/).
"""

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

INSTALL = "apt-get install chromium chromium-driver"
SCREENSHOTS = Path(os.environ.get("GPUQ_SCREENSHOTS", Path(__file__).resolve().parents[2] / ".screenshots"))


def _binaries() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
    if not browser or not driver:
        raise FileNotFoundError(f"Chromium and its driver are not installed: {INSTALL}")
    return browser, driver


WINDOW = (1400, 900)


@pytest.fixture(scope="session")
def chromium() -> Iterator[object]:
    """One Chromium for the session (starting one cost each test 1-1.5 s); tests take it as ``chrome``."""
    try:
        browser, driver_path = _binaries()
    except FileNotFoundError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run every test: {exc}")
        pytest.skip(str(exc))
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--no-first-run", "--disable-extensions",
                "--enable-net-benchmarking"):  # chrome.benchmarking.closeConnections(): dashboard_server
        options.add_argument(arg)  # --no-sandbox: the suite may run as root
    # No speculative connections: the server's shutdown at each test's end waits for a socket
    # Chromium opened ahead and sent nothing on (websockets' 10 s open timeout).
    options.add_experimental_option("prefs", {"net.network_prediction_options": 2})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def chrome(chromium: Any) -> Iterator[object]:
    """The session's Chromium, as a new one would be: no cookies (a cookie is the host's, whatever
    the port: the last test's session would open this test's server, whose tokens are the same),
    a blank page of the usual size. Storage is per origin, and each server has a port of its own.
    What ``count_live_updates`` added to every page stays (a counter no other test reads)."""
    chromium.get("about:blank")  # the last test's page stops reconnecting its live socket
    chromium.execute_cdp_cmd("Network.clearBrowserCookies", {})
    chromium.set_window_size(*WINDOW)
    yield chromium


@contextlib.asynccontextmanager
async def dashboard_server(chrome: Any, dsn: str, **overrides: Any) -> AsyncIterator[Any]:
    """``running_server`` for a browser test: before the server stops, the browser leaves its page
    (the live socket goes with it) and closes its connections. Chromium keeps each HTTP connection
    for another request, though the server answered it and closed its side (it serves one request
    a connection), and the server's shutdown waited up to 10 s for each one (its close timeout)."""
    import anyio

    from gpuq.harness import running_server

    async with running_server(dsn, **overrides) as srv:
        try:
            yield srv
        finally:
            await anyio.to_thread.run_sync(chrome.get, "about:blank")
            await anyio.to_thread.run_sync(chrome.execute_script, "chrome.benchmarking.closeConnections()")


def screenshot(driver: object, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))  # type: ignore[attr-defined]
    return path
