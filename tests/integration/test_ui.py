"""The dashboard over HTTP (issue #18): who gets in, what a page shows, live updates, headers.

The browser tests (tests/browser) drive the same pages in Chromium.
"""

import http.client
import json

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from gpuq.config import ConfigError, ServerConfig
from gpuq.harness import TOKEN, running_server
from gpuq.jobs import NewJob
from tests.helpers import wait_for

READ, ADMIN = "read-secret-1", "admin-secret-1"
UI = {"ui_tokens": frozenset({READ}), "ui_admin_tokens": frozenset({ADMIN})}


async def request(port: int, method: str, path: str, headers: dict[str, str] | None = None
                  ) -> tuple[int, dict[str, str], str]:
    def go() -> tuple[int, dict[str, str], str]:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
        c.close()
        return out
    return await anyio.to_thread.run_sync(go)


def origin(port: int) -> dict[str, str]:
    return {"Origin": f"http://127.0.0.1:{port}"}


async def login(port: int, token: str) -> str:
    status, headers, _ = await request(port, "POST", "/ui/login",
                                       {"Authorization": f"Bearer {token}", **origin(port)})
    assert status == 204, status
    return headers["set-cookie"].split(";")[0]


async def test_nothing_is_visible_without_a_dashboard_token(dsn):
    async with running_server(dsn, **UI) as srv:
        status, headers, _ = await request(srv.port, "GET", "/ui")
        assert status == 303 and headers["location"] == "/ui/login"
        status, _, body = await request(srv.port, "GET", "/ui/login")
        assert status == 200 and 'type="password"' in body and READ not in body
        for token in (TOKEN, "nope"):  # an agent's token opens nothing
            status, _, _ = await request(srv.port, "POST", "/ui/login", {"Authorization": f"Bearer {token}",
                                                                        **origin(srv.port)})
            assert status == 401
        status, _, _ = await request(srv.port, "GET", "/ui", {"Cookie": "gpuq_ui=admin.9999999999.00.forged"})
        assert status == 303
        status, _, _ = await request(srv.port, "POST", "/ui/login", {"Authorization": f"Bearer {READ}"})
        assert status == 403  # no Origin: not a page of ours


async def test_a_session_cookie_is_http_only_and_strict_and_opens_the_pages(dsn, pool):
    async with running_server(dsn, drain_seconds=0.1, **UI) as srv:  # box-1's job runs on: no 5 s drain
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('embed'), ('embed'), ('train')")
        await srv.agent(["embed"], 2, _never, "box-1")
        status, headers, _ = await request(srv.port, "POST", "/ui/login",
                                           {"Authorization": f"Bearer {READ}", **origin(srv.port)})
        cookie = headers["set-cookie"]
        assert status == 204 and "HttpOnly" in cookie and "SameSite=Strict" in cookie and READ not in cookie
        session = {"Cookie": cookie.split(";")[0]}
        status, headers, body = await request(srv.port, "GET", "/ui", session)
        assert status == 200 and 'data-kind="train"' in body and "read-only" in body
        assert "script-src 'self'" in headers["content-security-policy"]
        assert READ not in body and TOKEN not in body
        status, _, body = await request(srv.port, "GET", "/ui/agents", session)
        assert status == 200 and "box-1#" in body and "embed" in body


async def _never(job):
    await anyio.sleep(60)  # not a settle wait: a job that runs as long as the test


async def test_a_post_needs_the_sessions_csrf_token_and_this_origin(dsn):
    async with running_server(dsn, **UI) as srv:
        session = {"Cookie": await login(srv.port, ADMIN)}
        _, _, page = await request(srv.port, "GET", "/ui", session)
        csrf = json.loads(page.split('hx-headers="', 1)[1].split('"', 1)[0].replace("&#34;", '"'))["X-CSRF-Token"]
        for headers in ({}, {"X-CSRF-Token": "0" * 64}, {"X-CSRF-Token": csrf, "Origin": "http://evil.example"}):
            status, _, _ = await request(srv.port, "POST", "/ui/logout", {**session, **origin(srv.port), **headers})
            assert status == 403
        status, headers, _ = await request(srv.port, "POST", "/ui/logout",
                                           {**session, **origin(srv.port), "X-CSRF-Token": csrf})
        assert status == 204 and "Max-Age=0" in headers["set-cookie"]


