"""Recovery: a killed server, a restarted PostgreSQL. Nothing an agent reported is lost."""

import json
import os
import signal
import subprocess
import sys
import time

import anyio
import pytest

from gpuq.agent import Agent
from gpuq.devdb import free_port
from gpuq.harness import running_server
from tests.helpers import wait_for, wait_status


def _serve(dsn, port):
    env = {**os.environ, "DATABASE_URL": dsn, "GPUQ_TOKENS": "tok", "GPUQ_LISTEN": f"127.0.0.1:{port}",
           "GPUQ_LOG_FORMAT": "json", "GPUQ_LEASE_SECONDS": "120"}
    return subprocess.Popen([sys.executable, "-m", "gpuq.cli", "serve"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_result_of_a_job_survives_a_killed_server_and_is_resent(dsn, pool):
    port = free_port()
    proc = _serve(dsn, port)
    runs = []
    release = anyio.Event()

    async def handle(job):
        runs.append(job.id)
        await release.wait()
        return {"token": job.lease_token}

    agent = Agent(f"ws://127.0.0.1:{port}/agent", "tok", ["r"], 1, handle, "survivor",
                  reconnect_min=0.1, reconnect_max=0.3)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.run)
            jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('r') RETURNING id")
            await wait_status(pool, jid, "leased")
            await wait_for(lambda: runs)
            proc.send_signal(signal.SIGKILL)  # no drain, no release: the lease stays
            proc.wait(10)
            release.set()  # the job finishes while no server is there
            await wait_for(lambda: jid in agent.protocol.unacked)  # its outcome, held for the next connection
            assert await pool.fetchval("SELECT status::text FROM gpuq.jobs WHERE id = $1", jid) == "leased"
            proc = _serve(dsn, port)
            await wait_status(pool, jid, "done")  # resent after reconnect, accepted by its token
            agent.stop()
    finally:
        proc.kill()
        proc.wait(10)
    row = await pool.fetchrow("SELECT result, attempts, lease_token FROM gpuq.jobs WHERE id = $1", jid)
    assert row["attempts"] == 1 and runs == [jid]  # not executed again
    assert row["result"] == {"token": str(row["lease_token"])}


async def test_a_sync_slot_starts_no_ready_job_once_its_connection_is_gone(dsn, pool):
    """A sync handler's slot runs its jobs in one thread, which nothing can stop. When its
    connection drops while a job runs, the slot ends with that job: after a reconnect, the new
    connection's ready jobs belong to its own slots, not to the old thread."""
    import threading

    port = free_port()
    proc = _serve(dsn, port)
    threads: dict[int, int] = {}
    gates = {"r": threading.Event(), "s": threading.Event()}

    def handle(job):
        threads[job.id] = threading.get_ident()
        gates[job.kind].wait(10)
        return job.id

    agent = Agent(f"ws://127.0.0.1:{port}/agent", "tok", ["r", "s"], 1, handle, "sync-slot", prefetch=1,
                  reconnect_min=0.1, reconnect_max=0.3)

    async def started(*ids: int) -> None:
        await wait_for(lambda: all(i in threads for i in ids))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.run)
            first = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('r') RETURNING id")
            await started(first)
            proc.send_signal(signal.SIGKILL)  # the first job's thread runs on
            proc.wait(10)
            proc = _serve(dsn, port)
            third, fourth = [r[0] for r in await pool.fetch(
                "INSERT INTO gpuq.jobs (kind) VALUES ('s'), ('s') RETURNING id")]
            await started(third)  # on the new connection; the fourth waits ready
            await wait_status(pool, fourth, "leased")
            gates["r"].set()  # the old slot's job ends: it must not take the fourth
            # Its outcome, sent on the new connection: the old slot's thread sends it (wakes the loop)
            # only once it decided to end, or, wrongly, to start the fourth at once, in that thread.
            await wait_status(pool, first, "done")
            assert fourth not in threads
            gates["s"].set()
            await wait_status(pool, fourth, "done")
            agent.stop()
            tg.cancel_scope.cancel()
    finally:
        gates["r"].set()
        gates["s"].set()
        proc.kill()
        proc.wait(10)
    assert threads[fourth] == threads[third] != threads[first]  # the fourth ran in the third's slot


