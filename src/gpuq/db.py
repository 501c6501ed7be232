"""Connections to PostgreSQL: one place that knows how to open them.

Direct connections carry the planner guards as startup parameters (one
round trip per statement). Through a transaction pooler (``GPUQ_POOLER=
transaction``) session state does not stick and PgBouncer refuses unknown
startup parameters, so pooled connections send none, keep no prepared-statement
cache, and run each statement in a transaction that sets the guards first
(``Guarded``; docs/design.md, "Behind a transaction pooler").
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

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

    async def _run(self, method: str, query: str, args: tuple[Any, ...]) -> Any:
        async with transaction(self) as conn:
            return await getattr(conn, method)(query, *args)

    async def fetch(self, query: str, *args: Any) -> Any:
        return await self._run("fetch", query, args)

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
    ``GPUQ_POOLER``) unless ``direct``."""
    is_pooled = (pooled() if pooler is None else pooler) and not direct
    try:
        conn = await asyncpg.connect(dsn, **_session_kwargs(kwargs, is_pooled))
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
                                         reset=_keep_session, **_session_kwargs(kwargs, is_pooled))
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
