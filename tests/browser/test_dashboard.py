"""The dashboard in a real Chromium (issue #18): log in, watch agents and jobs live."""

import anyio
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from gpuq.jobs import NewJob
from tests.browser.conftest import dashboard_server, screenshot
from tests.helpers import dispatcher_idle

READ, ADMIN = "read-secret-1", "admin-secret-1"
UI = {"ui_tokens": frozenset({READ}), "ui_admin_tokens": frozenset({ADMIN})}


async def browse(fn, *args):
    """Selenium blocks: drive it from a thread while the server runs on this loop."""
    return await anyio.to_thread.run_sync(fn, *args)


def log_in(driver, base: str, token: str) -> None:
    driver.get(f"{base}/ui")
    WebDriverWait(driver, 10).until(lambda d: d.current_url.endswith("/ui/login"))
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.ID, "kinds"))


def until(driver, check, timeout: float = 10):
    """Wait for ``check``; an element a live update replaced meanwhile is looked up again."""
    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(check)


def click(driver, css: str) -> bool:
    """Click what ``css`` finds; False (try again) when a live update replaced it meanwhile."""
    try:
        driver.find_element(By.CSS_SELECTOR, css).click()
        return True
    except (NoSuchElementException, StaleElementReferenceException):
        return False


async def _noop(job):
    return None


def samples(driver) -> int:
    """The samples the overview's charts show."""
    try:
        return int(driver.find_element(By.ID, "charts").get_attribute("data-samples"))
    except StaleElementReferenceException:  # a live update replaced it meanwhile
        return -1


def count_live_updates(driver) -> None:
    """From now on every page this browser loads counts its live updates (htmx ws messages) in
    window.liveUpdates, from before its first one: the socket sends one as it opens, then changes."""
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": (
        "window.liveUpdates = 0;"
        "document.addEventListener('htmx:wsAfterMessage', () => { window.liveUpdates += 1; });")})


def live_update_came(driver) -> None:
    until(driver, lambda d: d.execute_script("return window.liveUpdates") > 0)


# A traceback from code at a neutral path, five frames deep, so the one the agent shows (its last
# five frames) names no checkout's files: the job page's screenshot goes into docs/img.
FINETUNE = compile("""
def train(job):
    return epoch(job)

def epoch(job):
    return step(job)

def step(job):
    return forward(job)

def forward(job):
    return allocate(20 * 2**30)

def allocate(n):
    raise RuntimeError(f"CUDA out of memory: tried to allocate {n / 2**30:.2f} GiB")
""", "/srv/gpuq/finetune.py", "exec")


async def test_log_in_with_a_wrong_token_then_a_right_one(chrome, dsn):
    def steps(base: str) -> None:
        chrome.get(f"{base}/ui/login")
        chrome.find_element(By.ID, "token").send_keys("not-a-token")
        chrome.find_element(By.CSS_SELECTOR, "#login button").click()
        error = until(chrome, lambda d: d.find_element(By.ID, "login-error").is_displayed()
                      and d.find_element(By.ID, "login-error"))
        assert "does not open" in error.text
        screenshot(chrome, "login-refused")
        log_in(chrome, base, READ)
        assert chrome.find_element(By.CSS_SELECTOR, ".role").text == "read-only"
        assert chrome.execute_script("return document.cookie") == ""  # HttpOnly: no script reads it

    async with dashboard_server(chrome, dsn, **UI) as srv:
        await browse(steps, srv.http)


async def test_an_agent_connecting_shows_up_without_a_reload(chrome, dsn):
    async with dashboard_server(chrome, dsn, **UI) as srv:
        await browse(log_in, chrome, srv.http, ADMIN)
        await browse(chrome.get, f"{srv.http}/ui/agents")
        await browse(until, chrome, lambda d: "no agent connected" in d.find_element(By.ID, "agents").text)
        await srv.agent(["embed", "train"], 3, _noop, "gpu-box-7")
        rows = await browse(until, chrome, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-agent^='gpu-box-7#']"))
        text = await browse(lambda: rows[0].text)
        assert "embed, train" in text and "0 / 3" in text
        await browse(screenshot, chrome, "agents")


