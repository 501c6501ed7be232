"""Small helpers shared by tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import inspect
import os
from typing import Any

import anyio
import pytest


def need_replica_tools() -> None:
    """Skip without pg_basebackup (a standby cannot be built), except under CI=true: there it is a failure."""
    from gpuq.replica import missing_tools

    if why := missing_tools():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run every test: {why}")
        pytest.skip(why)


async def seed_history(conn: Any, n: int, kind: str = "train", status: str = "done") -> None:
    """Insert ``n`` finished rows in one statement (no pending kinds: no NOTIFY)."""
    await conn.execute(
        """
        INSERT INTO gpuq.jobs (kind, payload, status, attempts, finished_at, result)
        SELECT $1, jsonb_build_object('i', g), $3::gpuq.job_status, 1, now(), '{"ok": true}'
        FROM generate_series(1, $2) g
        """,
        kind, n, status,
    )


async def add_pending(conn: Any, n: int, kind: str = "train", priority: int = 0) -> list[int]:
    rows = await conn.fetch(
        """
        INSERT INTO gpuq.jobs (kind, payload, priority)
        SELECT $1, jsonb_build_object('i', g), $3 FROM generate_series(1, $2) g
        RETURNING id
        """,
        kind, n, priority,
    )
    return [r["id"] for r in rows]


async def job(conn: Any, job_id: int) -> Any:
    return await conn.fetchrow("SELECT * FROM gpuq.jobs WHERE id = $1", job_id)


async def expire_leases(conn: Any, ids: list[int] | None = None) -> None:
    """Move lease expiry into the past (instead of sleeping through it)."""
    await conn.execute(
        "UPDATE gpuq.jobs SET lease_expires_at = now() - interval '1 second' "
        "WHERE status = 'leased' AND ($1::bigint[] IS NULL OR id = ANY($1))",
        ids,
    )


async def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll a predicate (plain or async) until it is true; fail the test on timeout."""
    with anyio.fail_after(timeout):
        while True:
            ok = predicate()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return
            await anyio.sleep(interval)  # the poll's interval, not a settle wait


def metric(name: str, **labels: str) -> float:
    """A sample of this process's gpuq metrics (0 when it has none yet)."""
    from gpuq.metrics import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def wakeup_arms() -> float:
    return metric("gpuq_wakeup_arms_total", lapsed="true") + metric("gpuq_wakeup_arms_total", lapsed="false")


async def dispatcher_idle(timeout: float = 10.0) -> None:
    """Wait until a dispatcher of this process has gone idle since the call: with free credit
    it arms the wake-up mark only before it waits, when its last pass found nothing to start
    (and again every WAKE_MARK_MS / 2 while idle); two arms mean it has waited in between.
    What it would wrongly lease without a new wake-up it has leased by then."""
    start = wakeup_arms()
    await wait_for(lambda: wakeup_arms() >= start + 2, timeout, interval=0.01)


async def agents_connected(srv: Any) -> list[dict[str, Any]]:
    """The agents a running server's /status lists."""
    import json

    from gpuq.harness import TOKEN, http_get

    return list(json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])["agents"])


async def no_agents_connected(srv: Any, timeout: float = 10.0) -> None:
    """Wait until a running server has no agent session left."""
    async def none() -> bool:
        return not await agents_connected(srv)

    await wait_for(none, timeout, interval=0.02)


async def count(db: Any, status: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = $1::gpuq.job_status", status))


async def status_of(db: Any, job_id: int) -> str | None:
    return await db.fetchval("SELECT status::text FROM gpuq.jobs WHERE id = $1", job_id)


async def wait_count(db: Any, status: str, n: int, timeout: float = 60.0) -> None:
    """Wait until at least ``n`` jobs are in ``status``."""
    async def reached() -> bool:
        return await count(db, status) >= n

    await wait_for(reached, timeout, interval=0.05)


async def wait_status(db: Any, job_id: int, status: str, timeout: float = 20.0) -> None:
    async def reached() -> bool:
        return await status_of(db, job_id) == status

    await wait_for(reached, timeout)


def sets(event: Any) -> Any:
    """A handler that sets ``event``. Async, so it runs on the loop: a sync handler
    runs in a worker thread, and an anyio/asyncio event must not be set from one."""

    async def handle(job: Any) -> None:
        event.set()

    return handle


def sync_until_cancelled(seen: list, returns: Any = None) -> Any:
    """A sync handler that works until ``job.cancelled`` (30 s at most), noting what it saw."""
    import time

    def handle(job: Any) -> Any:
        deadline = time.monotonic() + 30
        while not job.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)  # not a settle wait: the handler's work, checking job.cancelled between steps
        seen.append(job.cancelled)
        return returns

    return handle


def async_until_cancelled(stopped: Any) -> Any:
    """An async handler that sleeps until it is cancelled, then sets ``stopped``."""
    import asyncio

    async def handle(job: Any) -> None:
        try:
            await asyncio.sleep(60)  # not a settle wait: the handler's work, until it is cancelled
        except asyncio.CancelledError:
            stopped.set()
            raise

    return handle


def reset_tracer_provider() -> None:
    """OpenTelemetry's global tracer provider unset again (it may be set once per process; its own
    tests reset these two globals the same way)."""
    from opentelemetry import trace
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = Once(), None
