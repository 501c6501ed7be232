"""Producer helpers: put jobs on the queue from Python, cancel them, look at them.

Any program can also just ``INSERT INTO gpuq.jobs (kind, payload) VALUES ...``;
the trigger notifies the dispatcher either way. These helpers add batching,
delays and deduplication (see ``gpuq.queue.enqueue_many``).

``db`` is an asyncpg Connection or Pool, or a DSN string (a connection is then
opened and closed for the call: fine for scripts, wasteful in a loop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from gpuq import queue
from gpuq.db import connect
from gpuq.queue import DB, NewJob

T = TypeVar("T")


async def enqueue(
    db: DB | str,
    kind: str,
    payload: Any = None,
    *,
    priority: int = 0,
    max_attempts: int = 5,
    delay: float = 0.0,
    run_at: datetime | None = None,
    dedup_key: str | None = None,
) -> int:
    """Enqueue one job and return its id (the live job's id if deduplicated)."""
    job = NewJob(kind, payload, priority, max_attempts, delay, run_at, dedup_key)
    return (await enqueue_many(db, [job]))[0]


async def enqueue_many(db: DB | str, jobs: Sequence[NewJob]) -> list[int]:
    """Enqueue many jobs in one statement (one NOTIFY); ids in input order."""
    return await _with(db, lambda c: queue.enqueue_many(c, jobs))


async def cancel(db: DB | str, *job_ids: int) -> dict[int, str]:
    """Cancel live jobs (pending, scheduled or running); each one cancelled -> the state it left."""
    return await _with(db, lambda c: queue.cancel(c, *job_ids))


async def show(db: DB | str, job_id: int) -> dict[str, Any] | None:
    """The whole job as a dict, or None."""
    return await _with(db, lambda c: queue.show(c, job_id))


async def _with(db: DB | str, call: Callable[[DB], Awaitable[T]]) -> T:
    """``call`` on ``db``, or on a connection opened (and closed) for it when ``db`` is a DSN."""
    if not isinstance(db, str):
        return await call(db)
    conn = await connect(db)
    try:
        return await call(conn)
    finally:
        await conn.close()
