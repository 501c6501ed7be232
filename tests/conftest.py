"""Test fixtures: a real PostgreSQL for the whole session, a clean schema per test.

The server is a throwaway embedded cluster (gpuq.devdb), or ``$DATABASE_URL``
when set. Each test starts from a freshly migrated ``gpuq`` schema: tests
drop it, so never point DATABASE_URL at a database whose queue you want.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from gpuq import db
from gpuq.devdb import Cluster, DevDBError, throwaway_cluster
from gpuq.migrate import migrate


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster | None]:
    if os.environ.get("DATABASE_URL"):
        yield None
        return
    try:
        c = throwaway_cluster()
        c.ensure_started()
    except DevDBError as exc:
        pytest.exit(f"cannot start the test PostgreSQL: {exc}", returncode=3)
    try:
        yield c
    finally:
        c.destroy()


@pytest.fixture(scope="session")
def server_dsn(cluster: Cluster | None) -> str:
    return os.environ["DATABASE_URL"] if cluster is None else cluster.dsn


@pytest.fixture
async def dsn(server_dsn: str) -> str:
    """A DSN whose database has a freshly migrated, empty gpuq schema."""
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS gpuq CASCADE")
    finally:
        await conn.close()
    await migrate(server_dsn)
    return server_dsn


@pytest.fixture
async def pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(dsn, min_size=1, max_size=12)
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def conn(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    c = await db.connect(dsn)
    try:
        yield c
    finally:
        await c.close()
