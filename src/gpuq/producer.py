"""Producer helpers: put jobs on the queue from Python.

Any program can also just ``INSERT INTO gpuq.jobs (kind, payload) VALUES ...``;
the trigger notifies the dispatcher either way. These helpers add batching,
delays and deduplication (see ``gpuq.queue.enqueue_many``).

``db`` is an asyncpg Connection or Pool, or a DSN string (a connection is then
opened and closed for the call: fine for scripts, wasteful in a loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from gpuq import queue
from gpuq.db import connect
from gpuq.queue import DB, NewJob


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
    if not isinstance(db, str):
        return await queue.enqueue_many(db, jobs)
    conn = await connect(db)
    try:
        return await queue.enqueue_many(conn, jobs)
    finally:
        await conn.close()
