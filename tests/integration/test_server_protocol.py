"""Malformed, oversized, unknown and out-of-order frames against a live server."""

import json

import anyio
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from gpuq import protocol
from gpuq.dispatcher import Tuning
from gpuq.harness import TOKEN, next_of, raw_agent, raw_agent_with_jobs, running_server
from tests.helpers import sets

AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def _closed_with(ws, timeout=5):
    with anyio.fail_after(timeout):
        try:
            while True:
                await ws.recv()
        except ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None


# Every rule has its unit test in tests/unit/test_server_side.py; these prove the wiring.
@pytest.mark.parametrize("frame, code", [
    ("not json", protocol.ErrorCode.BAD_JSON),
    ('{"type": "heartbeat", "ids": [7]}', protocol.ErrorCode.NOT_HELD),
])
async def test_bad_frames_get_an_error_and_the_connection_goes_on(dsn, pool, frame, code):
    async with running_server(dsn) as srv:
        ws, _ = await raw_agent(srv)
        await ws.send(frame)
        err = await next_of(ws, "error")
        assert err["code"] == code and err["message"]
        # Still connected and served: a job arrives.
        jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('embed') RETURNING id")
        job = (await next_of(ws, "jobs"))["jobs"][0]
        assert job["id"] == jid
        await ws.send(json.dumps({"type": "done", "id": jid, "lease_token": job["lease_token"], "result": 1}))
        assert (await next_of(ws, "ack"))["accepted"] == [jid]
        await ws.close()


async def test_outcomes_for_jobs_never_leased_are_fenced_out(dsn, pool):
    async with running_server(dsn) as srv:
        other = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('else') RETURNING id")
        ws, _ = await raw_agent(srv)
        for msg in ({"type": "done", "id": other, "lease_token": "00000000-0000-0000-0000-000000000000",
                     "result": "forged"},
                    {"type": "failed", "id": 424242, "lease_token": "00000000-0000-0000-0000-000000000000",
                     "error": "forged", "retryable": False}):
            await ws.send(json.dumps(msg))
            ack = await next_of(ws, "ack")
            assert ack["accepted"] == [] and ack["rejected"] == [msg["id"]]
        await ws.close()
    row = await pool.fetchrow("SELECT status::text, result, last_error FROM gpuq.jobs WHERE id = $1", other)
    assert tuple(row) == ("pending", None, None)


async def test_oversized_and_binary_frames_close_with_documented_codes(dsn, pool):
    async with running_server(dsn, max_payload=4096) as srv:
        ws, welcome = await raw_agent(srv)
        assert welcome["max_payload"] == 4096
        await ws.send(json.dumps({"type": "heartbeat", "ids": [], "pad": "x" * 5000}))
        assert await _closed_with(ws) == protocol.CloseCode.TOO_BIG
        ws, _ = await raw_agent(srv)
        await ws.send(b"\x00\x01binary")
        assert await _closed_with(ws) == protocol.CloseCode.UNSUPPORTED_DATA
        # A healthy agent is still served by the same server.
        done = anyio.Event()
        await srv.agent(["embed"], 1, sets(done))
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('embed')")
        with anyio.fail_after(5):
            await done.wait()


@pytest.mark.parametrize("hello, close_code", [
    ('{"type": "heartbeat", "ids": []}', protocol.CloseCode.PROTOCOL_ERROR),
    ('{"type": "hello", "agent": "x", "kinds": ["a"], "capacity": 1, "protocol": 99}',
     protocol.CloseCode.UNSUPPORTED_VERSION),
])
async def test_a_bad_hello_closes_the_connection(dsn, hello, close_code):
    async with running_server(dsn) as srv:
        ws = await connect(srv.url, additional_headers=AUTH)
        await ws.send(hello)
        assert await _closed_with(ws) == close_code


async def test_silent_clients_are_closed_after_the_hello_timeout(dsn):
    async with running_server(dsn, tuning=Tuning(hello_timeout_seconds=0.3)) as srv:
        ws = await connect(srv.url, additional_headers=AUTH)
        assert await _closed_with(ws) == protocol.CloseCode.HELLO_TIMEOUT


async def test_message_flood_is_closed_with_4008(dsn):
    async with running_server(dsn, max_messages_per_second=20) as srv:
        ws, _ = await raw_agent(srv)
        frame = json.dumps({"type": "heartbeat", "ids": []})
        with pytest.raises(ConnectionClosed) as info:
            for _ in range(200):
                await ws.send(frame)
                await anyio.sleep(0)  # not a settle wait: yield so each frame goes out (the flood)
            await ws.recv()
        assert info.value.rcvd is not None and info.value.rcvd.code == protocol.CloseCode.RATE_LIMITED


async def _connect_when_a_slot_frees(srv, timeout=10):
    """The server frees a slot once it has seen the close; on a loaded machine that takes a while."""
    with anyio.fail_after(timeout):
        while True:
            try:
                ws, _ = await raw_agent(srv, name="three")
                return ws
            except InvalidStatus as exc:
                assert exc.response.status_code == 429
                await anyio.sleep(0.05)  # not a settle wait: the retry's interval until a slot frees


