"""Recovery: a killed server, a restarted PostgreSQL. Nothing an agent reported is lost."""

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
