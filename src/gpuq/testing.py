"""Test a job's handler without a server or a database.

``run_job(handler, payload)`` runs ``handler`` on one job built in memory, the way an agent runs it,
and returns the ``Outcome`` the agent would report; ``run_batch(batch_handler, payloads)`` does the
same for a batch handler (one call, an outcome per item)::

    from gpuq.testing import run_job

    def test_embed():
        outcome = run_job(embed, {"text": "hello"})
        assert outcome.done and outcome.result == {"vector": [5]}

A job that resumes (``job.resume_from``) takes the checkpoint to resume from, and the outcome
holds the checkpoints its handler made::

    outcome = run_job(train, {"steps": 100}, resume_from={"step": 50})
    assert outcome.checkpoints[-1] == {"step": 100} and outcome.stored_checkpoint == {"step": 100}

For more (cancel a job while it runs, wait for its progress, run several at once), use
``LocalAgent`` in an async test::

    async with LocalAgent(train, devices=2) as agent:
        run = agent.start({"steps": 100}, devices=(0, 1), timeout=0.5)
        await run.progressed()          # its first job.progress()
        run.cancel()                    # as `gpuq cancel` does
        outcome = await run

What is real: the job (``gpuq.agent.Job``: payload, attempt, timeout, devices, ``resume_from``,
``progress()``, ``checkpoint()``, ``cancelled``), pushed as a ``jobs`` frame and parsed as an agent
parses it; its checkpoints, sent at most once per ``checkpoint_seconds`` (``LocalAgent``'s; 0 here
by default) as the agent sends them, each stored unless the job was cancelled (its receipt says so); the agent's own slots
(``gpuq.agent.connection.handler_slots``), which run async handlers in tasks and sync ones in worker
threads, stop them at their timeout or on a cancel, and turn what they returned or raised into
outcomes; those outcomes as the agent encodes them and the server parses them (a result that is
not JSON, or is too large, fails permanently). What is not: the server, the database, sockets and
retries (``retryable`` says whether the server would retry it, while attempts remain). A timeout
may be a fraction of a second here, where the wire carries whole seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from gpuq.agent.batches import BatchHandler
from gpuq.agent.connection import handler_slots
from gpuq.agent.handlers import CANCELLED_ERROR, TIMEOUT_ERROR, Handler, Job
from gpuq.kinds import KIND_RULE, is_kind
from gpuq.protocol import (
    MAX_BATCH_ITEMS,
    Ack,
    Cancel,
    Checkpoint,
    Checkpointed,
    Device,
    DeviceFault,
    Done,
    Failed,
    Hello,
    Jobs,
    Preempt,
    Preempted,
    Release,
    Results,
    Welcome,
    encode,
    job_message,
    jobs_frame,
    parse_client,
)
from gpuq.protocol.fields import to_json
from gpuq.protocol.receipts import Receipt

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

__all__ = ["CANCELLED_ERROR", "DEFAULT_KIND", "TIMEOUT_ERROR", "LocalAgent", "Outcome", "Run", "Update",
           "run_batch", "run_job"]

DEFAULT_KIND = "test"
SIMULATED_MEMORY_MB = 81920  # what each of ``LocalAgent(devices=N)``'s stand-in GPUs says it has


@dataclass(frozen=True, slots=True)
class Update:
    """One ``job.progress()`` call of the handler (checked as the agent checks it)."""

    fraction: float
    message: str | None
    data: Any


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the agent reports for one job: ``done`` with a result, or ``failed`` with an error.

    ``result``: as the server stores it (after a JSON round trip: a tuple comes back a list).
    ``error``: the text stored as the job's ``last_error`` (the traceback's last frames, or
    ``timeout``, or ``cancelled``). ``retryable``: the server retries it while attempts remain
    (False for a ``PermanentError``). ``progress``: every ``job.progress()`` call, in order (the
    agent sends only the latest of them twice a second). ``checkpoints``: every ``job.checkpoint()``
    call's data, in order; ``stored_checkpoint``: the last one the agent sent and was stored (one
    waiting for its interval goes out before the outcome), or the job's ``resume_from`` if none. ``cancelled``: the job was cancelled while
    it ran (``Run.cancel()``): the server has ended it ``cancelled``, whatever the agent reports.
    """

    job: Job
    status: str  # "done", "failed", or "preempted" (it yielded to Run.preempt(): back to pending, not counted)
    result: Any = None
    error: str | None = None
    retryable: bool = False
    progress: tuple[Update, ...] = ()
    cancelled: bool = False
    checkpoints: tuple[Any, ...] = ()  # every job.checkpoint() call's data, in order
    stored_checkpoint: Any = None  # the last one stored: what a next attempt resumes from (None: none)

    @property
    def done(self) -> bool:
        return self.status == "done"

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @property
    def permanent(self) -> bool:
        """Failed, never to be retried: the job goes ``dead`` at once."""
        return self.failed and not self.retryable

    @property
    def timed_out(self) -> bool:
        """The agent stopped the handler at the job's timeout (a retryable failure)."""
        return self.error == TIMEOUT_ERROR