async def test_jobs_enqueued_then_completed_move_through_the_overview(chrome, dsn, pool):
    pending = "tr[data-kind='render'] td[data-col='pending']"

    async def render(job):
        await anyio.sleep(0.02)  # not a settle wait: the backlog drains over a few samples, for the chart

    # The charts' queue depth is the census's (GPUQ_METRICS_SAMPLE_SECONDS): as often as the charts.
    async with dashboard_server(chrome, dsn, ui_sample_seconds=0.25, metrics_sample_seconds=0.25, **UI) as srv:
        await browse(log_in, chrome, srv.http, READ)
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'render' FROM generate_series(1, 400)")
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, 30)")
        await browse(until, chrome, lambda d: [e.text for e in d.find_elements(By.CSS_SELECTOR, pending)] == ["400"])
        await browse(screenshot, chrome, "overview-backlog")
        await srv.agent(["render"], 8, render, "renderer")
        await browse(until, chrome, lambda d: "render" not in d.find_element(By.ID, "kinds").text, 20)
        drained_at = await browse(samples, chrome)
        await browse(until, chrome, lambda d: samples(d) >= drained_at + 4)  # a few idle samples after the drain
        # The embed jobs still wait: the census's next read shows them (a read that took d seconds
        # waits 50 d before the next, so under a loaded machine that is a few samples later).
        await browse(until, chrome, lambda d: "pending 30" in d.find_element(By.ID, "charts").text, 20)
        assert "queue depth" in await browse(lambda: chrome.find_element(By.ID, "charts").text)
        await browse(screenshot, chrome, "overview")


async def test_pause_a_kind_and_see_nothing_of_it_leased_then_resume(chrome, dsn, pool):
    row = "tr[data-kind='batch']"
    async with dashboard_server(chrome, dsn, **UI) as srv:
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'batch' FROM generate_series(1, 5)")
        await browse(log_in, chrome, srv.http, ADMIN)
        await browse(until, chrome, lambda d: click(d, f"{row} button.action"))
        await browse(until, chrome, lambda d: d.find_element(By.CSS_SELECTOR, f"{row} td[data-col='state']")
                     .text.startswith("paused"))
        await srv.agent(["batch"], 4, _noop, "batcher")
        await dispatcher_idle()  # an agent with credit is there and the dispatcher went idle: nothing leased
        assert await pool.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'pending'") == 5
        await browse(screenshot, chrome, "overview-paused")
        await browse(until, chrome, lambda d: click(d, f"{row} button.action"))
        await browse(until, chrome, lambda d: "no live jobs" in d.find_element(By.ID, "kinds").text, 15)


async def test_open_a_failed_job_see_why_and_retry_it(chrome, dsn, pool):
    from gpuq import queue

    tries: list[int] = []

    async def flaky(job):  # out of memory the first time only
        tries.append(job.id)
        if len(tries) == 1:
            code: dict = {}
            exec(FINETUNE, code)  # noqa: S102 - the test's own source above
            code["train"](job)
        return {"loss": 0.25}

    async with dashboard_server(chrome, dsn, **UI) as srv:
        [job_id] = await queue.enqueue_many(pool, [NewJob("finetune", {"model": "llama-8b", "lr": 3e-4},
                                                                max_attempts=1, dedup_key="ft-42")])
        await srv.agent(["finetune"], 1, flaky, "gpu-box-3")
        await browse(log_in, chrome, srv.http, ADMIN)
        await browse(chrome.get, f"{srv.http}/ui/jobs?state=dead")
        link = f"tr[data-job='{job_id}'] a"
        await browse(until, chrome, lambda d: d.find_elements(By.CSS_SELECTOR, link), 15)  # died, then listed live
        await browse(screenshot, chrome, "jobs-dead")
        await browse(until, chrome, lambda d: click(d, link))
        text = await browse(until, chrome, lambda d: d.find_element(By.ID, "job-error").text)
        assert "CUDA out of memory: tried to allocate 20.00 GiB" in text and "/srv/gpuq/finetune.py" in text
        attempts = await browse(lambda: chrome.find_element(By.ID, "attempts").text)
        assert "gpu-box-3#" in attempts and "failed, dead" in attempts
        assert "ft-42" in await browse(lambda: chrome.find_element(By.ID, "job").text)
        await browse(screenshot, chrome, "job-failed")
        await browse(until, chrome, lambda d: click(d, "#retry"))
        await browse(until, chrome, lambda d: d.find_element(By.ID, "job-state").text.startswith("done"), 15)
        attempts = await browse(lambda: chrome.find_element(By.ID, "attempts").text)
        assert "failed, dead" in attempts and "done" in attempts  # the failed attempt stays on the page
        assert "0.25" in await browse(lambda: chrome.find_element(By.ID, "job-result").text)
        await browse(screenshot, chrome, "job-retried")
        assert tries == [job_id, job_id]


HOSTILE = ["<script>window.pwned = 1</script>", "\"><img src=x onerror=\"window.pwned = 2\">",
           "'><svg onload=window.pwned=3>"]


