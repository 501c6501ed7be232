"""Agent-side behaviour over real connections: disconnects, fencing, failures, heartbeats, drain."""

import json

import anyio
import pytest
from websockets.asyncio.client import connect

from gpuq.agent import Agent, AuthError, PermanentError
from gpuq.harness import TOKEN, next_of, raw_agent, running_server
from tests.helpers import (
    agents_connected,
    no_agents_connected,
    status_of,
    wait_count,
    wait_for,
    wait_status,
)


async def test_killed_agent_returns_its_job_at_once_and_a_late_done_is_fenced(dsn, pool):
    async with running_server(dsn, lease_seconds=300) as srv:
        jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('embed') RETURNING id")
        ws, _ = await raw_agent(srv, name="doomed")
        pushed = (await next_of(ws, "jobs"))["jobs"][0]
        assert pushed["id"] == jid
        ws.transport.abort()  # the process died: no close handshake
        await wait_status(pool, jid, "pending", timeout=5)  # far sooner than the 300 s lease

        finished = anyio.Event()

        async def handle(job):
            finished.set()
            return {"by": "rescuer"}

        await srv.agent(["embed"], 1, handle, name="rescuer")
        with anyio.fail_after(5):
            await finished.wait()
        await wait_status(pool, jid, "done", timeout=5)

        # The dead agent's result shows up late, on a new connection: fenced out.
        ws2, _ = await raw_agent(srv, name="doomed")
        await ws2.send(json.dumps({"type": "done", "id": jid, "lease_token": pushed["lease_token"],
                                   "result": {"by": "doomed"}}))
        ack = await next_of(ws2, "ack")
        assert ack == {"type": "ack", "accepted": [], "rejected": [jid]}
        await ws2.close()
    row = await pool.fetchrow("SELECT result, attempts FROM gpuq.jobs WHERE id = $1", jid)
    assert row["result"] == {"by": "rescuer"} and row["attempts"] == 2


async def test_handler_errors_retry_and_permanent_errors_go_dead(dsn, pool):
    async def handle(job):
        if job.payload["mode"] == "permanent":
            raise PermanentError("bad input")
        if job.attempt == 1:
            raise RuntimeError("flaky GPU")
        return {"attempt": job.attempt}

    async with running_server(dsn) as srv:
        await srv.agent(["embed"], 2, handle)
        flaky = await pool.fetchval(
            "INSERT INTO gpuq.jobs (kind, payload) VALUES ('embed', '{\"mode\": \"flaky\"}') RETURNING id")
        perm = await pool.fetchval(
            "INSERT INTO gpuq.jobs (kind, payload) VALUES ('embed', '{\"mode\": \"permanent\"}') RETURNING id")

        async def settled() -> bool:
            return await status_of(pool, perm) == "dead" and await status_of(pool, flaky) == "scheduled"

        await wait_for(settled)
        error = await pool.fetchval("SELECT last_error FROM gpuq.jobs WHERE id = $1", flaky)
        assert "RuntimeError: flaky GPU" in error
        await pool.execute("UPDATE gpuq.jobs SET run_at = now() WHERE id = $1", flaky)  # skip the backoff
        # the server's sweeper promotes it; NOTIFY brings it back
        await wait_status(pool, flaky, "done", timeout=10)
    row = await pool.fetchrow("SELECT result, attempts FROM gpuq.jobs WHERE id = $1", flaky)
    assert row["result"] == {"attempt": 2} and row["attempts"] == 2
    assert "bad input" in await pool.fetchval("SELECT last_error FROM gpuq.jobs WHERE id = $1", perm)