async def test_the_live_socket_pushes_the_pages_fragments_to_a_logged_in_page_only(dsn, pool):
    async with running_server(dsn, **UI) as srv:
        live = f"ws://127.0.0.1:{srv.port}/ui/live?page=overview"
        with pytest.raises(InvalidStatus):
            await connect(live, origin=f"http://127.0.0.1:{srv.port}")
        cookie = await login(srv.port, READ)
        with pytest.raises(InvalidStatus):  # another origin: refused even with the cookie
            await connect(live, additional_headers={"Cookie": cookie}, origin="http://evil.example")
        async with connect(live, additional_headers={"Cookie": cookie}, origin=f"http://127.0.0.1:{srv.port}") as ws:
            first = await ws.recv()
            assert 'id="overview" hx-swap-oob="true"' in first and "no live jobs" in first
            await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('render')")
            with anyio.fail_after(5):
                assert 'data-kind="render"' in await ws.recv()  # pushed when it changed


async def test_static_files_are_the_vendored_ones_only(dsn):
    async with running_server(dsn, **UI) as srv:
        status, headers, body = await request(srv.port, "GET", "/ui/static/htmx-2.0.11.min.js")
        assert status == 200 and headers["content-type"].startswith("text/javascript") and "htmx" in body
        status, _, _ = await request(srv.port, "GET", "/ui/static/../../config.py")
        assert status == 404


async def test_the_dashboard_is_off_without_its_tokens(dsn):
    async with running_server(dsn) as srv:
        status, _, body = await request(srv.port, "GET", "/ui")
        assert status == 404 and "GPUQ_UI_TOKENS" in body


def test_a_dashboard_token_may_not_be_an_agents_or_both_roles():
    with pytest.raises(ConfigError, match="agent token"):
        ServerConfig(database_url="postgresql://x", tokens=frozenset({"t"}), ui_tokens=frozenset({"t"}))
    with pytest.raises(ConfigError, match="one role"):
        ServerConfig(database_url="postgresql://x", tokens=frozenset({"t"}), ui_tokens=frozenset({"u"}),
                     ui_admin_tokens=frozenset({"u"}))


async def test_the_server_stops_while_a_page_is_open_on_an_unchanging_view(dsn):
    with anyio.fail_after(20):  # a live socket with nothing new to send must still notice the close
        async with running_server(dsn, **UI) as srv:
            cookie = await login(srv.port, READ)
            ws = await connect(f"ws://127.0.0.1:{srv.port}/ui/live?page=overview",
                               additional_headers={"Cookie": cookie}, origin=f"http://127.0.0.1:{srv.port}")
            await ws.recv()


async def test_only_an_admin_pauses_and_resumes_a_kind_with_the_clis_functions(dsn, pool):
    from gpuq import admin as admin_api

    async with running_server(dsn, **UI) as srv:
        for token, expected in ((READ, 403), (ADMIN, 204)):
            session = {"Cookie": await login(srv.port, token)}
            _, _, page = await request(srv.port, "GET", "/ui", session)
            csrf = json.loads(page.split('hx-headers="', 1)[1].split('"', 1)[0].replace("&#34;", '"'))["X-CSRF-Token"]
            headers = {**session, **origin(srv.port), "X-CSRF-Token": csrf}
            status, _, _ = await request(srv.port, "POST", "/ui/kinds/pause?kind=batch", headers)
            assert status == expected
        assert set(await admin_api.paused(pool)) == {"batch"}
        assert (await admin_api.paused(pool))["batch"]["by"] == "dashboard"
        status, _, body = await request(srv.port, "POST", "/ui/kinds/pause?kind=bad%20kind", headers)
        assert status == 400 and "bad job kind" in body
        status, _, _ = await request(srv.port, "POST", "/ui/kinds/resume?kind=batch", headers)
        assert status == 204 and await admin_api.paused(pool) == {}


async def _admin_headers(port: int, token: str = ADMIN) -> dict[str, str]:
    session = {"Cookie": await login(port, token)}
    _, _, page = await request(port, "GET", "/ui", session)
    csrf = json.loads(page.split('hx-headers="', 1)[1].split('"', 1)[0].replace("&#34;", '"'))["X-CSRF-Token"]
    return {**session, **origin(port), "X-CSRF-Token": csrf}


