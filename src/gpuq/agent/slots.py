"""What both kinds of slot share: a push's jobs go into slots (those with a slot free start now,
the others wait ready), and a slot that frees takes the next ready job at once. A batch (protocol 7)
is one unit: one slot, one batch handler call."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpuq import protocol
from gpuq.agent.batches import BatchHandler, batch_jobs
from gpuq.agent.handlers import CANCELLED_ERROR, Handler, Job
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.batches import Batch, Unit
from gpuq.protocol.receipts import Receipt

if TYPE_CHECKING:
    from anyio.abc import TaskGroup


class Slots(abc.ABC):
    """An agent's slots across its sessions: they run the handler and record each outcome in the
    protocol; ``wake`` tells the connection it has frames to send. A batch goes to ``batch_handler``;
    a single job to ``handler``, or, when there is none, to ``batch_handler`` as a batch of one."""

    # Whether a running handler ends with its connection (else it runs on, and reports once back).
    handlers_end_with_session = False

    def __init__(self, agent_protocol: AgentProtocol, handler: Handler | None, wake: Callable[[], None],
                 report_progress: Callable[[int, str], None], batch_handler: BatchHandler | None = None,
                 checkpoint: Callable[[int, str, str], Receipt] | None = None):
        self.protocol = agent_protocol
        self.handler = handler
        self.batch_handler = batch_handler
        self._wake = wake
        self._report_progress = report_progress
        self._checkpoint = checkpoint  # where job.checkpoint() goes (None: it is never stored)
        self._session_tasks: TaskGroup | None = None  # the connection's: jobs run in it
        self.loop: asyncio.AbstractEventLoop | None = None  # the agent's, once a job came

    def session_started(self, tg: TaskGroup) -> None:
        """A connection's task group: the jobs it pushes run in it, and end with it."""
        self._session_tasks = tg

    async def run_jobs(self, jobs: list[Job]) -> None:
        """The jobs of one push: those with a slot free start now, each in its slot's loop; the
        others wait ready (prefetched) for the next slot to free (``AgentProtocol.take``).

        One anyio task per push with plain asyncio tasks under it (gather
        cancels them with it): an anyio task per job cost a third of the
        agent's CPU with short jobs.
        """
        self.loop = asyncio.get_running_loop()
        for job in jobs:
            protocol.attach_reporter(job, self._report_progress)
            if self._checkpoint is not None:
                protocol.attach_checkpointer(job, self._checkpoint)
        await self.run_slots(self.protocol.take(jobs))

    async def run_slots(self, jobs: list[Unit]) -> None:
        await asyncio.gather(*(self.run_slot(job) for job in jobs))

    def batched(self, unit: Unit) -> bool:
        """Whether ``unit`` goes to the batch handler: a batch, or any job when there is no other."""
        return isinstance(unit, Batch) or self.handler is None

    def ended_before_start(self, unit: Unit) -> bool:
        """Whether ``unit`` (a job, or every item of a batch) was cancelled before its handler
        started (the server's cancel came before its slot did): then it has ended ``cancelled``
        here, and its handler must not run."""
        jobs = batch_jobs(unit)
        if not all(job.cancelled for job in jobs):
            return False
        for job in jobs:
            self.protocol.job_failed(job, CANCELLED_ERROR, retryable=False)
        return True

    @abc.abstractmethod
    async def run_slot(self, job: Unit | None) -> None:
        """Run ``job``, then at once each ready job the protocol gives this slot."""

    @abc.abstractmethod
    def preempt(self, ids: tuple[int, ...], deadline_seconds: float) -> None:
        """The server asked these running jobs to yield (the protocol marked them ``preempted``):
        stop their handlers at the deadline where a handler can be stopped."""

    @abc.abstractmethod
    def cancel(self, ids: tuple[int, ...]) -> None:
        """The server cancelled these running jobs (the protocol marked them ``cancelled``):
        interrupt their handlers where a handler can be interrupted."""

    def next_in_slot(self, ended: Unit, ran: tuple[float, float] | None) -> Unit | None:
        """The job this slot runs next, after ``ended``. A job with several devices may free them
        for several ready jobs: the others start in the session's task group."""
        jobs = self.protocol.next_jobs(ended, ran)
        if len(jobs) > 1:
            assert self._session_tasks is not None  # jobs come only within a session
            self._start_slots(self._session_tasks, jobs[1:])
        return jobs[0] if jobs else None

    @abc.abstractmethod
    def _start_slots(self, tg: TaskGroup, jobs: list[Unit]) -> None:
        """Start a slot for each of ``jobs`` in ``tg`` (from the slot that freed them)."""

    def event_loop(self) -> asyncio.AbstractEventLoop:
        assert self.loop is not None  # set before any job runs
        return self.loop
