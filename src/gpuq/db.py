"""Connections to PostgreSQL: one place that knows how to open them.

Direct connections carry the planner guards as startup parameters (one
round trip per statement). Through a transaction pooler (``GPUQ_POOLER=
transaction``) session state does not stick and PgBouncer refuses unknown
startup parameters, so pooled connections send none, keep no prepared-statement
cache, and run each statement in a transaction that sets the guards first
(``Guarded``; docs/design.md, "Behind a transaction pooler").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import anyio
import asyncpg

from gpuq import config
from gpuq.plans import PLAN_SETTINGS
from gpuq.sql import queries


class DatabaseUnavailable(RuntimeError):
    """The database cannot be reached (one clear line for the CLI)."""


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in and out as Python objects (payloads, results).
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


def pooled() -> bool:
    return bool(config.get("pooler") == "transaction")


def _session_kwargs(kwargs: dict[str, Any], is_pooled: bool) -> dict[str, Any]:
    """Startup parameters (the planner guards) for a direct connection; none and no
    statement cache for a pooled one."""
    if is_pooled:
        return {**kwargs, "statement_cache_size": 0}
    return {**kwargs, "server_settings": {**PLAN_SETTINGS, **kwargs.get("server_settings", {})}}


class Guarded:
    """A pooled Connection or Pool whose statements each run in a transaction that sets the
    planner guards first (``SET LOCAL``): through a transaction pooler nothing else sticks."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def _run(self, method: str, query: str, args: tuple[Any, ...], timeout: float | None = None) -> Any:
        async with transaction(self) as conn:
            return await getattr(conn, method)(query, *args, timeout=timeout)

    async def fetch(self, query: str, *args: Any, timeout: float | None = None) -> Any:
        return await self._run("fetch", query, args, timeout)

    async def fetchrow(self, query: str, *args: Any) -> Any:
        return await self._run("fetchrow", query, args)

    async def fetchval(self, query: str, *args: Any) -> Any:
        return await self._run("fetchval", query, args)

    async def execute(self, query: str, *args: Any) -> Any:
        return await self._run("execute", query, args)