async def _dead_jobs(pool, errors: list[str], kind: str = "train") -> list[int]:
    from gpuq import queue

    ids = await queue.enqueue_many(pool, [NewJob(kind, {"i": i}, max_attempts=1) for i in range(len(errors))])
    got = await queue.lease(pool, [kind], len(ids), "box-9#1", 30.0)
    for j, error in zip(sorted(got.jobs, key=lambda j: j.id), errors, strict=True):
        await queue.fail(pool, j.id, j.lease_token, error)
    return ids


async def test_the_jobs_list_filters_and_pages_by_keyset(dsn, pool):
    async with running_server(dsn, **UI) as srv:
        dead = await _dead_jobs(pool, ["CUDA out of memory", "segfault", "CUDA out of memory"])
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, 60)")
        session = {"Cookie": await login(srv.port, READ)}
        status, _, body = await request(srv.port, "GET", "/ui/jobs?state=dead&error=out+of+memory", session)
        assert status == 200
        assert [f'data-job="{i}"' in body for i in dead] == [True, False, True]
        assert body.count("<td>box-9#1</td>") == 2  # the agent of each one's last attempt
        status, _, body = await request(srv.port, "GET", "/ui/jobs?kind=embed", session)
        assert body.count("data-job=") == 50 and 'id="older"' in body
        older = body.split('id="older"')[0].rsplit('href="', 1)[1].split('"')[0].replace("&amp;", "&")
        assert "before=" in older and "kind=embed" in older
        _, _, body = await request(srv.port, "GET", older, session)
        assert body.count("data-job=") == 10 and 'id="older"' not in body and 'id="newest"' in body
        for bad in ("/ui/jobs?state=running", "/ui/jobs?kind=a%20b", "/ui/jobs?before=x", "/ui/jobs?error=" + "x" * 300):
            status, _, _ = await request(srv.port, "GET", bad, session)
            assert status == 400, bad
        assert 'id="retry-matching"' not in (await request(srv.port, "GET", "/ui/jobs?state=dead", session))[2]


async def test_a_job_page_shows_the_batch_it_ran_in_with_its_key_and_cost(dsn, pool):
    from gpuq import queue

    async with running_server(dsn, **UI) as srv:
        lead, job_id = await queue.enqueue_many(pool, [NewJob("embed"), NewJob("embed", cost=512, batch_key="len-512")])
        await pool.execute("UPDATE gpuq.jobs SET batch_id = $1, batch_size = 2 WHERE id = ANY($2)", lead, [lead, job_id])
        session = {"Cookie": await login(srv.port, READ)}
        status, _, body = await request(srv.port, "GET", f"/ui/jobs/{job_id}", session)
        assert status == 200
        assert f'2 jobs, led by <a href="/ui/jobs/{lead}">job {lead}</a>; key len-512; cost 512' in body

async def test_a_job_page_shows_payload_error_attempts_and_keys(dsn, pool):
    from gpuq import queue

    async with running_server(dsn, **UI) as srv:
        [job_id] = await queue.enqueue_many(pool, [NewJob(
            "train", {"prompt": "</pre><script>alert(1)</script>"}, max_attempts=2, dedup_key="nightly-7")])
        for error in ("CUDA out of memory", "segfault"):
            [j] = (await queue.lease(pool, ["train"], 1, "box-1#a", 30.0)).jobs
            await queue.fail(pool, j.id, j.lease_token, error)
            await pool.execute("UPDATE gpuq.jobs SET status = 'pending' WHERE id = $1 AND status = 'scheduled'",
                               job_id)
        await pool.execute("UPDATE gpuq.jobs SET concurrency_key = 'tenant-3' WHERE id = $1", job_id)
        session = {"Cookie": await login(srv.port, READ)}
        status, _, body = await request(srv.port, "GET", f"/ui/jobs/{job_id}", session)
        assert status == 200
        assert "nightly-7" in body and "tenant-3" in body and "failed, retry scheduled" in body
        assert "failed, dead" in body and body.count("box-1#a") == 2 and "segfault" in body
        assert "<script>alert" not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
        status, _, _ = await request(srv.port, "GET", "/ui/jobs/99999", session)
        assert status == 404
        status, _, _ = await request(srv.port, "GET", "/ui/jobs/" + "9" * 30, session)
        assert status == 400