async def test_server_rides_out_a_postgres_crash_restart(dsn, pool, cluster):
    if cluster is None:
        pytest.skip("needs the embedded cluster (DATABASE_URL is set)")
    release = anyio.Event()
    seen = []

    async def handle(job):
        seen.append(job.id)
        if job.payload.get("wait"):
            await release.wait()
        return "ok"

    async with running_server(dsn, lease_seconds=120) as srv:
        await srv.agent(["pg"], 2, handle)
        jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind, payload) VALUES ('pg', '{\"wait\": true}') RETURNING id")
        await wait_for(lambda: jid in seen)
        await anyio.to_thread.run_sync(cluster.restart, "immediate")  # a crash, then recovery
        release.set()  # the result arrives while the pool's connections are broken
        await pool.expire_connections()

        async def done() -> bool:
            try:
                return await pool.fetchval("SELECT status::text FROM gpuq.jobs WHERE id = $1", jid) == "done"
            except Exception:  # noqa: BLE001 - the test's own pool reconnecting
                return False

        await wait_for(done, timeout=30, interval=0.1)
        # New work still flows: the LISTEN connection came back by itself.
        t0 = time.monotonic()
        new = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('pg') RETURNING id")
        await wait_status(pool, new, "done")
        assert time.monotonic() - t0 < 20


async def test_an_agent_stopped_while_its_server_is_gone_retries_with_backoff_and_ends_by_its_deadline(dsn, pool):
    """The server dies (frozen, then killed) with an outcome unacked; in its place something accepts and hangs up
    (a proxy whose backend is gone). Told to stop within 1 s, the agent keeps its outcome, tries
    again with its backoff (it once spun: about 1,100 reconnects a second, and never exited), then
    returns by its deadline."""
    port = free_port()
    proc = _serve(dsn, port)
    started, release, finished = anyio.Event(), anyio.Event(), anyio.Event()
    attempts: list[float] = []

    async def handle(job):
        started.set()
        await release.wait()
        return {"ok": True}

    async def hang_up(stream):
        attempts.append(time.monotonic())
        await stream.aclose()

    agent = Agent(f"ws://127.0.0.1:{port}/agent", "tok", ["train"], 1, handle, "stopper",
                  reconnect_min=0.05, reconnect_max=0.4)

    async def run_agent():
        await agent.run()
        finished.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_agent)
            with anyio.fail_after(20):
                await agent.connected.wait()
            await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('train')")
            with anyio.fail_after(10):
                await started.wait()
            proc.send_signal(signal.SIGSTOP)  # frozen: the outcome goes out and is never acked
            release.set()
            await wait_for(lambda: agent.protocol.unacked, timeout=5)
            proc.kill()
            proc.wait()
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
            tg.start_soon(listener.serve, hang_up)
            await wait_for(lambda: attempts, timeout=5)  # the agent saw the connection go
            stopped_at = time.monotonic()
            agent.stop(deadline_seconds=1.0)
            with anyio.fail_after(5):
                await finished.wait()
            assert time.monotonic() - stopped_at < 2.0
            tries = [t for t in attempts if t >= stopped_at]
            assert 1 <= len(tries) <= 10, len(tries)  # a backoff from 50 ms doubling to 400 ms: about 5
            assert agent.protocol.unacked  # kept, and logged as unreported; never marked done here
            tg.cancel_scope.cancel()
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_a_window_with_no_writable_host_is_waited_out_not_a_crash(dsn, live_conn):
    """``target_session_attrs=read-write`` while every new session is read-only (a fence with
    ``default_transaction_read_only``, as in a switchover): serve's reconnects find no host to
    use. asyncpg says so with an error of its own, which once ended ``gpuq serve``; now serve
    waits it out, /healthz says 503 meanwhile, and jobs run once a writable host is back."""
    from gpuq.harness import http_get

    database = await live_conn.fetchval("SELECT current_database()")
    writable = dsn + ("&" if "?" in dsn else "?") + "target_session_attrs=read-write"
    done = anyio.Event()

    async def handle(job):
        done.set()

    async with running_server(writable) as srv:
        await srv.agent(["train"], 1, handle)
        await live_conn.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
        try:
            await live_conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                    "WHERE datname = current_database() AND pid <> pg_backend_pid()")

            async def unhealthy() -> bool:
                return (await http_get(srv.http + "/healthz"))[0] == 503

            await wait_for(unhealthy, timeout=10)  # LISTEN lost, and reconnecting finds no host
        finally:
            await live_conn.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        await live_conn.execute("INSERT INTO gpuq.jobs (kind) VALUES ('train')")
        with anyio.fail_after(15):
            await done.wait()