@contextlib.asynccontextmanager
async def transaction(db: Any) -> AsyncIterator[Any]:
    """A connection of ``db`` (a Pool, a Connection, either ``Guarded``) in a transaction; pooled,
    the planner guards are set first."""
    guarded = isinstance(db, Guarded)
    inner = db.inner if guarded else db
    async with inner.acquire() if isinstance(inner, asyncpg.Pool) else contextlib.nullcontext(inner) as conn, \
            conn.transaction():
        if guarded:
            await conn.execute(queries["plan_guards"])
        yield conn


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Pool reset: asyncpg still rolls back an open transaction first.

    The default reset (RESET ALL, UNLISTEN *, CLOSE ALL, advisory unlock) is
    one more round trip on every release, for session state gpuq never leaves
    on a pooled connection (LISTEN and the migration lock use their own).
    """


async def connect(dsn: str, *, direct: bool = False, pooler: bool | None = None, **kwargs: Any) -> Any:
    """A connection; ``Guarded`` through a transaction pooler (``pooler``, default from
    ``GPUQ_POOLER``) unless ``direct``. ``command_timeout=None``: statements without a limit
    (migrations, benches building tables); the default is ``GPUQ_COMMAND_TIMEOUT``."""
    is_pooled = (pooled() if pooler is None else pooler) and not direct
    try:
        conn = await connect_hosts(dsn, **_session_kwargs(_with_timeouts(kwargs), is_pooled))
    except CONNECT_ERRORS as exc:
        raise DatabaseUnavailable(_unreachable(dsn, exc)) from None
    await _init_connection(conn)
    return Guarded(conn) if is_pooled else conn


async def create_pool(dsn: str, min_size: int = 1, max_size: int = 10, *, pooler: bool | None = None,
                      **kwargs: Any) -> Any:
    """A pool; ``Guarded`` through a transaction pooler (``pooler``, default from ``GPUQ_POOLER``)."""
    is_pooled = pooled() if pooler is None else pooler
    try:
        pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, init=_init_connection,
                                         reset=_keep_session, connect=connect_hosts, connection_class=Connection,
                                         **_session_kwargs(_with_timeouts(kwargs), is_pooled))
    except CONNECT_ERRORS as exc:
        raise DatabaseUnavailable(_unreachable(dsn, exc)) from None
    return Guarded(pool) if is_pooled else pool


def _unreachable(dsn: str, exc: BaseException) -> str:
    hint = ("; behind PgBouncer set GPUQ_POOLER=transaction (or --pooler transaction)"
            if "unsupported startup parameter" in str(exc) else "")
    return f"cannot connect to the database at {redact(dsn)}: {exc}{hint}"


def redact(dsn: str) -> str:
    """The DSN without its password, safe for logs and error lines."""
    if "@" not in dsn or "://" not in dsn:
        return dsn
    scheme, rest = dsn.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}@{host}"


# No host of a multi-host DSN is what target_session_attrs asks for (a switchover, a
# read-only fence, a balancer pointing at a standby): asyncpg raises this, not a PostgresError.
NO_TARGET_HOST = asyncpg.exceptions.TargetServerAttributeNotMatched
# What a connect turns into one DatabaseUnavailable line.
CONNECT_ERRORS: tuple[type[BaseException], ...] = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
                                                   NO_TARGET_HOST)

# What a long-running service logs and retries instead of dying on: the
# server restarting, a dropped connection, a statement failing mid-outage,
# a moment with no writable primary. A pooled connection that a failed
# reconnect left half-open raises asyncpg's own InternalClientError ("cannot
# switch to state 12; another operation is in progress"): the pool drops it.
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable, OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
)
# The connection itself is gone or unusable (a waiter reconnects on these, and only these).
CONNECTION_LOST: tuple[type[BaseException], ...] = (
    DatabaseUnavailable, OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.InternalClientError,
)


# -- hung and dead peers (docs/design.md, "Hung peers") -------------------------
# A host that stops answering without closing its sockets (a partition, a frozen VM, a
# hung proxy) is found by timeouts on our side only: its kernel may still acknowledge.

# Idle sockets: a peer that really vanished is found by keepalive probes after
# IDLE + INTERVAL * COUNT seconds, and data it never acknowledges after USER_TIMEOUT.
KEEPALIVE_IDLE_SECONDS = 10
KEEPALIVE_INTERVAL_SECONDS = 5
KEEPALIVE_COUNT = 3
TCP_USER_TIMEOUT_SECONDS = KEEPALIVE_IDLE_SECONDS + KEEPALIVE_INTERVAL_SECONDS * KEEPALIVE_COUNT
# A LISTEN connection (the dispatcher's, a waiter's) says nothing while nothing happens:
# this often it is asked something (``probe``), bounded by the command timeout.
LISTEN_PROBE_SECONDS = 5.0
# What bounds the statements that check or leave a connection (a probe, UNLISTEN, a close)
# when there is no command timeout: they must end on a hung host even then.
FALLBACK_BOUND_SECONDS = 5.0


def _timeout(name: str) -> float | None:
    value = config.get(name)
    return float(value) if value else None  # 0: no limit


def command_timeout() -> float | None:
    """``GPUQ_COMMAND_TIMEOUT`` in seconds, None for no limit."""
    return _timeout("command_timeout")


def _bound() -> float:
    """The command timeout, or FALLBACK_BOUND_SECONDS without one."""
    return command_timeout() or FALLBACK_BOUND_SECONDS


# A statement writing many rows (a bulk enqueue) is bounded by its size: this many rows a
# second, when that is longer than the command timeout.
BULK_ROWS_PER_SECOND = 2000


def bulk_timeout(rows: int) -> float | None:
    """The ``timeout=`` for a statement writing ``rows`` rows: None (the connection's command
    timeout) unless its size needs longer."""
    base = command_timeout()
    return rows / BULK_ROWS_PER_SECOND if base is not None and rows / BULK_ROWS_PER_SECOND > base else None


def _with_timeouts(kwargs: dict[str, Any]) -> dict[str, Any]:
    """asyncpg's ``timeout`` is our per-host connect timeout; ``command_timeout`` bounds every
    statement with a client-side timer (no round trip) unless the caller names its own."""
    return {"timeout": _timeout("connect_timeout"), "command_timeout": command_timeout(), **kwargs}


class Connection(asyncpg.Connection):  # type: ignore[misc]
    """gpuq's connections: a statement that times out (or whose task is cancelled) costs its connection.

    asyncpg would send a CancelRequest over a new connection and keep this one until it is
    answered; to a hung host both wait, and the pool hands the connection out again. Here it
    is terminated at once, and so are the pool's idle connections to the same host: they
    share its fate, and each would cost another command timeout to find out.
    """

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:
        with self._timing_out():
            return await super().execute(query, *args, timeout=timeout)  # type: ignore[no-any-return]

    async def _execute(self, *args: Any, **kwargs: Any) -> Any:  # fetch, fetchrow, fetchval, execute with args
        with self._timing_out():
            return await super()._execute(*args, **kwargs)

    @contextlib.contextmanager
    def _timing_out(self) -> Any:
        """A statement that times out makes its host a suspect: new connections try it last."""
        try:
            yield
        except TimeoutError:
            if isinstance(self._addr, tuple):
                _suspect(f"{self._addr[0]}:{self._addr[1]}")
            raise

    async def _cancel(self, waiter: asyncio.Future[None], cancel_waiter: Any = None) -> None:
        try:
            holder = self._pool_holder() if getattr(self, "_pool_holder", None) else None
            self.terminate()  # completes asyncpg's cancel waiters: a release does not wait
            if holder is not None:
                _drop_idle(holder._pool, self._addr)
        finally:
            self._cancellations.discard(asyncio.current_task(self._loop))
            if not waiter.done():
                waiter.set_result(None)


def _drop_idle(pool: asyncpg.Pool, addr: Any) -> None:
    for holder in pool._holders:
        con = holder._con
        if con is not None and holder._in_use is None and con._addr == addr:
            con.terminate()


def _host_dsns(dsn: str) -> list[str]:
    """One DSN per host of ``postgresql://user@h1:p1,h2:p2/db?...`` (libpq's multi-host URL);
    a single-host DSN (or hosts given as ``?host=``) as it is."""
    scheme, sep, rest = dsn.partition("://")
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    creds, at, hosts = rest[:end].rpartition("@")
    if not sep or "," not in hosts:
        return [dsn]
    return [f"{scheme}://{creds}{at}{host}{rest[end:]}" for host in hosts.split(",")]


# The host that last took a connection, per DSN: new connections try it first, so a
# failover costs one connect timeout on the old primary, not one per connection.
_last_good: dict[str, int] = {}
# A host whose connect or statement timed out is tried after the others for this long: the
# old primary of a failover may hang, and each try of it costs a timeout.
SUSPECT_SECONDS = 60.0
_suspects: dict[str, float] = {}  # "host:port" -> until when it is tried last


def _suspect(host: str) -> None:
    _suspects[host] = time.monotonic() + SUSPECT_SECONDS


def _host_of(host_dsn: str) -> str:
    parts = urlsplit(host_dsn)
    return f"{parts.hostname}:{parts.port or 5432}"


def _host_order(dsn: str, hosts: list[str]) -> list[int]:
    """The last good host first, then the others in the DSN's order; suspects after them all."""
    first = _last_good.get(dsn, 0)
    order = [first, *(i for i in range(len(hosts)) if i != first)]
    if len(hosts) > 1:
        now = time.monotonic()
        order.sort(key=lambda i: _suspects.get(_host_of(hosts[i]), 0.0) > now)  # stable
    return order
