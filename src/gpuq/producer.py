"""Producer helpers: put jobs on the queue from Python, cancel them, look at them, await them.

Any program can also just ``INSERT INTO gpuq.jobs (kind, payload) VALUES ...``;
the trigger notifies the dispatcher either way. These helpers add batching,
delays and deduplication (see ``gpuq.queue.enqueue_many``).

``db`` is an asyncpg Connection or Pool, or a DSN string (a connection is then
opened and closed for the call: fine for scripts, wasteful in a loop).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from gpuq import admin, queue, tracing, wakeups
from gpuq.db import (
    CONNECTION_LOST,
    LISTEN_PROBE_SECONDS,
    DatabaseUnavailable,
    close,
    connect,
    probe,
    unlisten,
)
from gpuq.jobs import DEFAULT_GRACE_SECONDS, DEFAULT_MAX_PREEMPTIONS, NewJob
from gpuq.loops import LoopBackoff
from gpuq.sql import DB, queries

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
    timeout_seconds: int | None = None,
    gpus: int = 0,
    gpu_memory_mb: int | None = None,
    labels: Sequence[str] = (),
    model: str | None = None,
    concurrency_key: str | None = None,
    cost: int | None = None,
    batch_key: str | None = None,
    tenant: str | None = None,
    preemptible: bool = False,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS,
) -> int:
    """Enqueue one job and return its id (the live job's id if deduplicated).

    ``timeout_seconds``: how long one attempt may run (None: no limit, or the
    kind's default). Placement (all optional): ``gpus`` devices on one agent,
    each with at least ``gpu_memory_mb``; an agent with every one of
    ``labels``; one holding ``model`` warm if any fits; ``concurrency_key``
    for global limits. Batching (a kind with a policy, ``gpuq batch``): ``cost``, its share of a
    batch's ``max_cost``; ``batch_key``: only jobs of one key share a batch. ``tenant``: whose
    GPU-seconds it charges under fair share (None: the default tenant; ``gpuq tenant``). ``preemptible``:
    it may be asked to yield (``gpuq preempt``, a higher-priority job, a spot interruption), and then has
    ``grace_seconds`` to stop before its agent stops it; it goes back to pending without counting the
    attempt, at most ``max_preemptions`` times (then it runs to its end). ``ValueError`` for a bad value
    (``NewJob.from_mapping``).
    """
    job = NewJob.from_mapping({
        "kind": kind, "payload": payload, "priority": priority, "max_attempts": max_attempts, "delay": delay,
        "run_at": run_at, "dedup_key": dedup_key, "timeout_seconds": timeout_seconds, "gpus": gpus,
        "gpu_memory_mb": gpu_memory_mb, "labels": labels, "model": model, "concurrency_key": concurrency_key,
        "cost": cost, "batch_key": batch_key, "tenant": tenant, "preemptible": preemptible,
        "grace_seconds": grace_seconds, "max_preemptions": max_preemptions})
    return (await enqueue_many(db, [job]))[0]


async def enqueue_many(db: DB | str, jobs: Sequence[NewJob]) -> list[int]:
    """Enqueue many jobs in one statement (one NOTIFY); ids in input order.

    Called with an OpenTelemetry span active (``gpuq[otel]``), it runs in a
    producer span whose trace every job carries to the server and the agent
    (docs/design.md, "Tracing")."""
    if tracing.active():
        return await _enqueue_traced(db, jobs)
    return await _with(db, lambda c: queue.enqueue_many(c, jobs))


async def _enqueue_traced(db: DB | str, jobs: Sequence[NewJob]) -> list[int]:
    with tracing.enqueue_span([j.kind for j in jobs], len(jobs)) as (span, trace):
        ids = await _with(db, lambda c: queue.enqueue_many(c, jobs, trace))
        if len(ids) == 1:
            span.set_attribute("gpuq.job.id", ids[0])
        return ids


async def cancel(db: DB | str, *job_ids: int) -> dict[int, str]:
    """Cancel live jobs (pending, scheduled or running); each one cancelled -> the state it left."""
    return await _with(db, lambda c: admin.cancel(c, *job_ids))


async def preempt(db: DB | str, *job_ids: int) -> dict[int, float]:
    """Ask running preemptible jobs to yield (with preemptions left, not asked within their grace time);
    each one asked -> its grace seconds. They go back to pending as their agents report them."""
    return await _with(db, lambda c: admin.preempt(c, *job_ids))


async def show(db: DB | str, job_id: int) -> dict[str, Any] | None:
    """The whole job as a dict, or None."""
    return await _with(db, lambda c: admin.show(c, job_id))


class JobError(Exception):
    """A job that ended without a result; ``job`` is what ``show`` returns."""

    def __init__(self, job_id: int, message: str, job: dict[str, Any] | None = None):
        super().__init__(message)
        self.job_id, self.job = job_id, job


class JobDead(JobError):
    """The job failed for good: no attempts left, or a permanent error (``last_error`` says which)."""


class JobCancelled(JobError):
    """The job was cancelled."""


class WaitTimeout(JobError, TimeoutError):
    """The job did not end within the timeout (it goes on)."""


async def wait(db: DB | str, job_id: int, timeout: float | None = None,
               on_progress: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """The result of job ``job_id`` once it is done; ``JobDead``, ``JobCancelled`` or ``WaitTimeout``.

    Woken by the notification that the statement ending a job sends when it
    commits (channel ``gpuq_outcomes``, one per batch); it LISTENs before it
    first reads the job, so no ending can fall between. No polling. ``db``
    may be a DSN (a connection is opened for the wait), a pool (one of its
    connections is held while waiting) or a connection.

    If the connection is lost (a restart, a failover) or stops answering (a
    silent connection is asked something every ``LISTEN_PROBE_SECONDS``, within
    ``GPUQ_COMMAND_TIMEOUT``), a wait on a DSN or a pool connects again with
    backoff, LISTENs again and reads the job again, until ``timeout``; a wait on
    a connection it was given raises the error, and so does a DSN's first connect.

    ``on_progress(progress)`` (sync or async) streams the job's progress: it is
    called with the stored ``{fraction, message, data, attempt, at}`` when the
    wait starts, if there is any, and each time the server writes a new one
    (at most once a second; woken by ``gpuq_progress``).
    """
    waiter = _Waiter(job_id, on_progress)
    delays = LoopBackoff().delays()
    try:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    if hasattr(db, "acquire"):  # LISTEN needs one connection, not a pool
                        async with db.acquire() as conn:
                            return await waiter.wait_on(conn)
                    return await _with(db, waiter.wait_on)
                except CONNECTION_LOST:
                    if not isinstance(db, str) and not hasattr(db, "acquire"):
                        raise  # the caller's connection: it is the caller's to replace
                    if isinstance(db, str) and not waiter.started:
                        raise  # a DSN that never connected: a wrong one, or the database is down
                await asyncio.sleep(next(delays))
    except TimeoutError:
        raise WaitTimeout(job_id, f"job {job_id} did not end within {timeout} s") from None


class _Waiter:
    """One wait, across the connections it may take: what progress it has passed on already."""

    def __init__(self, job_id: int, on_progress: Callable[[dict[str, Any]], Any] | None):
        self.job_id, self.on_progress = job_id, on_progress
        self.shown: str | None = None  # the progress last passed to on_progress, as JSON text
        self.started = False  # it has had a connection

    async def wait_on(self, conn: Any) -> Any:
        """Wait on this connection until the job ends (its result or error) or the connection is lost."""
        changed, lost = asyncio.Event(), asyncio.Event()
        key, self.started = str(self.job_id), True

        def on_notify(_c: Any, _pid: int, _channel: str, payload: str) -> None:
            if key in payload.split(","):
                changed.set()

        def on_lost(_c: Any) -> None:
            lost.set()
            changed.set()

        channels = [wakeups.OUTCOMES_CHANNEL] + ([wakeups.PROGRESS_CHANNEL] if self.on_progress else [])
        conn.add_termination_listener(on_lost)
        try:
            for channel in channels:
                await conn.add_listener(channel, on_notify)
            while True:
                changed.clear()
                if (outcome := await self._read(conn)) is not _PENDING:
                    return outcome
                await _until(changed, conn)
                if lost.is_set():
                    raise DatabaseUnavailable(f"the connection waiting for job {self.job_id} was lost")
        finally:
            conn.remove_termination_listener(on_lost)
            for channel in channels:  # bounded: an UNLISTEN on a frozen socket held waiters for ever
                await unlisten(conn, channel, on_notify)

    async def _read(self, conn: Any) -> Any:
        """The job's result; its progress passed on; ``_PENDING`` while it has not ended."""
        row = await conn.fetchrow(queries["job_outcome"], self.job_id)
        job_id = self.job_id
        if row is None:
            raise JobError(job_id, f"no job {job_id}")
        if self.on_progress and row["progress"] is not None and row["progress"] != self.shown:
            self.shown = row["progress"]
            if inspect.isawaitable(called := self.on_progress(json.loads(self.shown))):
                await called
        if row["status"] == "done":
            return None if row["result"] is None else json.loads(row["result"])
        if row["status"] == "dead":
            raise JobDead(job_id, f"job {job_id} is dead: {row['last_error']}", await admin.show(conn, job_id))
        if row["status"] == "cancelled":
            raise JobCancelled(job_id, f"job {job_id} was cancelled", await admin.show(conn, job_id))
        return _PENDING


_PENDING = object()  # the job has not ended yet


async def _until(changed: asyncio.Event, conn: Any) -> None:
    """Until ``changed``; a connection silent for LISTEN_PROBE_SECONDS is asked something, and
    one that does not answer within the command timeout is dropped (a hung host sends no close)."""
    while True:
        try:
            await asyncio.wait_for(changed.wait(), LISTEN_PROBE_SECONDS)
            return
        except TimeoutError:
            pass
        try:
            await probe(conn)
        except TimeoutError:
            conn.terminate()
            raise DatabaseUnavailable("the connection waiting for a job stopped answering") from None


async def _with(db: DB | str, call: Callable[[DB], Awaitable[T]]) -> T:
    """``call`` on ``db``, or on a connection opened (and closed) for it when ``db`` is a DSN."""
    if not isinstance(db, str):
        return await call(db)
    conn = await connect(db)
    try:
        return await call(conn)
    finally:
        await close(conn)