class Run:
    """One job started on a ``LocalAgent``: ``await run`` gives its ``Outcome``."""

    def __init__(self, agent: LocalAgent, job: Job):
        self.job = job  # the very object its handler gets
        self.progress: list[Update] = []  # its handler's updates so far, in order
        self.checkpoints: list[Any] = []  # its handler's checkpoints so far, in order
        self.stored_checkpoint: Any = job.resume_from  # the last one stored
        self._agent = agent
        self._loop = asyncio.get_running_loop()
        self._outcome: asyncio.Future[Outcome] = self._loop.create_future()
        self._waiters: list[asyncio.Future[None]] = []
        self._cancelled = False

    def cancel(self) -> None:
        """Cancel the job as the server does (``gpuq cancel``): an async handler is cancelled, a
        sync one sees ``job.cancelled``; a job not started yet ends at once. Nothing once it ended."""
        if not self._outcome.done():
            self._cancelled = True
            self._agent.cancel(self.job.id)

    def preempt(self, grace_seconds: float = 30.0) -> None:
        """Ask the job to yield as the server does (``gpuq preempt``); nothing once it ended."""
        if not self._outcome.done():
            self._loop.call_soon(self._agent._preempt, self.job.id, grace_seconds)

    async def progressed(self, count: int = 1) -> Update:
        """Wait for the handler's ``count``-th progress update, and return it; ``AssertionError``
        when the job ends with fewer."""
        while len(self.progress) < count:
            if self._outcome.done():
                raise AssertionError(f"job {self.job.id} ended after {len(self.progress)} progress updates, "
                                     f"not {count}: {self._outcome.result()}")
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            await waiter
        return self.progress[count - 1]

    async def checkpointed(self, count: int = 1) -> Any:
        """Wait for the handler's ``count``-th ``job.checkpoint()``, and return its data;
        ``AssertionError`` when the job ends with fewer."""
        while len(self.checkpoints) < count:
            if self._outcome.done():
                raise AssertionError(f"job {self.job.id} ended after {len(self.checkpoints)} checkpoints, "
                                     f"not {count}: {self._outcome.result()}")
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
            await waiter
        return self.checkpoints[count - 1]

    async def outcome(self) -> Outcome:
        """Wait for the job's outcome."""
        return await asyncio.shield(self._outcome)

    def __await__(self) -> Generator[Any, None, Outcome]:
        return self.outcome().__await__()

    def _reported(self, update: Update) -> None:
        """From any thread: the handler called ``job.progress()``."""
        self.progress.append(update)
        self._loop.call_soon_threadsafe(self._changed)

    def _checkpointed(self, data: Any) -> None:
        """From any thread: the handler called ``job.checkpoint()``."""
        self.checkpoints.append(data)
        self._loop.call_soon_threadsafe(self._changed)

    def _finish(self, reported: Done | Failed | Preempted | None) -> None:  # None: given back unstarted
        if isinstance(reported, Done):
            status, result, error, retryable = "done", reported.result, None, False
        elif reported is None or isinstance(reported, Preempted):
            status, result, error, retryable = "preempted", None, None, True
        else:
            status, result, error, retryable = "failed", None, reported.error, reported.retryable
        self._outcome.set_result(Outcome(self.job, status, result, error, retryable, tuple(self.progress),
                                         self._cancelled, tuple(self.checkpoints), self.stored_checkpoint))
        self._changed()

    def _changed(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class LocalAgent:
    """An agent without a connection: jobs built in memory go to its slots, and their outcomes to
    ``Run`` objects. ``handler`` takes single jobs, ``batch_handler`` batches (and single jobs when
    there is no ``handler``), as with ``gpuq.agent.Agent``; both async, or both sync. ``devices``:
    the GPUs jobs may be given, ``Device`` objects or a count of stand-ins (0, 1, ...); ``faults``:
    the devices a handler's ``DeviceError`` reported, as the server would get them (``DeviceFault``).
    ``max_payload``: the server's frame limit (a larger result fails permanently).
    ``checkpoint_seconds``: each job's checkpoints go out at most this often (the agent's option)."""

    def __init__(self, handler: Handler | None = None, batch_handler: BatchHandler | None = None, *,
                 kinds: Iterable[str] = (DEFAULT_KIND,), capacity: int = 16,
                 devices: int | Iterable[Device] = 0, max_payload: int = 1 << 20, name: str = "local",
                 checkpoint_seconds: float = 0.0):
        self.kinds = tuple(kinds)
        if isinstance(devices, int):
            devices = (Device(i, "sim", SIMULATED_MEMORY_MB) for i in range(devices))
        self.devices = tuple(devices)
        hello = Hello(name, self.kinds, capacity, devices=self.devices,
                      batch=MAX_BATCH_ITEMS if batch_handler else 0)
        self._slots = handler_slots(hello, handler, batch_handler, self._send, self._report_progress,
                                    checkpoint=self._checkpoint, checkpoint_seconds=checkpoint_seconds)
        self.protocol = self._slots.protocol
        self.max_payload = max_payload
        self._runs: dict[int, Run] = {}  # job id -> its run, every job started
        self.faults: list[DeviceFault] = []  # what the agent reported of its devices (a handler's DeviceError)
        self._last_batch = 0
        self._tasks: TaskGroup | None = None
        self._exit = contextlib.AsyncExitStack()

    async def __aenter__(self) -> LocalAgent:
        """A session as after the server's ``welcome``: jobs may come."""
        self._tasks = await self._exit.enter_async_context(anyio.create_task_group())
        self.protocol.connection_made()
        self.protocol.receive(encode(Welcome(self.protocol.hello.agent, 60.0, 15.0, self.max_payload)))
        self.protocol.frames_to_send()  # the hello: there is no server to read it
        self._slots.session_started(self._tasks)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Wait for the jobs still running (as ``Agent.stop()`` does), then end the session."""
        assert self._tasks is not None
        try:
            if exc_info[0] is None:
                for run in list(self._runs.values()):
                    await run
        finally:
            self._tasks.cancel_scope.cancel()
            suppress = await self._exit.__aexit__(*exc_info)
        return suppress

    def start(self, payload: Any = None, *, kind: str | None = None, attempt: int = 1,
              timeout: float | None = None, devices: Sequence[int] = (), job_id: int | None = None,
              resume_from: Any = None) -> Run:
        """Push one job (``payload`` None: ``{}``, as enqueued): it starts at once if a slot (or its
        devices) is free, else when one frees. ``timeout``: seconds this attempt may run;
        ``resume_from``: the checkpoint an earlier attempt stored (None: none)."""
        [run] = self._push([payload], kind, attempt, timeout, devices, None, job_id, resume_from)
        return run

    def start_batch(self, payloads: Sequence[Any], *, kind: str | None = None, attempt: int = 1,
                    timeout: float | None = None, devices: Sequence[int] = ()) -> list[Run]:
        """Push one batch: ``batch_handler`` gets these jobs in one call."""
        if not payloads:
            raise ValueError("a batch needs at least one job")
        self._last_batch += 1
        return self._push(payloads, kind, attempt, timeout, devices, self._last_batch, None)

    async def run(self, payload: Any = None, **job: Any) -> Outcome:
        """``start()`` one job and wait for its outcome."""
        return await self.start(payload, **job)

    async def run_batch(self, payloads: Sequence[Any], **job: Any) -> list[Outcome]:
        """``start_batch()`` and wait for every item's outcome, in order."""
        return [await run for run in self.start_batch(payloads, **job)]

    def cancel(self, job_id: int) -> None:
        """What the agent does on the server's ``cancel`` (``Run.cancel()`` records that it was), as
        the connection's next frame: after the jobs pushed before it have reached the slots (their
        push's task runs first: the event loop runs callbacks in order)."""
        asyncio.get_running_loop().call_soon(self._cancel, job_id)

    def _preempt(self, job_id: int, grace_seconds: float) -> None:
        """What the agent does on the server's ``preempt`` (``Run.preempt``: the connection's next frame)."""
        preempt = self.protocol.receive(encode(Preempt((job_id,), grace_seconds)))
        assert isinstance(preempt, Preempt)
        self._slots.preempt(preempt.ids, preempt.deadline_seconds)
        self._send()  # a job that had not started went back

    def _cancel(self, job_id: int) -> None:
        cancel = self.protocol.receive(encode(Cancel((job_id,))))
        assert isinstance(cancel, Cancel)
        self._slots.cancel(cancel.ids)
        self._send()  # a job that had not started has ended

    def _push(self, payloads: Sequence[Any], kind: str | None, attempt: int, timeout: float | None,
              devices: Sequence[int], batch: int | None, job_id: int | None, resume_from: Any = None) -> list[Run]:
        if self._tasks is None:
            raise RuntimeError("start jobs inside `async with LocalAgent(...) as agent:`")
        kind = self._check(kind, attempt, timeout, devices)
        if job_id is not None and job_id in self._runs:
            raise ValueError(f"job {job_id} was started already: job ids are unique")
        # The wire carries whole seconds: a shorter timeout is set on the parsed job below.
        whole = timeout is not None and timeout >= 1 and timeout == int(timeout)
        wire_timeout = int(timeout) if whole and timeout is not None else None
        first = max(self._runs, default=0) + 1 if job_id is None else job_id
        frames = [job_message(first + i, str(uuid.uuid4()), kind, to_json({} if payload is None else payload),
                              attempt, wire_timeout, tuple(devices), None, batch,
                              resume_json=None if resume_from is None else to_json(resume_from))
                  for i, payload in enumerate(payloads)]
        pushed = self.protocol.receive(jobs_frame(frames))
        assert isinstance(pushed, Jobs)
        jobs = list(pushed.jobs)
        runs = []
        for job in jobs:
            if timeout is not None and wire_timeout is None:
                object.__setattr__(job, "timeout", float(timeout))  # the protocol's own object: it stays one
            runs.append(Run(self, job))
            self._runs[job.id] = runs[-1]
        self._tasks.start_soon(self._slots.run_jobs, jobs)  # as the agent does with each push
        return runs

    def _check(self, kind: str | None, attempt: int, timeout: float | None, devices: Sequence[int]) -> str:
        """A job the server could push to this agent, or ``ValueError``; its kind."""
        kind = self.kinds[0] if kind is None else kind
        if not is_kind(kind) or kind not in self.kinds:
            raise ValueError(f"kind {kind!r}: this agent takes {', '.join(self.kinds)} ({KIND_RULE})")
        if attempt < 1:
            raise ValueError(f"attempt {attempt}: attempts count from 1")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout {timeout}: a number of seconds above 0, or None")
        if missing := set(devices) - {d.index for d in self.devices}:
            raise ValueError(f"devices {sorted(missing)}: this agent has {[d.index for d in self.devices]} "
                             "(LocalAgent(devices=N))")
        return kind

    def _send(self) -> None:
        """What the agent would send now: each outcome goes to its ``Run``, and is acknowledged (the
        server refuses a cancelled job's)."""
        for frame in self.protocol.frames_to_send():
            msg = parse_client(frame, self.max_payload)
            for job_id in msg.ids if isinstance(msg, Release) else ():  # never started: given back
                self._runs[job_id]._finish(None)
            if isinstance(msg, DeviceFault):
                self.faults.append(msg)
            if isinstance(msg, Checkpoint):
                self._store(msg)
            outcomes = msg.outcomes if isinstance(msg, Results) else ()
            for outcome in outcomes:
                self._runs[outcome.id]._finish(outcome)
            if outcomes:
                refused = {o.id for o in outcomes if self._runs[o.id]._cancelled}
                self.protocol.receive(encode(Ack(tuple(o.id for o in outcomes if o.id not in refused),
                                                 tuple(refused))))

    def _store(self, sent: Checkpoint) -> None:
        """The server's part: store each checkpoint, unless its job was cancelled (fencing)."""
        stored = [c for c in sent.items if not self._runs[c.id]._cancelled]
        for c in stored:
            self._runs[c.id].stored_checkpoint = c.data
        refused = tuple(c.seq for c in sent.items if self._runs[c.id]._cancelled)
        self.protocol.receive(encode(Checkpointed(tuple(c.seq for c in stored), refused)))

    def _checkpoint(self, job_id: int, lease_token: str, data_json: str) -> Receipt:
        """``job.checkpoint()``, from the loop or a handler's thread: recorded, then as the agent does."""
        self._runs[job_id]._checkpointed(json.loads(data_json))
        receipt, ask = self.protocol.checkpoints.add(job_id, lease_token, data_json)
        if ask:
            self._runs[job_id]._loop.call_soon_threadsafe(self._send_checkpoints)
        return receipt

    def _send_checkpoints(self) -> None:
        """As the agent's checkpoint sender: those due now, and a look again when the next is."""
        next_in = self.protocol.checkpoints.due()
        self._send()
        if next_in is not None:
            asyncio.get_running_loop().call_later(next_in, self._send_checkpoints)

    def _report_progress(self, job_id: int, item: str) -> None:
        """``job.progress()``, from the loop or a handler's thread: the update, encoded."""
        fields = json.loads(item)
        self._runs[job_id]._reported(Update(fields["fraction"], fields["message"], fields["data"]))


def run_job(handler: Handler, payload: Any = None, **job: Any) -> Outcome:
    """Run ``handler`` (async or sync) on one job, in an event loop of its own, and return the
    outcome. ``job``: ``kind``, ``attempt``, ``timeout``, ``devices``, ``job_id`` (``LocalAgent.start``)."""
    _no_running_loop("run_job")
    agent = LocalAgent(handler, **_agent_for(job))

    async def main() -> Outcome:
        async with agent:
            return await agent.run(payload, **job)

    return asyncio.run(main())


def run_batch(batch_handler: BatchHandler, payloads: Sequence[Any], **job: Any) -> list[Outcome]:
    """Run ``batch_handler`` on one batch of jobs, one per payload, in an event loop of its own, and
    return each item's outcome, in order. ``job``: as ``run_job``'s, shared by the items."""
    _no_running_loop("run_batch")
    agent = LocalAgent(batch_handler=batch_handler, **_agent_for(job))

    async def main() -> list[Outcome]:
        async with agent:
            return await agent.run_batch(payloads, **job)

    return asyncio.run(main())


def _agent_for(job: dict[str, Any]) -> dict[str, Any]:
    """The agent a job needs: one of its kind, with the devices it is given."""
    devices = job.get("devices") or ()
    return {"kinds": (job.get("kind") or DEFAULT_KIND,), "devices": max(devices) + 1 if devices else 0}


def _no_running_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name}() runs an event loop of its own: in an async test, use "
                       "`async with LocalAgent(handler) as agent: outcome = await agent.run(payload)`")