# A host that fails these is passed over for the next (libpq does the same).
_NEXT_HOST: tuple[type[BaseException], ...] = (
    OSError, NO_TARGET_HOST, asyncpg.CannotConnectNowError, asyncpg.ConnectionDoesNotExistError)


async def connect_hosts(dsn: str, **kwargs: Any) -> asyncpg.Connection:
    """asyncpg's connect, each host of a multi-host DSN with its own ``timeout`` (asyncpg's
    one timeout covers every host: a black-holed first host spent it and the next was never
    tried). Keepalives on the socket. The pool's ``connect``."""
    hosts = _host_dsns(dsn)
    error: BaseException | None = None
    for i in _host_order(dsn, hosts):
        try:
            conn = await asyncpg.connect(hosts[i], **{"connection_class": Connection, **kwargs})
        except _NEXT_HOST as exc:
            if isinstance(exc, TimeoutError) and len(hosts) > 1:
                _suspect(_host_of(hosts[i]))
            error = exc if error is None or not isinstance(exc, NO_TARGET_HOST) else error
            continue
        _last_good[dsn] = i
        keep_alive(conn)
        return conn
    assert error is not None
    raise error


def keep_alive(conn: asyncpg.Connection) -> None:
    """TCP keepalives (and TCP_USER_TIMEOUT on Linux) on a connection's socket: socket options,
    so nothing is sent to the server (PgBouncer refuses unknown startup parameters)."""
    sock = conn._transport.get_extra_info("socket") if conn._transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_SECONDS), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_SECONDS),
                          ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_SECONDS * 1000)):
        if hasattr(socket, option):  # Linux has them all; macOS lacks some
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


async def close_pool(pool: Any, seconds: float) -> None:
    """Close a pool gracefully for up to ``seconds``, then terminate what is left: a graceful
    close waits for a hung host's answer for ever."""
    inner = pool.inner if isinstance(pool, Guarded) else pool
    with anyio.move_on_after(seconds):
        await inner.close()  # cancelled, asyncpg terminates the pool
    inner.terminate()


async def close(conn: Any, seconds: float | None = None) -> None:
    """Close a connection, gracefully for up to ``seconds`` (default: the command timeout)."""
    with contextlib.suppress(Exception):
        await conn.close(timeout=seconds or _bound())  # on timeout asyncpg aborts it
    if not conn.is_closed():
        conn.terminate()


async def unlisten(conn: Any, channel: str, callback: Any) -> None:
    """UNLISTEN, bounded by the command timeout (a connection that is not gpuq's has none):
    on a frozen socket the connection is terminated instead."""
    if conn.is_closed():
        return
    try:
        async with asyncio.timeout(_bound()):
            await conn.remove_listener(channel, callback)
    except CONNECTION_LOST:  # a TimeoutError among them
        conn.terminate()


async def probe(conn: Any) -> None:
    """Ask a silent connection something: a hung host raises TimeoutError within the bound."""
    await conn.execute(queries["ping"], timeout=_bound())