async def test_an_admin_retries_by_filter_after_seeing_the_count_and_cancels_a_job(dsn, pool):
    from gpuq import admin as admin_api
    from tests.helpers import status_of

    async with running_server(dsn, **UI) as srv:
        dead = await _dead_jobs(pool, ["CUDA out of memory", "segfault", "CUDA out of memory"])
        read_only, admin = await _admin_headers(srv.port, READ), await _admin_headers(srv.port)
        preview = "/ui/jobs/retry?state=dead&error=out+of+memory"
        assert (await request(srv.port, "GET", preview, read_only))[0] == 403
        assert (await request(srv.port, "POST", preview, read_only))[0] == 403
        status, _, body = await request(srv.port, "GET", preview, admin)
        assert status == 200 and '<span id="retry-count">2</span>' in body
        assert 'hx-post="/ui/jobs/retry?state=dead&amp;error=out+of+memory"' in body
        status, _, body = await request(srv.port, "POST", "/ui/jobs/retry?state=dead&error=out+of+memory", admin)
        assert status == 200 and body == "2 jobs sent back to pending"
        assert [await status_of(pool, i) for i in dead] == ["pending", "dead", "pending"]
        status, _, body = await request(srv.port, "POST", "/ui/jobs/retry?state=pending", admin)
        assert status == 400 and "dead, cancelled or failed" in body
        status, _, body = await request(srv.port, "POST", f"/ui/jobs/retry?id={dead[1]}", admin)
        assert body == "1 job sent back to pending"
        assert (await request(srv.port, "POST", f"/ui/jobs/cancel?id={dead[0]}", admin))[0] == 204
        assert await status_of(pool, dead[0]) == "cancelled"
        assert (await request(srv.port, "POST", f"/ui/jobs/cancel?id={dead[0]}", admin))[0] == 409
        assert (await admin_api.show(pool, dead[0]))["last_error"] == "cancelled"


async def test_the_job_pages_live_socket_pushes_its_state(dsn, pool):
    async with running_server(dsn, **UI) as srv:
        [job_id] = await _dead_jobs(pool, ["boom"])
        cookie = await login(srv.port, READ)
        async with connect(f"ws://127.0.0.1:{srv.port}/ui/live?page=job&id={job_id}",
                           additional_headers={"Cookie": cookie}, origin=f"http://127.0.0.1:{srv.port}") as ws:
            assert "dead" in await ws.recv()
            await pool.execute("UPDATE gpuq.jobs SET status = 'pending' WHERE id = $1", job_id)
            with anyio.fail_after(5):
                assert '<dd class="state pending"' in await ws.recv()
        async with connect(f"ws://127.0.0.1:{srv.port}/ui/live?page=jobs&state=pending",
                           additional_headers={"Cookie": cookie}, origin=f"http://127.0.0.1:{srv.port}") as ws:
            assert f'data-job="{job_id}"' in await ws.recv()


async def test_the_overview_charts_the_last_hour_from_the_servers_own_samples(dsn, pool):
    async with running_server(dsn, ui_sample_seconds=0.2, **UI) as srv:
        await srv.agent(["chart"], 4, _quick, "box-1")
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'chart' FROM generate_series(1, 40)")
        session = {"Cookie": await login(srv.port, READ)}

        async def charted() -> bool:
            _, _, body = await request(srv.port, "GET", "/ui", session)
            samples = int(body.split('data-samples="', 1)[1].split('"', 1)[0])
            lease_points = body.split('<polyline class="lease" points="', 1)[1].split('"', 1)[0]
            return samples >= 3 and bool(lease_points.strip())  # some interval leased jobs

        await wait_for(charted, interval=0.1)
        _, _, body = await request(srv.port, "GET", "/ui", session)
        done_points = body.split('<polyline class="done" points="', 1)[1].split('"', 1)[0].split()
        assert len(done_points) >= 3 and any(float(p.split(",")[1]) < 60 for p in done_points)  # above zero once
        assert "one sample every 0.2 s" in body


async def _quick(job):
    return {"ok": True}