async def test_heartbeats_keep_a_long_job_leased(dsn, pool):
    release = anyio.Event()

    async def handle(job):
        await release.wait()
        return "finished"

    async with running_server(dsn, lease_seconds=3, heartbeat_seconds=0.3, sweep_seconds=0.2) as srv:
        await srv.agent(["embed"], 1, handle)
        jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('embed') RETURNING id")
        await wait_status(pool, jid, "leased")
        first = await pool.fetchval("SELECT lease_expires_at FROM gpuq.jobs WHERE id = $1", jid)

        async def past_the_first_lease() -> bool:  # the database's clock, not a sleep
            return bool(await pool.fetchval("SELECT now() > $1::timestamptz + interval '0.5 s'", first))

        await wait_for(past_the_first_lease, timeout=15, interval=0.1)
        row = await pool.fetchrow("SELECT status::text, attempts, lease_expires_at FROM gpuq.jobs WHERE id = $1", jid)
        # Only heartbeats can have moved the expiry past the first lease's.
        assert row["status"] == "leased" and row["attempts"] == 1 and row["lease_expires_at"] > first
        release.set()
        await wait_status(pool, jid, "done", timeout=5)


async def test_sync_handlers_run_in_a_thread(dsn, pool):
    import threading
    import time

    main = threading.get_ident()
    threads = []

    def handle(job):
        threads.append(threading.get_ident())
        time.sleep(0.05)  # would block the event loop if run on it
        return job.payload

    async with running_server(dsn) as srv:
        await srv.agent(["embed"], 2, handle)
        await pool.execute("INSERT INTO gpuq.jobs (kind, payload) SELECT 'embed', to_jsonb(g) FROM generate_series(1, 4) g")
        await wait_count(pool, "done", 4, timeout=10)
    assert threads and main not in threads
    assert sorted(await pool.fetchval("SELECT array_agg(result::int) FROM gpuq.jobs")) == [1, 2, 3, 4]


async def test_agent_stop_finishes_running_jobs_first(dsn, pool):
    started = anyio.Event()

    async def handle(job):
        started.set()
        await anyio.sleep(0.5)  # not a settle wait: the job still runs when the agent is told to stop
        return "ok"

    async with running_server(dsn) as srv:
        agent = await srv.agent(["embed"], 1, handle)
        jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('embed') RETURNING id")
        with anyio.fail_after(5):
            await started.wait()
        agent.stop()
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('embed')")  # not for a stopping agent
        await wait_status(pool, jid, "done", timeout=5)
        await no_agents_connected(srv)  # the stopped agent has gone: nothing can reach it any more
        assert await pool.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'pending'") == 1
        assert agent.completed == 1


async def test_bad_token_is_refused_and_no_job_is_leased(dsn, pool):
    async with running_server(dsn) as srv:
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, 5)")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            with pytest.raises(Exception) as info:
                await connect(srv.url, additional_headers=headers)
            assert getattr(info.value, "response", None) is not None
            assert info.value.response.status_code == 401
        bad = Agent(srv.url, "wrong", ["embed"], 4, lambda job: None, "intruder")
        with pytest.raises(AuthError, match="401"):
            await bad.run()
        assert await agents_connected(srv) == []  # refused before it was an agent: nothing to lease for
        assert await pool.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status <> 'pending'") == 0


async def _against_scripted_peer(n_jobs, handle, capacity=64):
    """Run an Agent against a scripted protocol server (no database involved) that
    pushes ``n_jobs`` jobs in one frame; return the frames the agent sent back."""
    from websockets.asyncio.server import serve

    frames: list[dict] = []
    got_all = anyio.Event()

    async def peer(ws):
        hello = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "welcome", "agent_id": f"{hello['agent']}#1", "protocol": 1,
                                  "lease_seconds": 60, "heartbeat_seconds": 30, "max_payload": 1 << 20}))
        await ws.send(json.dumps({"type": "jobs", "jobs": [
            {"id": i, "lease_token": f"00000000-0000-0000-0000-{i:012d}", "kind": "embed", "payload": i,
             "attempt": 1} for i in range(1, n_jobs + 1)]}))
        seen = 0
        async for raw in ws:
            frames.append(json.loads(raw))
            seen += len(frames[-1]["results"])
            if seen == n_jobs:
                got_all.set()

    async with serve(peer, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        agent = Agent(f"ws://127.0.0.1:{port}/agent", TOKEN, ["embed"], capacity, handle, "scripted")
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.run)
            with anyio.fail_after(10):
                await got_all.wait()
            tg.cancel_scope.cancel()
    return frames


