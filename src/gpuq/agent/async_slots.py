"""An async handler's slots: each slot is one asyncio task that runs its jobs one after another,
under each job's timeout, cancelled when the server cancels the job, or at the deadline of a
``preempt`` (then the job is reported ``preempted``). A batch runs in one handler call under its
items' smallest timeout; a cancel or a preempt of one item only marks it (the others go on)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from gpuq.agent import spans
from gpuq.agent.batches import batch_jobs, record_raised, record_returned
from gpuq.agent.handlers import (
    CANCELLED_ERROR,
    TIMEOUT_ERROR,
    Job,
    JobPreempted,
    PermanentError,
    current_job,
    report_fault,
    summary,
)
from gpuq.agent.slots import Slots
from gpuq.protocol.batches import Unit

if TYPE_CHECKING:
    from anyio.abc import TaskGroup


class AsyncSlots(Slots):
    handlers_end_with_session = True  # cancelled with their connection's task group

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._tasks: dict[int, asyncio.Task[None]] = {}  # job id -> its slot's task
        self._stopped: dict[int, asyncio.Task[None]] = {}  # preempted jobs cancelled at their deadline
        # The handlers inside a span, for jobs that carry a trace (None without OpenTelemetry).
        self.traced_handler = spans.traced(lambda: self.handler, self.protocol, is_async=True)
        self.traced_batch_handler = spans.traced_batch(lambda: self.batch_handler, self.protocol, is_async=True)

    async def run_slot(self, job: Unit | None) -> None:
        """Run ``job``, then at once each ready job the protocol gives this slot, all in this one
        task (a ``cancel`` cancels the task while that job's handler runs, and ``_run_job`` takes
        it back)."""
        task = asyncio.current_task()
        while job is not None:
            self.protocol.job_started(job)
            batched = self.batched(job)
            if task is not None and not batched:  # a cancel stops a single job's task, never a batch's
                self._tasks[job.id] = task
                if isinstance(job, Job) and job.preempted:  # asked before its slot's task took it
                    self._stop_at_deadline(job, task)
            # The sender runs at the handler's first await: the outcome of the job before and this
            # start go out in one frame while the handler already runs.
            self._wake()
            try:
                if not self.ended_before_start(job):
                    await (self._run_batch(job) if batched else self._run_job(job))
            finally:
                self._tasks.pop(job.id, None)
            job = self.next_in_slot(job, None)
        self._wake()  # the last outcome

    def _start_slots(self, tg: TaskGroup, jobs: list[Unit]) -> None:
        tg.start_soon(self.run_slots, jobs)

    def cancel(self, ids: tuple[int, ...]) -> None:
        for job_id in ids:
            if (task := self._tasks.get(job_id)) is not None:
                task.cancel()

    def preempt(self, ids: tuple[int, ...], deadline_seconds: float) -> None:
        """At the deadline, cancel the tasks of those jobs still running (their handlers had the
        time until then to checkpoint and return); a job whose task has not taken it yet is armed
        when it does."""
        for job_id in ids:
            if (task := self._tasks.get(job_id)) is not None and (job := self.protocol.running.get(job_id)):
                self._stop_at_deadline(job, task)

    def _stop_at_deadline(self, job: Unit, task: asyncio.Task[None]) -> None:
        assert isinstance(job, Job) and job.preempt_deadline is not None
        delay = max(0.0, job.preempt_deadline - self.protocol.clock())
        asyncio.get_running_loop().call_later(delay, self._stop_preempted, job.id, task)

    def _stop_preempted(self, job_id: int, task: asyncio.Task[None]) -> None:
        if self._tasks.get(job_id) is task:  # else it has ended (its slot may run another job now)
            self._stopped[job_id] = task
            task.cancel()

    async def _run_job(self, job: Unit) -> None:
        """Run the handler under the job's timeout and record its outcome."""
        assert isinstance(job, Job)  # else it is ``batched``
        handler = self.traced_handler if job.trace is not None and self.traced_handler else self.handler
        assert handler is not None
        limit = None if job.timeout is None else asyncio.timeout(job.timeout)
        running = current_job.set(job)
        try:
            if limit is None:  # no timeout context: it cost a tenth of the agent's CPU on no-op jobs
                result = await handler(job)
            else:
                async with limit:
                    result = await handler(job)
        except asyncio.CancelledError:
            stopped = self._stopped.pop(job.id, None) is not None  # at its preempt's deadline
            if not (job.cancelled or stopped):
                raise  # the agent is stopping, not the job
            if (task := asyncio.current_task()) is not None:
                task.uncancel()  # the slot's task goes on with its next job
            if job.cancelled:
                self.protocol.job_failed(job, CANCELLED_ERROR, retryable=False)
            else:
                self.protocol.job_preempted(job)
        except Exception as exc:
            self._failed(job, exc, limit)
        else:
            self.protocol.job_done(job, result)
        finally:
            current_job.reset(running)

    def _failed(self, job: Job, exc: Exception, limit: asyncio.Timeout | None) -> None:
        """The handler raised: once asked to yield, a preemption; else a failure (``timeout`` when its
        limit expired; not retryable for ``PermanentError``)."""
        if job.preempted or isinstance(exc, JobPreempted):
            self.protocol.job_preempted(job)
        elif isinstance(exc, TimeoutError) and limit is not None and limit.expired():
            self.protocol.job_failed(job, TIMEOUT_ERROR, retryable=True)
        else:  # the handler's failure is the job's, not ours
            report_fault(self.protocol, job, exc)
            self.protocol.job_failed(job, summary(exc), retryable=not isinstance(exc, PermanentError))

    async def _run_batch(self, unit: Unit) -> None:
        """Call the batch handler under the batch's timeout and record each item's outcome."""
        jobs, handler = batch_jobs(unit), self.traced_batch_handler or self.batch_handler
        assert handler is not None  # a batch comes only to an agent with a batch handler
        limit = None if unit.timeout is None else asyncio.timeout(unit.timeout)
        try:
            if limit is None:
                returned = await handler(jobs)
            else:
                async with limit:
                    returned = await handler(jobs)
        except TimeoutError as exc:
            if limit is not None and limit.expired():
                record_returned(self.protocol, jobs, None, expired=True)
            else:  # the handler's own
                record_raised(self.protocol, jobs, exc)
        except Exception as exc:  # the handler's failure is its items', not ours
            record_raised(self.protocol, jobs, exc)
        else:
            record_returned(self.protocol, jobs, returned)