async def test_many_open_pages_share_one_overview_read_a_second(dsn, monkeypatch):
    from gpuq import admin as admin_api
    from gpuq.ui import views

    reads = []
    counted = admin_api.status_counts

    async def status_counts(db):
        reads.append(1)
        return await counted(db)

    monkeypatch.setattr(views.admin, "status_counts", status_counts)  # counts the real reads
    async with running_server(dsn, **UI) as srv:
        cookie = await login(srv.port, READ)
        sockets = [await connect(f"ws://127.0.0.1:{srv.port}/ui/live?page=overview", origin=origin(srv.port)["Origin"],
                                 additional_headers={"Cookie": cookie}) for _ in range(10)]
        try:
            for ws in sockets:
                await ws.recv()
            reads.clear()
            await anyio.sleep(3)  # not a settle wait: the reads are counted over these 3 s of open pages
        finally:
            for ws in sockets:
                await ws.close()
    # Ten pages each asking every second share about one read a second; none at all when the last
    # read was slow (a read of d seconds is kept 50 d: gpuq.ui.shared.LOAD_SHARE), as on a loaded CI.
    assert len(reads) <= 5, len(reads)


async def test_the_agents_page_links_the_job_each_gpu_runs(dsn, pool):
    from gpuq.producer import enqueue
    from gpuq.protocol import Device

    started = anyio.Event()

    async def train(job):
        started.set()
        await anyio.sleep(30)  # not a settle wait: the job runs while the page is read

    async with running_server(dsn, drain_seconds=0.1, **UI) as srv:
        await srv.agent(["train"], 2, train, "gpu-box", devices=(Device(0, "H100", 81559), Device(1, "H100", 81559)))
        job_id = await enqueue(pool, "train", {}, gpus=1)
        with anyio.fail_after(10):
            await started.wait()
        _, _, body = await request(srv.port, "GET", "/ui/agents", {"Cookie": await login(srv.port, READ)})
        assert f'runs <a href="/ui/jobs/{job_id}">{job_id}</a>' in body and body.count("runs <a") == 1


async def test_the_agents_page_shows_the_progress_each_running_job_reported(dsn, pool):
    from gpuq.producer import enqueue

    async def train(job):
        job.progress(0.4, "epoch <2>/5")
        await anyio.sleep(30)  # not a settle wait: the job runs while the page is read

    async with running_server(dsn, drain_seconds=0.1, **UI) as srv:
        await srv.agent(["train"], 1, train, "trainer")
        job_id = await enqueue(pool, "train", {})
        cookie = {"Cookie": await login(srv.port, READ)}
        page: list[str] = []

        async def shows_progress() -> bool:
            page[:] = [(await request(srv.port, "GET", "/ui/agents", cookie))[2]]
            return "<progress" in page[0]

        await wait_for(shows_progress, interval=0.1)
    assert f'<div class="progress" data-job="{job_id}"><a href="/ui/jobs/{job_id}">{job_id}</a> ' \
           '<progress max="1" value="0.4"></progress> 40% epoch &lt;2&gt;/5</div>' in page[0]


async def test_the_controls_page_shows_what_the_cli_set_and_an_admin_removes_a_schedule(dsn, pool):
    from gpuq import admin as admin_api
    from gpuq import schedules

    async with running_server(dsn, **UI) as srv:
        await admin_api.pause(pool, "render", by="alice")
        await admin_api.set_limit(pool, "kind", "train", 4)
        await admin_api.set_kind_timeout(pool, "train", 3600)
        await schedules.add(pool, schedules.Schedule("nightly-<b>eval</b>", "0 3 * * *", "eval"), by="bob")
        read_only, admin = await _admin_headers(srv.port, READ), await _admin_headers(srv.port)
        status, _, body = await request(srv.port, "GET", "/ui/controls", read_only)
        assert status == 200
        assert 'data-kind="render"' in body and "alice" in body
        assert 'data-limit="kind:train"' in body and "0 / 4" in body and "3600" in body
        assert "nightly-&lt;b&gt;eval&lt;/b&gt;" in body and "<code>0 3 * * *</code>" in body
        assert "Remove" not in body  # read-only: no actions
        remove = "/ui/schedules/remove?name=nightly-%3Cb%3Eeval%3C%2Fb%3E"
        assert (await request(srv.port, "POST", remove, read_only))[0] == 403
        assert (await request(srv.port, "POST", remove, admin))[0] == 204
        assert await schedules.listing(pool) == []
        assert (await request(srv.port, "POST", remove, admin))[0] == 404
        _, _, body = await request(srv.port, "GET", "/ui/controls", admin)
        assert "none (gpuq schedule add)" in body and "Resume" in body
        async with connect(f"ws://127.0.0.1:{srv.port}/ui/live?page=controls", origin=origin(srv.port)["Origin"],
                           additional_headers={"Cookie": admin["Cookie"]}) as ws:
            assert 'data-kind="render"' in await ws.recv()
            await admin_api.resume(pool, "render")
            with anyio.fail_after(5):
                assert "none (gpuq pause KIND)" in await ws.recv()


