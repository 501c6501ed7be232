"""A database host that stops answering without closing its sockets (issue #29): a partition,
a frozen VM, a hung proxy. ``TcpProxy.black_hole()`` plays it; only timeouts on our side end
the waits. Bounds below are generous upper bounds that prove "does not hang"."""

import socket
from urllib.parse import urlsplit

import anyio
import pytest

import gpuq
from gpuq import db, queue
from gpuq.sql import queries
from gpuq.tcpproxy import TcpProxy
from tests.helpers import add_pending, wait_for

FAST = {"GPUQ_CONNECT_TIMEOUT": "1", "GPUQ_COMMAND_TIMEOUT": "1"}


@pytest.fixture
def fast_timeouts(monkeypatch):
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def proxy(server_dsn):
    with TcpProxy(urlsplit(server_dsn).port) as p:
        yield p


def via(dsn: str, *ports: int, attrs: bool = True) -> str:
    """``dsn`` with its host list replaced by these ports on 127.0.0.1 (a multi-host DSN)."""
    parts = urlsplit(dsn)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    netloc = (parts.netloc.rpartition("@")[0] + "@" if "@" in parts.netloc else "") + hosts
    query = "&".join(q for q in (parts.query, "target_session_attrs=read-write" if attrs else "") if q)
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def port_of(conn) -> int:
    return conn._addr[1]


async def test_a_multi_host_dsn_reaches_the_next_host_when_the_first_is_a_black_hole(dsn, proxy, fast_timeouts):
    """asyncpg's connect timeout covers every host together: the black-holed first one spent it
    all (60 s) and the second was never tried. Each host gets GPUQ_CONNECT_TIMEOUT."""
    real = urlsplit(dsn).port
    both = via(dsn, proxy.port, real)
    proxy.black_hole()
    with anyio.fail_after(15):
        conn = await db.connect(both)
        assert port_of(conn) == real and await conn.fetchval("SELECT 1") == 1
        await conn.close()
        async with await db.create_pool(both, min_size=2, max_size=2) as pool, pool.acquire() as c:
            assert port_of(c) == real


async def test_a_statement_on_a_hung_host_times_out_and_its_pool_connections_are_dropped(dsn, proxy, fast_timeouts):
    """GPUQ_COMMAND_TIMEOUT ends the statement; its connection is terminated (asyncpg's
    CancelRequest would hang on the same host, and the release with it), and so are the pool's
    idle connections to that host: the next statement goes to a live one at once."""
    real = urlsplit(dsn).port
    async with await db.create_pool(via(dsn, proxy.port, real), min_size=3, max_size=3) as pool:
        async with pool.acquire() as c:
            assert port_of(c) == proxy.port  # the first host answered, so far
        proxy.black_hole()
        with anyio.fail_after(4), pytest.raises(TimeoutError):
            await pool.fetchval("SELECT 1")  # one command timeout, not one more for the cancel
        with anyio.fail_after(8):
            async with pool.acquire() as c:
                assert port_of(c) == real and await c.fetchval("SELECT 1") == 1


async def test_after_a_statement_timed_out_on_a_host_new_connections_try_it_last(dsn, proxy, fast_timeouts):
    """The old primary of a failover hangs: each new connection that tried it first (it was the
    last good host) spent a connect timeout there. A host whose statement timed out is a suspect
    for a while: new connections go to the others first and never reach it."""
    real = urlsplit(dsn).port
    both = via(dsn, proxy.port, real)
    async with await db.create_pool(both, min_size=1, max_size=1) as pool:
        assert await pool.fetchval("SELECT inet_server_port()") is not None  # through the proxy
        proxy.black_hole()
        with anyio.fail_after(4), pytest.raises(TimeoutError):
            await pool.fetchval("SELECT 1")
        tried = proxy.accepted
        with anyio.fail_after(8):
            conn = await db.connect(both)
        assert port_of(conn) == real and proxy.accepted == tried
        await conn.close()


