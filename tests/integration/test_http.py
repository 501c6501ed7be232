"""/healthz, /status and /metrics over real HTTP against a running server."""

import json

from gpuq import census, db
from gpuq.db import DatabaseUnavailable
from gpuq.harness import TOKEN, http_get, running_server
from tests.helpers import wait_count, wait_for


async def test_status_counts_match_the_database(dsn, pool):
    async with running_server(dsn) as srv:
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, 7)")
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'train' FROM generate_series(1, 2)")
        await srv.agent(["other"], 2, lambda job: None, name="watcher")
        code, ctype, body = await http_get(srv.http + "/status", token=TOKEN)
        assert code == 200 and ctype == "application/json"
        status = json.loads(body)
        assert status["live"]["pending"] == {"embed": 7, "train": 2}
        assert status["totals"]["pending"] == 9
        assert status["agents_connected"] == 1
        assert status["agents"][0]["kinds"] == ["other"] and status["agents"][0]["capacity"] == 2


async def test_status_needs_an_agents_or_a_dashboards_token(dsn):
    """Behind a load balancer more than agents reach the port: /status (agents' addresses, jobs'
    progress messages) needs a token; /healthz and /metrics stay open."""
    async with running_server(dsn, ui_tokens=frozenset({"viewer"}), ui_admin_tokens=frozenset({"boss"})) as srv:
        assert (await http_get(srv.http + "/status"))[0] == 401
        assert (await http_get(srv.http + "/status", token="wrong"))[0] == 401
        for token in (TOKEN, "viewer", "boss"):
            assert (await http_get(srv.http + "/status", token=token))[0] == 200, token
        assert (await http_get(srv.http + "/healthz"))[0] == 200
        assert (await http_get(srv.http + "/metrics"))[0] == 200


def _metric(text, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_metrics_count_jobs_and_change_after_completions(dsn, pool, monkeypatch):
    monkeypatch.setattr(census, "LOAD_SHARE", 1.0)  # a read every 0.05 s, however slow this machine's reads are
    async with running_server(dsn, metrics_sample_seconds=0.05) as srv:
        _, ctype, before = await http_get(srv.http + "/metrics")
        assert ctype.startswith("text/plain")
        for name in ("gpuq_jobs_leased_total", "gpuq_jobs_completed_total", "gpuq_lease_query_seconds",
                     "gpuq_lease_batch_size", "gpuq_agents_connected", "gpuq_jobs_inflight",
                     "gpuq_queue_depth", "gpuq_jobs_reclaimed_total", "gpuq_jobs_failed_total"):
            assert f"# TYPE {name.removesuffix('_total')}" in before, name
        done_before = _metric(before, "gpuq_jobs_completed_total", kind="metered")
        await srv.agent(["metered"], 4, lambda job: "ok")
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'metered' FROM generate_series(1, 30)")
        await wait_count(pool, "done", 30, timeout=10)
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'nobody' FROM generate_series(1, 3)")
        _, _, after = await http_get(srv.http + "/metrics")
        assert _metric(after, "gpuq_jobs_completed_total", kind="metered") == done_before + 30
        assert _metric(after, "gpuq_jobs_leased_total", kind="metered") >= 30
        assert _metric(after, "gpuq_agents_connected") >= 1

        async def depth_is_3() -> bool:  # the census's next read (gpuq.census): the scrape reads no database
            return _metric((await http_get(srv.http + "/metrics"))[2], "gpuq_queue_depth", status="pending") == 3

        await wait_for(depth_is_3)


async def _healthz_is(srv, code: int) -> bool:
    return (await http_get(srv.http + "/healthz"))[0] == code


async def test_healthz_turns_503_while_the_listen_connection_is_down(dsn, pool, monkeypatch):
    async with running_server(dsn) as srv:
        await wait_for(lambda: _healthz_is(srv, 200), timeout=5)
        real_connect = db.connect

        async def refuse(*args, **kwargs):
            raise DatabaseUnavailable("injected: LISTEN reconnect refused")

        # Fault injection: the LISTEN connection dies and cannot come back.
        monkeypatch.setattr(db, "connect", refuse)
        await pool.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query ILIKE 'LISTEN%'")
        await wait_for(lambda: _healthz_is(srv, 503), timeout=5)
        res = await http_get(srv.http + "/healthz")
        assert json.loads(res[2]) == {"ok": False, "database": True, "listening": False, "poll_only": False, "draining": False}
        monkeypatch.setattr(db, "connect", real_connect)
        await wait_for(lambda: _healthz_is(srv, 200), timeout=10)


async def test_unknown_paths_are_404(dsn):
    async with running_server(dsn) as srv:
        assert (await http_get(srv.http + "/nope"))[0] == 404


async def test_a_job_over_http_needs_a_token(dsn, pool):
    from gpuq.harness import TOKEN

    job_id = await pool.fetchval("INSERT INTO gpuq.jobs (kind, payload) VALUES ('embed', '{\"doc\": 7}') RETURNING id")
    async with running_server(dsn) as srv:
        code, ctype, body = await http_get(f"{srv.http}/jobs/{job_id}", token=TOKEN)
        assert code == 200 and ctype == "application/json"
        job = json.loads(body)
        assert (job["id"], job["status"], job["payload"]) == (job_id, "pending", {"doc": 7})
        assert (await http_get(f"{srv.http}/jobs/{job_id}"))[0] == 401
        assert (await http_get(f"{srv.http}/jobs/{job_id}", token="wrong"))[0] == 401
        assert (await http_get(f"{srv.http}/jobs/abc", token=TOKEN))[0] == 400
        assert (await http_get(f"{srv.http}/jobs/999999", token=TOKEN))[0] == 404
