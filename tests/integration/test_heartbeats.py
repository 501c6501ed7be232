"""Heartbeats, written in the background: each agent's own, for its own jobs."""

import json

import anyio

from gpuq import admin, queue
from gpuq.harness import raw_agent_with_jobs, running_server, server_config
from tests.helpers import add_pending, wait_for


def session(name: str):
    """An agent session of capacity 2 for 'train', and the frames it was sent."""
    from gpuq.dispatcher import AgentSession
    from gpuq.protocol import Hello, encode
    from gpuq.protocol.server_side import ServerProtocol

    proto = ServerProtocol(max_payload=1 << 20, max_messages_per_second=100, now=0.0)
    proto.receive(encode(Hello(name, ("train",), 2)), 0.0)
    sent: list[dict] = []
    s = AgentSession(proto, flush=lambda: sent.extend(json.loads(f) for f in proto.frames_to_send()), id=f"{name}#1")
    return s, sent


async def test_a_late_heartbeat_cancels_only_its_own_agents_jobs(pool):
    """Agent a heartbeats a job that has since gone to agent b (a left, or its lease was
    reclaimed): b must not be told to cancel it, or the job would end dead. A job of b's own
    that was cancelled is cancelled on b."""
    from gpuq.dispatcher import Dispatcher

    async with pool.acquire() as conn:
        await add_pending(conn, 2)
    d = Dispatcher(pool, server_config("unused"))
    a, a_sent = session("a")
    b, b_sent = session("b")
    d.sessions.add(a)
    d.sessions.add(b)
    moved, gone = (await queue.lease(pool, ["train"], 2, b.id, 30.0)).jobs
    b.protocol.send_jobs([moved, gone])
    b.flush()
    await admin.cancel(pool, gone.id)  # b's other lease is gone
    async with anyio.create_task_group() as tg:
        tg.start_soon(d.heartbeats.run)
        d.heartbeat(a, (moved.id,))  # a's, from before the job moved
        d.heartbeat(b, (gone.id,))
        await wait_for(lambda: any(m["type"] == "cancel" for m in b_sent), timeout=5)
        await wait_for(lambda: not d.heartbeats._queued and not d.heartbeats._writing, timeout=5)
        tg.cancel_scope.cancel()
    cancels = [m for m in b_sent if m["type"] == "cancel"]
    assert [m["ids"] for m in cancels] == [[gone.id]] and not a_sent


async def test_a_heartbeat_held_up_by_a_locked_row_holds_up_no_other_agent(dsn, pool):
    """One agent's heartbeat waits on a row lock; another agent's is written meanwhile (when one
    task wrote them all in turn, every lease on the server could expire behind one lock)."""
    async with running_server(dsn) as srv:
        ws_a, [held] = await raw_agent_with_jobs(srv, pool, 1)
        ws_b, [free] = await raw_agent_with_jobs(srv, pool, 1)
        expiry = "SELECT lease_expires_at FROM gpuq.jobs WHERE id = $1"
        before = await pool.fetchval(expiry, free["id"])
        async with pool.acquire() as holder, holder.transaction():
            await holder.execute("SELECT 1 FROM gpuq.jobs WHERE id = $1 FOR UPDATE", held["id"])
            await ws_a.send(json.dumps({"type": "heartbeat", "ids": [held["id"]]}))
            await wait_for(lambda: pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"), timeout=5)
            await ws_b.send(json.dumps({"type": "heartbeat", "ids": [free["id"]]}))

            async def extended() -> bool:
                return await pool.fetchval(expiry, free["id"]) > before

            await wait_for(extended, timeout=5)
        await ws_a.close()
        await ws_b.close()