async def test_gpuq_agent_drain_seconds_bounds_a_stop(dsn, pool):
    """``gpuq agent --drain-seconds``: on SIGTERM with a 60 s job running it exits by then, and
    says what it leaves (the server gives the job back when the connection ends)."""
    from gpuq.harness import TOKEN

    async with running_server(dsn) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuq.cli", "agent", "--url", srv.url, "--token", TOKEN, "--kinds", "slow",
             "--handler", "gpuq.demo:handle", "--drain-seconds", "0.5", "--log-format", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            [job] = [r["id"] for r in await pool.fetch(
                """INSERT INTO gpuq.jobs (kind, payload) VALUES ('slow', '{"seconds": 60}') RETURNING id""")]
            await wait_for(lambda: pool.fetchval(
                "SELECT started_at IS NOT NULL FROM gpuq.jobs WHERE id = $1", job), timeout=20)
            stopped_at = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(lambda: proc.wait(10)) == 0
            assert time.monotonic() - stopped_at < 5  # not the job's 60 s
            unreported = [json.loads(line) for line in proc.stdout.read().splitlines() if "agent.unreported" in line]
            assert unreported and unreported[0]["running"] == [job]
        finally:
            if proc.poll() is None:
                proc.kill()


async def test_a_stop_ends_in_time_while_the_database_holds_the_outcomes_up(dsn, pool):
    """SIGTERM while the outcome of a finished job cannot be written (its row is locked, as by a
    hung database): serve waits its drain deadline and a bounded while for the database, then
    returns; the job's lease expires and the sweeper gives it back. It once waited for ever."""
    from gpuq.dispatcher import Tuning

    ran, go = anyio.Event(), anyio.Event()

    async def handle(job):
        ran.set()
        await go.wait()

    [job] = [r["id"] for r in await pool.fetch("INSERT INTO gpuq.jobs (kind) VALUES ('held') RETURNING id")]
    async with pool.acquire() as holder:
        tx = holder.transaction()
        await tx.start()
        try:
            with anyio.fail_after(30):  # a hang fails here, not the suite
                async with running_server(dsn, drain_seconds=0.5, tuning=Tuning(shutdown_db_seconds=0.5)) as srv:
                    agent = await srv.agent(["held"], 1, handle)
                    await wait_for(lambda: ran.is_set(), timeout=10)
                    await holder.execute("SELECT 1 FROM gpuq.jobs WHERE id = $1 FOR UPDATE", job)
                    go.set()
                    await wait_for(lambda: agent.protocol.unacked, timeout=5)  # sent: its UPDATE waits
                    agent.stop(deadline_seconds=0.5)  # it cannot be acked: the agent gives up too
                    stopping = time.monotonic()  # the context's exit is the SIGTERM
                assert time.monotonic() - stopping < 5, "the stop waited on the database"
        finally:
            await tx.rollback()
