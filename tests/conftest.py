"""Test fixtures: a real PostgreSQL for the whole session.

The server is a throwaway embedded cluster (gpuq.devdb), or ``$DATABASE_URL``
when set; tests drop its ``gpuq`` schema, so never point DATABASE_URL at a
database whose queue you want. Tiers: ``tests/unit`` (no database),
``tests/integration`` (this PostgreSQL), ``tests/acceptance`` (subprocesses).

- ``conn``: one connection inside a transaction that is rolled back at the
  end, on an empty migrated schema. The cheap default.
- ``dsn`` (and ``pool``, ``live_conn``, ``notifications``): a freshly migrated
  schema whose changes commit, for tests that need a second connection,
  LISTEN/NOTIFY, VACUUM or autovacuum, or a running server.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest

from gpuq import db
from gpuq.devdb import Cluster, DevDBError, throwaway_cluster
from gpuq.devpooler import Bouncer
from gpuq.migrate import migrate
from gpuq.wakeups import NOTIFY_CHANNEL, arm_wakeups


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
    async with await db.create_pool(dsn, min_size=1, max_size=12) as p:
        yield p


@pytest.fixture
async def live_conn(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A plain connection on a fresh schema: what it does commits. Like ``conn``, no command
    timeout: tests load big histories through it (tests/integration/test_hung_peers.py tests it)."""
    c = await db.connect(dsn, command_timeout=None)
    yield c  # pytest comes back here after the test, failed or not
    await c.close()


@pytest.fixture
async def conn(server_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection in a transaction on an empty, migrated schema; rolled back afterwards."""
    await migrate(server_dsn)  # "up to date" unless a test dropped the schema
    c = await db.connect(server_dsn, command_timeout=None)
    tx = c.transaction()
    await tx.start()
    try:
        # What committed tests left: every table of the schema but the migrations' own record,
        # read from the catalog so that a table a new migration adds is emptied too.
        tables = await c.fetch(
            "SELECT format('%I.%I', schemaname, tablename) AS name FROM pg_tables "
            "WHERE schemaname = 'gpuq' AND tablename <> 'schema_migrations' ORDER BY tablename"
        )
        await c.execute(f"TRUNCATE {', '.join(t['name'] for t in tables)} RESTART IDENTITY")
        yield c
    finally:
        await tx.rollback()
        await c.close()


class Notifications:
    """Payloads received on the gpuq_jobs channel by a dedicated LISTEN connection."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        self.queue.put_nowait(payload)

    async def next(self, timeout: float = 5.0) -> str:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def drain(self, settle: float = 0.3) -> list[str]:
        """Everything received until nothing more arrives for ``settle`` seconds."""
        got = []
        while True:
            try:
                got.append(await asyncio.wait_for(self.queue.get(), settle))
            except TimeoutError:
                return got


@pytest.fixture
async def notifications(dsn: str) -> AsyncIterator[Notifications]:
    n = Notifications()
    c = await db.connect(dsn)
    await c.add_listener(NOTIFY_CHANNEL, n._on_notify)
    await arm_wakeups(c, 600_000)  # like a waiting dispatcher: inserts notify (docs/design.md, "Wake-ups")
    try:
        yield n
    finally:
        await c.close()


@pytest.fixture
def bouncer(server_dsn: str) -> Iterator[Bouncer]:
    """A real PgBouncer in transaction mode in front of the test server.

    Without the binary the test is skipped with the package to install, except
    under CI=true, where a missing pgbouncer is a failure (.ci/run installs it).
    """
    try:
        b = Bouncer(server_dsn).start()
    except DevDBError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run every test: {exc}")
        pytest.skip(str(exc))
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def spans() -> Iterator[Any]:
    """An OpenTelemetry SDK tracer provider set as the global one for this test, exporting to memory:
    ``spans.get_finished_spans()``; unset again afterwards."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tests.helpers import reset_tracer_provider

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reset_tracer_provider()
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        reset_tracer_provider()
        provider.shutdown()