async def test_an_admin_sets_limits_timeouts_and_schedules_with_the_clis_rules(dsn, pool):
    from gpuq import admin as admin_api
    from gpuq import schedules

    async with running_server(dsn, **UI) as srv:
        read_only, admin = await _admin_headers(srv.port, READ), await _admin_headers(srv.port)
        assert (await request(srv.port, "POST", "/ui/limits/set?scope=kind&name=train&max=2", read_only))[0] == 403
        status, _, body = await request(srv.port, "POST", "/ui/limits/set?scope=kind&name=train&max=2", admin)
        assert (status, body) == (200, "kind train: at most 2 at once")
        assert [(lim["scope"], lim["name"], lim["max_running"]) for lim in await admin_api.limits(pool)] == [
            ("kind", "train", 2)]
        status, _, body = await request(srv.port, "POST", "/ui/limits/set?scope=kind&name=train&max=", admin)
        assert body == "kind train: no limit" and await admin_api.limits(pool) == []
        for bad, says in (("/ui/limits/set?scope=team&name=x&max=1", "per kind or per key"),
                          ("/ui/limits/set?scope=kind&name=train&max=two", "whole number"),
                          ("/ui/timeouts/set?kind=train&seconds=0", "at least 1 second"),
                          ("/ui/schedules/add?name=n&cron=every+day&kind=eval", "bad cron"),
                          ("/ui/schedules/add?name=n&cron=0+3+*+*+*&kind=eval&payload=%7Bnope", "not JSON")):
            status, _, body = await request(srv.port, "POST", bad, admin)
            assert status == 400 and says in body, (bad, body)
        status, _, body = await request(srv.port, "POST", "/ui/timeouts/set?kind=train&seconds=600", admin)
        assert body == "train: 600 s" and await admin_api.kind_timeouts(pool) == {"train": 600}
        add = "/ui/schedules/add?name=nightly&cron=0+3+*+*+*&kind=eval&payload=%7B%22split%22%3A+%22val%22%7D"
        status, _, body = await request(srv.port, "POST", add + "&priority=5", admin)
        assert status == 200 and body.startswith("nightly: first run at ") and body.endswith("03:00:00 UTC")
        [s] = await schedules.listing(pool)
        assert (s["kind"], s["payload"], s["priority"], s["created_by"]) == ("eval", {"split": "val"}, 5, "dashboard")
        status, _, body = await request(srv.port, "POST", add, admin)
        assert status == 400 and "exists" in body


