"""The agent library: run a handler for jobs pushed by a gpuq server.

    import asyncio
    from gpuq.agent import Agent

    async def handle(job):                  # job.id, job.kind, job.payload, job.attempt
        return {"echo": job.payload}        # any JSON value: stored as the job's result

    agent = Agent("ws://127.0.0.1:8765/agent", token="s3cret", kinds=["embed"],
                  capacity=4, handler=handle)
    asyncio.run(agent.run())                # until agent.stop() or SIGTERM (see run_until_signal)

A handler that raises fails the job (retried with backoff); raise
``PermanentError`` for a failure that must not be retried. Plain (sync)
functions run in a worker thread, so they never block the connection.

Cancelled jobs (``gpuq cancel``): an async handler is cancelled (it sees
``asyncio.CancelledError``; a process it started with ``run_process`` gets
SIGTERM, then SIGKILL after a grace period); a sync handler finds
``job.cancelled`` true and should return early. A job with a timeout
(``job.timeout`` seconds) is stopped the same way when it passes, and fails
with ``timeout`` (retried while attempts remain).

Progress: ``job.progress(0.4, "epoch 2/5", {"loss": 0.31})`` from any handler,
sync or async, as often as it likes; the agent sends the latest of each job at
most twice a second and the server stores it at most once a second
(``gpuq show``, ``/jobs/ID``, ``gpuq.wait(..., on_progress=...)``).
Outcomes go to the server in ``results`` frames, as many as are ready at
once; they are kept until the server acknowledges them (after its commit)
and sent again after a reconnect; fencing makes a resent result harmless.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import socket
import ssl
import subprocess
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from gpuq import gpus, logs, protocol
from gpuq.loops import LoopBackoff, run_every
from gpuq.protocol import Ack, Cancel, Error, Hello, Jobs, ServerDrain, Welcome
from gpuq.protocol.agent_side import AgentProtocol, ThreadSafeAgentProtocol
from gpuq.signals import stop_on_signal

log = logs.get("agent")

PROGRESS_SEND_SECONDS = 0.5  # progress updates go out at most this often (the latest of each job)
# Jobs without devices held ready beyond capacity, so a freed slot starts the next at once
# (docs/design.md, "Keeping slots busy"): one hides the round trip for most jobs.
DEFAULT_PREFETCH = 1


class PermanentError(Exception):
    """Raise from a handler for a failure that retrying cannot fix: the job goes dead."""


class AuthError(RuntimeError):
    """The server refused our token (HTTP 401): retrying will not help."""


# What a handler gets: job.id, job.kind, job.payload, job.attempt, job.lease_token
# (the protocol's own message object, so a push is parsed into it only once).
Job = protocol.JobMessage


Handler = Callable[[Job], Any]


class Agent:
    """The I/O around ``AgentProtocol``: one websocket, reconnected with backoff, and the handlers."""

    def __init__(
        self,
        url: str,
        token: str,
        kinds: Iterable[str],
        capacity: int,
        handler: Handler,
        name: str | None = None,
        *,
        devices: Iterable[protocol.Device] | None = None,
        labels: Iterable[str] = (),
        models: Iterable[str] = (),
        prefetch: int = DEFAULT_PREFETCH,
        ssl_context: ssl.SSLContext | None = None,
        reconnect_min: float = 0.2,
        reconnect_max: float = 30.0,
    ):
        self.url, self.token = url, token
        self.kinds = tuple(kinds)
        self.capacity = capacity
        self.handler = handler
        self.name = name or _default_name()
        self.ssl = ssl_context
        self.reconnect_min, self.reconnect_max = reconnect_min, reconnect_max
        # asyncio events (not anyio's) so an Agent can be built before the loop runs.
        self.connected = asyncio.Event()  # set on the first welcome (handy for tests and demos)
        # The GPUs jobs may get: given, or what NVML sees (none without an NVIDIA driver).
        self.devices = gpus.detect() if devices is None else tuple(devices)
        self._usage = gpus.Usage(self.devices)
        # Sync handlers' slots run in worker threads and call the protocol from there: it locks.
        self._is_async = inspect.iscoroutinefunction(handler)
        protocol_class = AgentProtocol if self._is_async else ThreadSafeAgentProtocol
        self.protocol = protocol_class(Hello(self.name, self.kinds, capacity, devices=self.devices,
                                             labels=tuple(labels), models=tuple(models),
                                             prefetch=prefetch))  # checks the hello
        self._ready = asyncio.Event()  # the protocol has frames to send
        self._stop_event = asyncio.Event()
        self._tasks: dict[int, asyncio.Task[None]] = {}  # job id -> its async handler's task
        self._session_tasks: anyio.abc.TaskGroup | None = None  # the connection's: jobs run in it
        self._session_over = threading.Event()  # set as the session ends: sync slots stop taking jobs
        self._progress_due = asyncio.Event()  # a handler reported progress since the last send
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def completed(self) -> int:
        """Outcomes the server accepted (acknowledged after its commit)."""
        return self.protocol.completed

    def set_models(self, models: Iterable[str]) -> None:
        """The models this agent now holds warm (after loading weights): placement prefers it for
        jobs that name one. Told to the server at once, without reconnecting."""
        self.protocol.update(models=models)
        self._ready.set()

    def set_labels(self, labels: Iterable[str]) -> None:
        """Replace this agent's labels (what jobs may require), without reconnecting."""
        self.protocol.update(labels=labels)
        self._ready.set()

    def stop(self) -> None:
        """Finish running jobs, report them, then return from ``run()``."""
        self.protocol.drain()
        self._ready.set()
        self._stop_event.set()

    async def run(self) -> None:
        """Connect, run jobs, reconnect with backoff; return once stopped and everything is acked."""
        await run_every(self.reconnect_min, self._connection,
                        backoff=LoopBackoff(self.reconnect_min, self.reconnect_max),
                        errors=(OSError, ConnectionClosed, TimeoutError, InvalidStatus, protocol.ProtocolError),
                        on_error=self._connection_lost, until=self._done, wake=self._stop_event)

    def _done(self) -> bool:
        return self.protocol.draining and not self.protocol.unacked

    async def _connection(self) -> None:
        try:
            await self._session()
        finally:
            self.protocol.connection_lost()

    def _connection_lost(self, exc: BaseException, retry_in: float) -> None:
        log.warning("agent.connection_lost", agent=self.name, error=str(exc) or type(exc).__name__,
                    retry_in=retry_in)

    async def _session(self) -> None:
        try:
            ws = await connect(self.url, additional_headers={"Authorization": f"Bearer {self.token}"},
                               max_size=None, ssl=self.ssl, open_timeout=10, compression=None)
        except InvalidStatus as exc:
            if exc.response.status_code == 401:
                raise AuthError(f"the server at {self.url} refused the token (HTTP 401)") from None
            raise
        except InvalidURI as exc:
            raise AuthError(f"bad server URL {self.url!r}: {exc}") from None
        async with ws:
            self.protocol.connection_made()
            await self._send(ws)
            welcome = self.protocol.receive(await ws.recv())
            assert isinstance(welcome, Welcome)  # the protocol refuses anything else first
            log.info("agent.connected", agent=welcome.agent_id, url=self.url, kinds=list(self.kinds),
                     capacity=self.capacity, event_loop=logs.event_loop_name())
            self.connected.set()
            self._ready.set()  # outcomes the last connection did not see acked go first
            try:
                async with anyio.create_task_group() as tg:
                    self._session_tasks = tg
                    self._session_over = threading.Event()
                    tg.start_soon(_set_when_cancelled, self._session_over)
                    tg.start_soon(self._sender, ws)
                    tg.start_soon(self._heartbeats, welcome.heartbeat_seconds)
                    tg.start_soon(self._progress_sender)
                    await self._reader(ws, tg)
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # Report the cause (a dropped connection, usually), not the group.
                raise _first_leaf(group) from None

    async def _reader(self, ws: ClientConnection, tg: Any) -> None:
        if self.protocol.finished:
            await ws.close()
            return
        async for frame in ws:
            msg = self.protocol.receive(frame)
            if isinstance(msg, Jobs):
                tg.start_soon(self._run_jobs, list(msg.jobs))
            elif isinstance(msg, Ack) and msg.rejected:
                log.warning("agent.results_rejected", agent=self.name, job_ids=list(msg.rejected))
            elif isinstance(msg, Cancel):
                self._cancel(msg.ids)
            elif isinstance(msg, ServerDrain):
                log.info("agent.server_draining", agent=self.name, deadline_seconds=msg.deadline_seconds)
            elif isinstance(msg, Error):
                log.warning("agent.server_error", agent=self.name, code=msg.code, message=msg.message)
            if self.protocol.finished:
                await ws.close()

    async def _run_jobs(self, jobs: list[Job]) -> None:
        """The jobs of one push: those with a slot free start now, each in its slot's loop; the
        others wait ready (prefetched) for the next slot to free (``AgentProtocol.take``).

        One anyio task per push with plain asyncio tasks under it (gather
        cancels them with it): an anyio task per job cost a third of the
        agent's CPU with short jobs.
        """
        is_async = self._is_async
        self._loop = asyncio.get_running_loop()
        for job in jobs:
            protocol.attach_reporter(job, self._report_progress)
        await self._run_slots(self.protocol.take(jobs), is_async)

    async def _run_slots(self, jobs: list[Job], is_async: bool) -> None:
        await asyncio.gather(*(self._run_slot(job, is_async) for job in jobs))

    async def _run_slot(self, job: Job | None, is_async: bool) -> None:
        """Run ``job``, then at once each ready job the protocol gives this slot: an async handler's
        in this one task (a ``cancel`` cancels the task while that job's handler runs, and
        ``_run_job`` takes it back); a sync handler's in one worker thread (``_sync_slot``). A job
        with several devices may free them for several ready jobs: the others start in the
        session's task group."""
        if not is_async:
            if job is not None:
                await anyio.to_thread.run_sync(self._sync_slot, job)
            self._ready.set()
            return
        task = asyncio.current_task()
        while job is not None:
            self.protocol.job_started(job)
            if task is not None:
                self._tasks[job.id] = task
            # The sender runs at the handler's first await: the outcome of the job before and this
            # start go out in one frame while the handler already runs.
            self._ready.set()
            try:
                await self._run_job(job)
            finally:
                self._tasks.pop(job.id, None)
            job = self._next_in_slot(job, None, True)
        self._ready.set()  # the last outcome

    def _next_in_slot(self, ended: Job, ran: tuple[float, float] | None, is_async: bool) -> Job | None:
        jobs = self.protocol.next_jobs(ended, ran)
        if len(jobs) > 1:
            assert self._session_tasks is not None  # jobs come only within a session
            if is_async:
                self._session_tasks.start_soon(self._run_slots, jobs[1:], True)
            else:
                self._event_loop().call_soon_threadsafe(self._session_tasks.start_soon, self._run_slots, jobs[1:],
                                                        False)
        return jobs[0] if jobs else None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None  # set before any job runs
        return self._loop

    def _sync_slot(self, job: Job) -> None:
        """A sync handler's slot, all in one worker thread: each job runs, is reported, and the next
        ready one starts here at once. The event loop is only woken to send (the outcome and the
        next start in one frame), never in the way between two jobs: a hop through it cost each
        job two thread wake-ups. Ends when the session does, after the running handler returns."""
        wake = functools.partial(self._event_loop().call_soon_threadsafe, self._ready.set)
        over = self._session_over  # this session's: after a reconnect the next one has its own slots
        next_job: Job | None = job
        while next_job is not None and not over.is_set():
            self.protocol.job_started(next_job)
            wake()
            ran = self._run_sync_job(next_job)
            if over.is_set():
                break  # the connection is gone: its ready jobs went back to the server
            next_job = self._next_in_slot(next_job, ran, False)
        wake()  # the last outcome

    def _run_sync_job(self, job: Job) -> tuple[float, float]:
        """Call the sync handler (in the slot's thread) and record its outcome; its (start, end)."""
        expired: list[bool] = []
        timers: list[asyncio.TimerHandle] = []
        loop, timeout = self._event_loop(), job.timeout
        if timeout is not None:  # a thread cannot be interrupted: the flag asks it to stop
            loop.call_soon_threadsafe(lambda: timers.append(loop.call_later(timeout, _expire, job, expired)))
        start = self.protocol.clock()
        try:
            result = self.handler(job)
        except PermanentError as exc:
            self.protocol.job_failed(job, _summary(exc), retryable=False)
        except Exception as exc:  # the handler's failure is the job's, not ours
            self.protocol.job_failed(job, _summary(exc), retryable=True)
        else:
            if expired:
                self.protocol.job_failed(job, "timeout", retryable=True)
            else:
                self.protocol.job_done(job, result)
        finally:
            end = self.protocol.clock()
            if timeout is not None:
                loop.call_soon_threadsafe(_cancel_all, timers)
        return start, end

    def _cancel(self, ids: tuple[int, ...]) -> None:
        """The server cancelled these running jobs (the protocol marked them ``cancelled``)."""
        for job_id in ids:
            if (task := self._tasks.get(job_id)) is not None:
                task.cancel()
        if ids:
            log.info("agent.jobs_cancelled", agent=self.name, job_ids=list(ids))

    async def _run_job(self, job: Job) -> None:
        """Run an async handler under the job's timeout and record its outcome."""
        limit = asyncio.timeout(job.timeout)  # None: no limit
        try:
            async with limit:
                result = await self.handler(job)
        except TimeoutError as exc:
            if limit.expired():
                self.protocol.job_failed(job, "timeout", retryable=True)
            else:  # the handler's own
                self.protocol.job_failed(job, _summary(exc), retryable=True)
        except asyncio.CancelledError:
            if not job.cancelled:
                raise  # the agent is stopping, not the job
            if (task := asyncio.current_task()) is not None:
                task.uncancel()  # the slot's task goes on with its next job
            self.protocol.job_failed(job, "cancelled", retryable=False)
        except PermanentError as exc:
            self.protocol.job_failed(job, _summary(exc), retryable=False)
        except Exception as exc:  # the handler's failure is the job's, not ours
            self.protocol.job_failed(job, _summary(exc), retryable=True)
        else:
            self.protocol.job_done(job, result)

    async def _sender(self, ws: ClientConnection) -> None:
        """Send what the protocol queued, in as few frames as fit.

        Jobs pushed together finish together: by the time this task runs, the
        other handlers of the batch have usually queued theirs too.
        """
        while True:
            await self._ready.wait()
            self._ready.clear()
            await self._send(ws)  # if the connection drops, the protocol keeps them for the next
            if self.protocol.finished:
                await ws.close()

    async def _send(self, ws: ClientConnection) -> None:
        for frame in self.protocol.frames_to_send():
            await ws.send(frame)

    def _report_progress(self, job_id: int, item: str) -> None:
        """``job.progress()``, from the loop or a handler's thread: keep it; wake the sender once."""
        if self.protocol.progress(job_id, item) and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._progress_due.set)
            except RuntimeError:  # the loop has closed: the agent is gone, and so is the job
                pass

    async def _progress_sender(self) -> None:
        """Send the latest progress of each job, at most every ``PROGRESS_SEND_SECONDS``."""
        while True:
            await self._progress_due.wait()
            self._progress_due.clear()
            self.protocol.send_progress()
            self._ready.set()
            await anyio.sleep(PROGRESS_SEND_SECONDS)

    async def _heartbeats(self, every: float) -> None:
        while True:
            await anyio.sleep(every)
            self.protocol.heartbeat(self._usage.read())
            self._ready.set()

    async def run_until_signal(self) -> None:
        """``run()``, with SIGTERM/SIGINT turned into a graceful ``stop()``."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signal, self.stop)
            await self.run()
            tg.cancel_scope.cancel()


async def run_process(*argv: str, grace_seconds: float = 10.0, devices: Iterable[int] | None = None,
                      **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """Run a program from an async handler and wait for it; its output is captured.

    ``devices`` (pass ``job.devices``): the process sees only those GPUs, through
    ``CUDA_VISIBLE_DEVICES`` in its environment, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    so that CUDA numbers them as NVML does (its default puts the fastest first);
    ``env=`` still applies to the rest.
    If the handler is cancelled (``gpuq cancel``, or the agent stopping), the
    process gets SIGTERM, then SIGKILL if it is still there after
    ``grace_seconds``, before the cancellation goes on.
    """
    if devices is not None:
        kwargs["env"] = {**(kwargs.get("env") or os.environ), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                         "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:
        await _stop_process(proc, grace_seconds)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode or 0, out, err)


async def _stop_process(proc: asyncio.subprocess.Process, grace_seconds: float) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.shield(asyncio.wait_for(proc.wait(), grace_seconds))
    except TimeoutError:
        proc.kill()
        await asyncio.shield(proc.wait())


def _cancel_all(timers: list[asyncio.TimerHandle]) -> None:
    for t in timers:
        t.cancel()


async def _set_when_cancelled(flag: threading.Event) -> None:
    try:
        await anyio.sleep_forever()
    finally:
        flag.set()


def _expire(job: Job, expired: list[bool]) -> None:
    """A sync handler's timeout: it sees ``job.cancelled``; whatever it returns, the attempt failed."""
    expired.append(True)
    protocol.mark_cancelled(job)


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _summary(exc: BaseException, limit: int = 4000) -> str:
    """The exception and the last frames of its traceback, short enough to store."""
    text = "".join(traceback.format_exception(exc, limit=-5))
    return text[-limit:]


def _default_name() -> str:
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())
    return (host or "agent")[:64]
