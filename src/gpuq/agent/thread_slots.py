"""A sync handler's slots: each slot is one worker thread that runs its jobs one after another;
a timeout or a cancel sets ``job.cancelled``, a preempt ``job.preempted`` (a thread cannot be
interrupted: a handler that raises once preempted yielded, one that returns finished). A batch runs in one
batch handler call; its timeout (its items' smallest) sets every item's ``cancelled``."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import TYPE_CHECKING, Any

import anyio

from gpuq import protocol
from gpuq.agent import spans
from gpuq.agent.batches import batch_jobs, record_raised, record_returned
from gpuq.agent.handlers import (
    TIMEOUT_ERROR,
    Job,
    JobPreempted,
    PermanentError,
    report_fault,
    summary,
)
from gpuq.agent.slots import Slots
from gpuq.protocol.batches import Unit

if TYPE_CHECKING:
    from anyio.abc import TaskGroup


class ThreadSlots(Slots):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._session_over = threading.Event()  # set as the session ends: slots stop taking jobs
        # The handlers inside a span, for jobs that carry a trace (None without OpenTelemetry).
        self.traced_handler = spans.traced(lambda: self.handler, self.protocol, is_async=False)
        self.traced_batch_handler = spans.traced_batch(lambda: self.batch_handler, self.protocol, is_async=False)

    def session_started(self, tg: TaskGroup) -> None:
        super().session_started(tg)
        self._session_over = threading.Event()
        tg.start_soon(_set_when_cancelled, self._session_over)

    async def run_slot(self, job: Unit | None) -> None:
        if job is not None:
            await anyio.to_thread.run_sync(self._slot, job)
        self._wake()

    def cancel(self, ids: tuple[int, ...]) -> None:
        """Nothing to interrupt: a thread cannot be; its handler finds ``job.cancelled`` true."""

    def preempt(self, ids: tuple[int, ...], deadline_seconds: float) -> None:
        """Nothing to interrupt: its handler finds ``job.preempted`` true and should raise by the deadline."""

    def _start_slots(self, tg: TaskGroup, jobs: list[Unit]) -> None:
        self.event_loop().call_soon_threadsafe(tg.start_soon, self.run_slots, jobs)

    def _slot(self, job: Unit) -> None:
        """A slot, all in one worker thread: each job runs, is reported, and the next ready one
        starts here at once. The event loop is only woken to send (the outcome and the next start
        in one frame), never in the way between two jobs: a hop through it cost each job two
        thread wake-ups. Ends when the session does, after the running handler returns."""
        wake = functools.partial(self.event_loop().call_soon_threadsafe, self._wake)
        over = self._session_over  # this session's: after a reconnect the next one has its own slots
        next_job: Unit | None = job
        while next_job is not None and not over.is_set():
            self.protocol.job_started(next_job)
            wake()
            ran = self._run_job(next_job)
            if over.is_set():
                break  # the connection is gone: its ready jobs went back to the server
            next_job = self.next_in_slot(next_job, ran)
        wake()  # the last outcome

    def _run_job(self, job: Unit) -> tuple[float, float]:
        """Call the handler, or the batch handler, (in the slot's thread) and record the outcomes;
        its (start, end)."""
        if self.ended_before_start(job):  # before its timer: ``cancelled`` is the server's
            now = self.protocol.clock()
            return now, now
        expired: list[bool] = []
        timers: list[asyncio.TimerHandle] = []
        loop, timeout, jobs = self.event_loop(), job.timeout, batch_jobs(job)
        if timeout is not None:  # a thread cannot be interrupted: the flag asks it to stop
            loop.call_soon_threadsafe(lambda: timers.append(loop.call_later(timeout, _expire, jobs, expired)))
        start = self.protocol.clock()
        try:
            if self.batched(job):
                self._call_batch(jobs, expired)
            else:
                self._call(jobs[0], expired)
        finally:
            end = self.protocol.clock()
            if timeout is not None:
                loop.call_soon_threadsafe(_cancel_all, timers)
        return start, end

    def _call(self, job: Job, expired: list[bool]) -> None:
        handler = self.traced_handler if job.trace is not None and self.traced_handler else self.handler
        assert handler is not None  # else the job is ``batched``
        try:
            result = handler(job)
        except Exception as exc:
            if job.preempted or isinstance(exc, JobPreempted):  # it yielded
                self.protocol.job_preempted(job)
            else:  # the handler's failure is the job's, not ours
                report_fault(self.protocol, job, exc)
                self.protocol.job_failed(job, summary(exc), retryable=not isinstance(exc, PermanentError))
        else:
            if expired:
                self.protocol.job_failed(job, TIMEOUT_ERROR, retryable=True)
            else:
                self.protocol.job_done(job, result)

    def _call_batch(self, jobs: list[Job], expired: list[bool]) -> None:
        """Past the timeout every item fails ``timeout``, whether the handler returned or raised."""
        handler = self.traced_batch_handler or self.batch_handler
        assert handler is not None  # a batch comes only to an agent with a batch handler
        try:
            returned = handler(jobs)
        except Exception as exc:  # the handler's failure is its items', not ours
            if not expired:
                record_raised(self.protocol, jobs, exc)
                return
            returned = None
        record_returned(self.protocol, jobs, returned, expired=bool(expired))


def _expire(jobs: list[Job], expired: list[bool]) -> None:
    """A sync handler's timeout: it sees ``job.cancelled``; whatever it returns, the attempt failed."""
    expired.append(True)
    for job in jobs:
        protocol.mark_cancelled(job)


def _cancel_all(timers: list[asyncio.TimerHandle]) -> None:
    for t in timers:
        t.cancel()


async def _set_when_cancelled(flag: threading.Event) -> None:
    try:
        await anyio.sleep_forever()
    finally:
        flag.set()