async def test_the_overview_says_when_its_counts_were_read(dsn):
    from datetime import UTC, datetime

    async with running_server(dsn, **UI) as srv:
        _, _, body = await request(srv.port, "GET", "/ui", {"Cookie": await login(srv.port, READ)})
        shown = body.split('id="read-at">counts as of ', 1)[1].split(" UTC<", 1)[0]
        at = datetime.strptime(shown, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
        assert abs((datetime.now(UTC) - at).total_seconds()) < 5



async def _batching(pool) -> list[tuple]:
    from gpuq import admin as admin_api

    return [(p["kind"], p["max_items"], p["max_wait_ms"], p["max_cost"]) for p in await admin_api.batching(pool)]


async def test_the_controls_page_lists_batching_policies_and_a_read_only_session_cannot_change_them(dsn, pool):
    from gpuq import admin as admin_api

    async with running_server(dsn, **UI) as srv:
        await admin_api.set_batching(pool, "score", 8, max_cost=4096)  # as `gpuq batch` sets them
        await admin_api.set_batching(pool, "embed", 64, max_wait_ms=10)
        read_only = await _admin_headers(srv.port, READ)
        status, _, body = await request(srv.port, "GET", "/ui/controls", read_only)
        assert status == 200 and body.index('data-batching="embed"') < body.index('data-batching="score"')
        row = body.split('<tr data-batching="score">', 1)[1].split("</tr>", 1)[0]
        assert ">8</td>" in row and ">0 ms</td>" in row and ">4096</td>" in row
        row = body.split('<tr data-batching="embed">', 1)[1].split("</tr>", 1)[0]
        assert ">64</td>" in row and ">10 ms</td>" in row and ">–</td>" in row
        assert "/ui/batching/remove" not in body and 'id="batching-form"' not in body  # read-only: no actions
        for refused in ("/ui/batching/set?kind=embed&max_items=2", "/ui/batching/remove?kind=score"):
            assert (await request(srv.port, "POST", refused, read_only))[0] == 403
        assert await _batching(pool) == [("embed", 64, 10, None), ("score", 8, 0, 4096)]


async def test_an_admin_sets_replaces_and_removes_a_batching_policy_with_the_clis_checks(dsn, pool):
    from structlog.testing import capture_logs

    async with running_server(dsn, **UI) as srv:
        admin = await _admin_headers(srv.port)
        with capture_logs() as logged:
            status, _, body = await request(
                srv.port, "POST", "/ui/batching/set?kind=embed&max_items=64&max_wait_ms=10&max_cost=8192", admin)
            assert (status, body) == (200, "embed: at most 64 a batch, a partial one after 10 ms, cost <= 8192")
            status, _, body = await request(srv.port, "POST", "/ui/batching/set?kind=embed&max_items=32"
                                                              "&max_wait_ms=&max_cost=", admin)  # blank fields
            assert (status, body) == (200, "embed: at most 32 a batch, a partial one at once")
            assert await _batching(pool) == [("embed", 32, 0, None)]  # replaced whole
            for bad, says in (("kind=embed&max_items=0", "max_items must be 1-4096"),
                              ("kind=embed&max_items=4097", "max_items must be 1-4096"),
                              ("kind=embed&max_items=", "give max_items"),
                              ("kind=embed&max_items=many", "max_items must be a whole number"),
                              ("kind=embed&max_items=4&max_wait_ms=3600001", "max_wait_ms must be 0-3600000"),
                              ("kind=embed&max_items=4&max_wait_ms=-1", "max_wait_ms must be 0-3600000"),
                              ("kind=embed&max_items=4&max_cost=0", "max_cost must be a positive whole number"),
                              ("kind=embed&max_items=4&max_cost=" + "9" * 30, "max_cost must be a positive"),
                              ("kind=bad%20kind&max_items=4", "bad job kind")):
                status, _, body = await request(srv.port, "POST", "/ui/batching/set?" + bad, admin)
                assert status == 400 and says in body, (bad, status, body)
            status, _, body = await request(srv.port, "POST", "/ui/batching/remove?kind=bad%20kind", admin)
            assert status == 400 and "bad job kind" in body
            assert await _batching(pool) == [("embed", 32, 0, None)]
            _, _, body = await request(srv.port, "GET", "/ui/controls", admin)
            assert 'hx-post="/ui/batching/remove?kind=embed"' in body and 'id="batching-form"' in body
            assert (await request(srv.port, "POST", "/ui/batching/remove?kind=embed", admin))[0] == 204
            assert await _batching(pool) == []
            _, _, body = await request(srv.port, "GET", "/ui/controls", admin)
            assert 'data-batching="embed"' not in body and "none (gpuq batch KIND --max-items N)" in body
        assert [(e["action"], e["kind"]) for e in logged if e["event"] == "ui.action"] == [
            ("set_batching", "embed"), ("set_batching", "embed"), ("remove_batching", "embed")]


async def test_the_controls_page_lists_tenants_weights_and_a_read_only_session_cannot_change_them(dsn, pool):
    from gpuq import admin as admin_api

    async with running_server(dsn, **UI) as srv:
        await admin_api.set_tenant(pool, "acme", 3)  # as `gpuq tenant set` sets them
        await pool.execute("INSERT INTO gpuq.jobs (kind, tenant) VALUES ('train', 'acme'), ('train', 'beta')")
        beta = await pool.fetchval("SELECT id FROM gpuq.jobs WHERE tenant = 'beta'")
        read_only = await _admin_headers(srv.port, READ)
        _, _, body = await request(srv.port, "GET", "/ui/controls", read_only)
        assert body.index('data-tenant="acme"') < body.index('data-tenant="beta"')
        row = body.split('<tr data-tenant="acme">', 1)[1].split("</tr>", 1)[0]
        assert '<td class="n">3</td>' in row and "75.0%" in row  # its weight's share, against beta's 1
        row = body.split('<tr data-tenant="beta">', 1)[1].split("</tr>", 1)[0]
        assert "1 (default)" in row and "25.0%" in row and '<td class="n">1</td>\n        <td></td>' in row
        assert "/ui/tenants/remove" not in body and 'id="tenant-form"' not in body  # read-only: no actions
        for refused in ("/ui/tenants/set?name=acme&weight=2", "/ui/tenants/remove?name=acme"):
            assert (await request(srv.port, "POST", refused, read_only))[0] == 403
        assert await admin_api.tenant_weights(pool) == {"acme": 3.0}
        _, _, body = await request(srv.port, "GET", "/ui", read_only)  # the overview's panel
        assert 'id="tenant-usage"' in body and 'data-tenant="beta"' in body
        _, _, body = await request(srv.port, "GET", f"/ui/jobs/{beta}", read_only)
        assert '<dd id="job-tenant">beta</dd>' in body


async def test_an_admin_sets_and_removes_a_tenants_weight_with_the_clis_checks(dsn, pool):
    from structlog.testing import capture_logs

    from gpuq import admin as admin_api

    async with running_server(dsn, **UI) as srv:
        admin = await _admin_headers(srv.port)
        _, _, body = await request(srv.port, "GET", "/ui/controls", admin)
        assert "fair share off: no tenant has a weight" in body and "halved every 3600 s" in body
        with capture_logs() as logged:
            status, _, body = await request(srv.port, "POST", "/ui/tenants/set?name=acme&weight=2.5", admin)
            assert (status, body) == (200, "acme: weight 2.5")
            status, _, body = await request(srv.port, "POST", "/ui/tenants/set?name=acme&weight=4", admin)
            assert (status, body) == (200, "acme: weight 4")
            for bad, says in (("name=acme&weight=0", "a weight must be more than 0"),
                              ("name=acme&weight=-2", "a weight must be more than 0"),
                              ("name=acme&weight=nan", "a weight must be more than 0"),
                              ("name=acme&weight=", "give a weight"),
                              ("name=acme&weight=lots", "weight must be a number"),
                              ("name=a%20b&weight=1", "bad tenant")):
                status, _, body = await request(srv.port, "POST", "/ui/tenants/set?" + bad, admin)
                assert status == 400 and says in body, (bad, status, body)
            assert await admin_api.tenant_weights(pool) == {"acme": 4.0}
            _, _, body = await request(srv.port, "GET", "/ui/controls", admin)
            assert 'hx-post="/ui/tenants/remove?name=acme"' in body and 'id="tenant-form"' in body
            assert (await request(srv.port, "POST", "/ui/tenants/remove?name=acme", admin))[0] == 204
            assert await admin_api.tenant_weights(pool) == {}
        assert [(e["action"], e["tenant"]) for e in logged if e["event"] == "ui.action"] == [
            ("set_tenant", "acme"), ("set_tenant", "acme"), ("remove_tenant", "acme")]


async def test_an_admin_preempts_a_running_job_from_its_page(dsn, pool):
    import asyncio

    from gpuq import enqueue
    from gpuq.agent import JobPreempted, on_preempt
    from tests.helpers import wait_status

    runs: list[int] = []

    async def handle(job):
        runs.append(job.id)
        if len(runs) > 1:
            return "resumed"
        asked = asyncio.Event()
        on_preempt(job, asked.set)
        await asked.wait()
        raise JobPreempted

    async with running_server(dsn, **UI) as srv:
        await srv.agent(["train"], 1, handle, "box-1")
        job_id = await enqueue(pool, "train", {}, preemptible=True, grace_seconds=60)
        await wait_status(pool, job_id, "leased")
        read_only, admin = await _admin_headers(srv.port, READ), await _admin_headers(srv.port)
        _, _, body = await request(srv.port, "GET", f"/ui/jobs/{job_id}", admin)
        assert 'id="preempt"' in body and "60 s grace" in body
        _, _, body = await request(srv.port, "GET", f"/ui/jobs/{job_id}", read_only)
        assert 'id="preempt"' not in body
        assert (await request(srv.port, "POST", f"/ui/jobs/preempt?id={job_id}", read_only))[0] == 403
        assert (await request(srv.port, "POST", f"/ui/jobs/preempt?id={job_id}", admin))[0] == 204
        await wait_status(pool, job_id, "done")
        assert runs == [job_id, job_id]
        assert (await request(srv.port, "POST", f"/ui/jobs/preempt?id={job_id}", admin))[0] == 409