async def test_database_sockets_keep_alive_direct_and_through_a_pooler(dsn):
    """Keepalives are socket options: nothing is sent to the server, so PgBouncer is unaffected."""
    for pooler in (False, True):
        conn = await db.connect(dsn, pooler=pooler)
        inner = conn.inner if isinstance(conn, db.Guarded) else conn
        try:
            sock = inner._transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == db.KEEPALIVE_IDLE_SECONDS
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == db.TCP_USER_TIMEOUT_SECONDS * 1000
            assert await conn.fetchval("SELECT 1") == 1
        finally:
            await conn.close()


async def test_a_waiter_on_a_hung_host_connects_to_the_next_and_gets_the_result(dsn, pool, live_conn, proxy,
                                                                                 fast_timeouts, monkeypatch):
    """A waiter's LISTEN connection hears nothing from a hung host: it is probed, dropped, and
    the wait goes on on the next host (it once waited out its whole timeout)."""
    monkeypatch.setattr("gpuq.producer.LISTEN_PROBE_SECONDS", 0.5, raising=False)
    [job_id] = await add_pending(live_conn, 1)
    [leased] = (await queue.lease(live_conn, ["train"], 1, "a#1", 30)).jobs
    got = []

    async def waiter():
        got.append(await gpuq.wait(via(dsn, proxy.port, urlsplit(dsn).port), job_id, timeout=60))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await _waiting(pool)
        proxy.black_hole()
        await queue.complete_many(pool, [(job_id, leased.lease_token, {"ok": 1})])
        await wait_for(lambda: got, timeout=20)
    assert got == [{"ok": 1}]


async def test_a_waiter_timing_out_on_a_hung_host_returns_its_unlisten_does_not_hang(dsn, pool, live_conn, proxy,
                                                                                      fast_timeouts):
    [job_id] = await add_pending(live_conn, 1)

    async def black_hole_once_listening():
        await _waiting(pool)
        proxy.black_hole()

    async with anyio.create_task_group() as tg:
        tg.start_soon(black_hole_once_listening)
        with anyio.fail_after(15), pytest.raises(gpuq.WaitTimeout):
            await gpuq.wait(via(dsn, proxy.port, attrs=False), job_id, timeout=2)


async def _waiting(pool) -> None:
    """Until a waiter waits: it LISTENed, then read its job, and idles."""
    async def idle_after_reading() -> bool:
        return await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' AND query = $1",
                                   queries["job_outcome"]) >= 1

    await wait_for(idle_after_reading)


async def test_a_server_on_a_multi_host_dsn_goes_on_when_its_first_host_hangs(dsn, pool, proxy, fast_timeouts):
    """The first host stops answering and closes nothing: the dispatcher's statements time out,
    their connections are dropped, LISTEN is probed and moves, new connections reach the second
    host; jobs enqueued afterwards are done, and a waiter from before gets its result."""
    from gpuq.dispatcher.tuning import Tuning
    from gpuq.harness import http_get, running_server
    from tests.helpers import wait_count

    async def handle(job):
        return {"i": job.payload["i"]}

    async def healthy() -> bool:
        return (await http_get(srv.http + "/healthz"))[0] == 200

    both = via(dsn, proxy.port, urlsplit(dsn).port)
    got = []
    async with running_server(both, tuning=Tuning(listen_probe_seconds=0.5)) as srv:
        await wait_for(healthy)
        [before] = await add_pending(pool, 1, kind="late")

        async def waiter():
            got.append(await gpuq.wait(both, before, timeout=60))

        srv.tg.start_soon(waiter)
        await _waiting(pool)
        proxy.black_hole()
        await srv.agent(["train", "late"], 4, handle)
        await add_pending(pool, 20)
        await wait_count(pool, "done", 21, timeout=30)  # generous: no stall
        await wait_for(lambda: got, timeout=10)
        await wait_for(healthy, timeout=10)  # listening again, on the second host
    assert got == [{"i": 1}]
