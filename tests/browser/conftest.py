"""A real Chromium (Debian's chromium and chromium-driver), driven by Selenium.

Without them the browser tests are skipped with the packages to install,
except under CI=true, where a missing browser is a failure (.ci/run installs
it). Each test's screenshots go to ``SCREENSHOTS`` (the best are copied to docs/).
"""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

INSTALL = "apt-get install chromium chromium-driver"
SCREENSHOTS = Path(os.environ.get("GPUQ_SCREENSHOTS", Path(__file__).resolve().parents[2] / ".screenshots"))


def _binaries() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
    if not browser or not driver:
        raise FileNotFoundError(f"Chromium and its driver are not installed: {INSTALL}")
    return browser, driver


@pytest.fixture
def chrome() -> Iterator[object]:
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
                "--window-size=1400,900", "--no-first-run", "--disable-extensions"):
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


def screenshot(driver: object, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))  # type: ignore[attr-defined]
    return path
