"""Connections to PostgreSQL: one place that knows how to open them."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from gpuq.plans import PLAN_SETTINGS


class DatabaseUnavailable(RuntimeError):
    """The database cannot be reached (one clear line for the CLI)."""


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb in and out as Python objects (payloads, results).
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


def _server_settings(kwargs: dict[str, Any]) -> dict[str, str]:
    return {**PLAN_SETTINGS, **kwargs.pop("server_settings", {})}


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """Pool reset: asyncpg still rolls back an open transaction first.

    The default reset (RESET ALL, UNLISTEN *, CLOSE ALL, advisory unlock) is
    one more round trip on every release, for session state gpuq never leaves
    on a pooled connection (LISTEN and the migration lock use their own).
    """


async def connect(dsn: str, **kwargs: Any) -> asyncpg.Connection:
    try:
        conn = await asyncpg.connect(dsn, server_settings=_server_settings(kwargs), **kwargs)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise DatabaseUnavailable(f"cannot connect to the database at {redact(dsn)}: {exc}") from None
    await _init_connection(conn)
    return conn


async def create_pool(dsn: str, min_size: int = 1, max_size: int = 10, **kwargs: Any) -> asyncpg.Pool:
    try:
        return await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, init=_init_connection, reset=_keep_session,
            server_settings=_server_settings(kwargs), **kwargs,
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise DatabaseUnavailable(f"cannot connect to the database at {redact(dsn)}: {exc}") from None


def redact(dsn: str) -> str:
    """The DSN without its password, safe for logs and error lines."""
    if "@" not in dsn or "://" not in dsn:
        return dsn
    scheme, rest = dsn.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}@{host}"


# What a long-running service logs and retries instead of dying on: the
# server restarting, a dropped connection, a statement failing mid-outage.
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable, OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError,
)