async def test_outcomes_ready_together_go_in_few_frames():
    """64 jobs pushed at once come back in a handful of results frames, not 64."""
    async def handle(job):
        return job.payload * 2

    frames = await _against_scripted_peer(64, handle)
    assert {f["type"] for f in frames} == {"results"}
    results = {o["id"]: o["result"] for f in frames for o in f["results"]}
    assert results == {i: 2 * i for i in range(1, 65)}
    assert len(frames) <= 4


async def test_jobs_of_one_push_run_concurrently_and_report_as_each_ends():
    """Job 1 waits for job 3 to start: run one after another, it would never end.
    Job 2 ends first and is reported before job 1 is."""
    started_3 = anyio.Event()

    async def handle(job):
        if job.id == 1:
            await started_3.wait()
            await anyio.sleep(0.2)  # not a settle wait: job 1 works on after 3 started, so 2 ends first
        elif job.id == 3:
            started_3.set()
            await anyio.sleep(0.2)  # likewise: job 3 works on
        return job.id

    frames = await _against_scripted_peer(3, handle)
    order = [o["id"] for f in frames for o in f["results"]]
    assert sorted(order) == [1, 2, 3] and order[0] == 2


async def test_a_result_postgres_cannot_store_fails_the_job_for_good(dsn, pool):
    async def handle(job):
        return {"text": "nul\x00here"}

    async with running_server(dsn) as srv:
        await srv.agent(["embed"], 1, handle)
        jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('embed') RETURNING id")
        await wait_status(pool, jid, "dead", timeout=10)
    row = await pool.fetchrow("SELECT attempts, last_error FROM gpuq.jobs WHERE id = $1", jid)
    assert row["attempts"] == 1 and "U+0000" in row["last_error"]


async def test_jobs_whose_connection_dropped_are_not_running_after_it_and_stop_returns():
    """An async handler is stopped with the connection that pushed its job, and the server takes
    the job back: the agent must forget it. Before, it stayed ``running`` for ever: every heartbeat
    named it and ``stop()`` without a deadline waited on it and never returned."""
    from websockets.asyncio.server import serve

    sessions: list[object] = []
    started: list[int] = []
    both_started, reconnected = anyio.Event(), anyio.Event()

    async def peer(ws):
        sessions.append(ws)
        hello = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "welcome", "agent_id": f"{hello['agent']}#{len(sessions)}",
                                  "protocol": 1, "lease_seconds": 60, "heartbeat_seconds": 30,
                                  "max_payload": 1 << 20}))
        if len(sessions) == 1:
            await ws.send(json.dumps({"type": "jobs", "jobs": [
                {"id": i, "lease_token": f"00000000-0000-0000-0000-{i:012d}", "kind": "embed", "payload": i,
                 "attempt": 1} for i in (1, 2)]}))
            await both_started.wait()
            ws.transport.abort()  # dropped: no close handshake
            return
        reconnected.set()
        async for _ in ws:
            pass

    async def handle(job):
        started.append(job.id)
        if len(started) == 2:
            both_started.set()
        await anyio.sleep(60)  # runs until its connection's end stops it

    async with serve(peer, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        agent = Agent(f"ws://127.0.0.1:{port}/agent", TOKEN, ["embed"], 4, handle, "dropped")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(agent.run)
                await reconnected.wait()
                assert sorted(started) == [1, 2]
                await wait_for(lambda: not agent.protocol.running)
                agent.stop()  # no deadline: returns once nothing runs or waits unreported