async def test_hostile_payloads_and_errors_show_as_text(chrome, dsn, pool):
    from gpuq import queue

    async with dashboard_server(chrome, dsn, **UI) as srv:
        ids = await queue.enqueue_many(pool, [NewJob("ingest", {"text": h, h: "key"}, max_attempts=1)
                                              for h in HOSTILE])
        got = await queue.lease(pool, ["ingest"], 3, "box#1", 30.0)
        for j, h in zip(sorted(got.jobs, key=lambda j: j.id), HOSTILE, strict=True):
            await queue.fail(pool, j.id, j.lease_token, f"parse error near {h}")
        await browse(log_in, chrome, srv.http, READ)
        await browse(count_live_updates, chrome)
        pages = {"/ui/jobs?kind=ingest": HOSTILE, **{f"/ui/jobs/{i}": [h] for i, h in zip(ids, HOSTILE, strict=True)}}
        for page, hostile in pages.items():
            await browse(chrome.get, srv.http + page)
            await browse(live_update_came, chrome)  # what a live update shows is checked too
            shown = await browse(lambda: chrome.find_element(By.TAG_NAME, "main").text)
            for h in hostile:
                assert f"parse error near {h}" in shown, (page, h)  # the exact text, not markup
                if page.startswith("/ui/jobs/"):
                    payload = await browse(lambda: chrome.find_element(By.ID, "job-payload").text)
                    assert payload.count(h.replace('"', '\\"')) == 2  # as a value and as a key, JSON-quoted
            assert await browse(chrome.execute_script, "return window.pwned === undefined") is True
            assert await browse(lambda: chrome.find_elements(By.CSS_SELECTOR, "main img, main svg:not([role])")) == []
        await browse(screenshot, chrome, "job-hostile")


async def test_an_admin_adds_a_periodic_job_and_sets_a_limit_and_a_batching_policy_from_the_controls_page(chrome, dsn, pool):
    def steps(base: str) -> None:
        log_in(chrome, base, ADMIN)
        chrome.get(f"{base}/ui/controls")
        form = chrome.find_element(By.ID, "limit-form")
        form.find_element(By.NAME, "name").send_keys("train")
        form.find_element(By.NAME, "max").send_keys("many")
        form.find_element(By.TAG_NAME, "button").click()
        until(chrome, lambda d: "whole number" in d.find_element(By.ID, "limit-result").text)  # the 400 is shown
        form.find_element(By.NAME, "max").clear()
        form.find_element(By.NAME, "max").send_keys("3")
        form.find_element(By.TAG_NAME, "button").click()
        until(chrome, lambda d: d.find_element(By.ID, "limit-result").text == "kind train: at most 3 at once")
        until(chrome, lambda d: "0 / 3" in d.find_element(By.ID, "limits").text)  # the live table
        form = chrome.find_element(By.ID, "schedule-form")
        for name, value in (("name", "nightly-eval"), ("cron", "0 3 * * *"), ("kind", "eval")):
            form.find_element(By.NAME, name).send_keys(value)
        form.find_element(By.TAG_NAME, "button").click()
        until(chrome, lambda d: d.find_element(By.ID, "schedule-result").text.startswith("nightly-eval: first run"))
        until(chrome, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-schedule='nightly-eval']"))
        form = chrome.find_element(By.ID, "batching-form")
        for name, value in (("kind", "embed"), ("max_items", "5000"), ("max_wait_ms", "10")):
            form.find_element(By.NAME, name).send_keys(value)
        form.find_element(By.TAG_NAME, "button").click()
        until(chrome, lambda d: "max_items must be 1-4096" in d.find_element(By.ID, "batching-result").text)
        form.find_element(By.NAME, "max_items").clear()
        form.find_element(By.NAME, "max_items").send_keys("64")
        form.find_element(By.TAG_NAME, "button").click()
        until(chrome, lambda d: d.find_element(By.ID, "batching-result").text.startswith("embed: at most 64 a batch"))
        until(chrome, lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-batching='embed']"))  # the live table
        screenshot(chrome, "controls")

    async with dashboard_server(chrome, dsn, **UI) as srv:
        await browse(steps, srv.http)
    assert await pool.fetchval("SELECT max_running FROM gpuq.limits WHERE name = 'train'") == 3
    assert await pool.fetchval("SELECT cron FROM gpuq.schedules WHERE name = 'nightly-eval'") == "0 3 * * *"
    assert await pool.fetchval("SELECT max_items FROM gpuq.batch_policies WHERE kind = 'embed'") == 64