async def test_connection_limits_per_address_and_in_total(dsn):
    async with running_server(dsn, max_connections_per_ip=2) as srv:
        a, _ = await raw_agent(srv, name="one")
        b, _ = await raw_agent(srv, name="two")
        with pytest.raises(Exception) as info:
            await connect(srv.url, additional_headers=AUTH)
        assert info.value.response.status_code == 429
        await a.close()
        c = await _connect_when_a_slot_frees(srv)
        await b.close()
        await c.close()
    async with running_server(dsn, max_connections=1) as srv:
        a, _ = await raw_agent(srv)
        with pytest.raises(Exception) as info:
            await connect(srv.url, additional_headers=AUTH)
        assert info.value.response.status_code == 503
        await a.close()


async def test_a_result_postgres_cannot_store_is_refused_and_blocks_nothing(dsn, pool):
    """Found by the fuzzer: U+0000 in a result made every later batch fail."""
    async with running_server(dsn) as srv:
        ws, jobs = await raw_agent_with_jobs(srv, pool, 2)
        bad, good = jobs
        await ws.send(json.dumps({"type": "done", "id": bad["id"], "lease_token": bad["lease_token"],
                                  "result": {"text": "nul\u0000here"}}))
        assert (await next_of(ws, "error"))["code"] == protocol.ErrorCode.BAD_MESSAGE
        await ws.send(json.dumps({"type": "failed", "id": good["id"], "lease_token": good["lease_token"],
                                  "error": "oops\u0000", "retryable": False}))
        assert (await next_of(ws, "ack"))["accepted"] == [good["id"]]
        await ws.close()
    assert await pool.fetchval("SELECT last_error FROM gpuq.jobs WHERE id = $1", good["id"]) == "oops\ufffd"


async def test_one_results_frame_settles_many_jobs_and_gets_one_ack(dsn, pool):
    async with running_server(dsn) as srv:
        ws, jobs = await raw_agent_with_jobs(srv, pool, 8)
        forged = {"type": "done", "id": 10**9, "lease_token": "00000000-0000-0000-0000-000000000000",
                  "result": "forged"}
        outcomes = [{"type": "done", "id": j["id"], "lease_token": j["lease_token"], "result": {"n": j["id"]}}
                    for j in jobs[:7]]
        outcomes.append({"type": "failed", "id": jobs[7]["id"], "lease_token": jobs[7]["lease_token"],
                         "error": "bad input", "retryable": False})
        await ws.send(json.dumps({"type": "results", "results": [*outcomes, forged]}))
        ack = await next_of(ws, "ack")
        assert sorted(ack["accepted"]) == sorted(j["id"] for j in jobs) and ack["rejected"] == [10**9]
        await ws.close()
    rows = dict(await pool.fetch("SELECT id, status::text FROM gpuq.jobs"))
    assert rows == {**{j["id"]: "done" for j in jobs[:7]}, jobs[7]["id"]: "dead"}
    assert await pool.fetchval("SELECT result FROM gpuq.jobs WHERE id = $1", jobs[0]["id"]) == {"n": jobs[0]["id"]}


async def test_a_pushed_job_has_exactly_the_documented_fields(dsn, pool):
    """The pushed job splices PostgreSQL's JSON text of the payload: same fields, same values."""
    payload = {"text": "héllo \"quoted\" \\ ☃", "n": [1, 2.5, None, True], "big": 2**62}
    async with running_server(dsn) as srv:
        ws, _ = await raw_agent(srv)
        jid = await pool.fetchval("INSERT INTO gpuq.jobs (kind, payload) VALUES ('embed', $1) RETURNING id", payload)
        frame = await next_of(ws, "jobs")
        token = await pool.fetchval("SELECT lease_token::text FROM gpuq.jobs WHERE id = $1", jid)
        assert frame == {"type": "jobs", "jobs": [
            {"id": jid, "lease_token": token, "kind": "embed", "payload": payload, "attempt": 1}]}
        assert protocol.parse_server(json.dumps(frame)).jobs[0].payload == payload
        await ws.close()


async def test_a_heartbeat_the_database_holds_up_does_not_hold_up_the_connection(dsn, pool):
    """The reader hands heartbeats to the dispatcher and reads on: with the job's row locked (a
    heartbeat's UPDATE waits for it), a bad frame sent after the heartbeat still gets its error
    at once, and the lease is extended once the lock goes."""
    async with running_server(dsn) as srv:
        ws, [job] = await raw_agent_with_jobs(srv, pool, 1)
        before = await pool.fetchval("SELECT lease_expires_at FROM gpuq.jobs WHERE id = $1", job["id"])
        async with pool.acquire() as holder, holder.transaction():
            await holder.execute("SELECT 1 FROM gpuq.jobs WHERE id = $1 FOR UPDATE", job["id"])
            await ws.send(json.dumps({"type": "heartbeat", "ids": [job["id"]]}))
            await ws.send(json.dumps({"type": "no-such-frame"}))
            assert (await next_of(ws, "error"))["code"] == protocol.ErrorCode.UNKNOWN_TYPE
        with anyio.fail_after(5):
            while await pool.fetchval("SELECT lease_expires_at FROM gpuq.jobs WHERE id = $1", job["id"]) == before:
                await anyio.sleep(0.02)
        await ws.close()
