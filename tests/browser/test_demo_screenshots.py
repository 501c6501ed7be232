"""The README's overview and agents screenshots, taken from `gpuq dev`'s demo (issue #34 item 4).

Opt-in, as it runs the demo for about half a minute so that the charts have a
shape: ``make screenshots`` runs it with ``GPUQ_DOCS_SCREENSHOTS=1`` and
``GPUQ_SCREENSHOTS=docs/img``, and the browser tests' screenshot helper writes
docs/img/dashboard-overview.png and docs/img/dashboard-agents.png.
"""

import os

import pytest
from selenium.webdriver.common.by import By

from gpuq import demomix
from tests.browser.conftest import dashboard_server, screenshot
from tests.browser.test_dashboard import READ, UI, browse, log_in, samples, until
from tests.helpers import count, wait_for

pytestmark = pytest.mark.skipif(not os.environ.get("GPUQ_DOCS_SCREENSHOTS"),
                                reason="docs screenshots: GPUQ_DOCS_SCREENSHOTS=1 (make screenshots)")

SAMPLE_SECONDS = 0.5
CHARTED = 50  # samples on the charts when the overview is taken: 25 s of the demo


def shows_the_gpu_story(driver) -> bool:
    """Both long jobs' progress bars, and every agent busy."""
    text = driver.find_element(By.ID, "agents").text
    idle = [r for r in driver.find_elements(By.CSS_SELECTOR, "tr[data-agent]") if " 0 / " in r.text]
    return text.count("% step") >= 2 and not idle


async def test_the_demo_fills_the_overview_and_the_agents_page(chrome, dsn, pool):
    await demomix.setup(pool)
    producer = demomix.Producer(pool, demomix.Mix(20, 0.05, demomix.fleet(3)))
    async with dashboard_server(chrome, dsn, ui_sample_seconds=SAMPLE_SECONDS, drain_seconds=0.1, **UI) as srv:
        for i in range(3):
            await srv.agent(**demomix.agent_kwargs(i, 4))
        srv.tg.start_soon(producer.run, srv.stop)
        await browse(chrome.set_window_size, 1600, 900)
        await browse(log_in, chrome, srv.http, READ)
        await browse(until, chrome, lambda d: samples(d) >= CHARTED, CHARTED * SAMPLE_SECONDS * 3)
        await wait_for(lambda: count(pool, "dead"), timeout=30)
        await browse(screenshot, chrome, "dashboard-overview")
        await browse(chrome.get, f"{srv.http}/ui/agents")
        await browse(until, chrome, shows_the_gpu_story, 30)
        await browse(screenshot, chrome, "dashboard-agents")
