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
Outcomes go to the server in ``results`` frames, as many as are ready at
once; they are kept until the server acknowledges them (after its commit)
and sent again after a reconnect; fencing makes a resent result harmless.
"""

from __future__ import annotations

import asyncio
import inspect
import random
import signal
import socket
import ssl
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from gpuq import logs, protocol
from gpuq.protocol import Ack, Failed, Heartbeat, Hello, Jobs, ServerDrain, Welcome, encode

log = logs.get("agent")


class PermanentError(Exception):
    """Raise from a handler for a failure that retrying cannot fix: the job goes dead."""


class AuthError(RuntimeError):
    """The server refused our token (HTTP 401): retrying will not help."""


# What a handler gets: job.id, job.kind, job.payload, job.attempt, job.lease_token
# (the protocol's own message object, so a push is parsed into it only once).
Job = protocol.JobMessage


Handler = Callable[[Job], Any]


class Agent:
    def __init__(
        self,
        url: str,
        token: str,
        kinds: Iterable[str],
        capacity: int,
        handler: Handler,
        name: str | None = None,
        *,
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
        self.completed = 0  # outcomes acknowledged by the server
        self._hello = Hello(self.name, self.kinds, capacity)  # validated below
        protocol.parse_client(encode(self._hello), 1 << 20)
        self._running: dict[int, Job] = {}
        self._unacked: dict[int, str] = {}  # job id -> encoded outcome, until the server acks
        self._outbox: list[str] = []  # encoded outcomes not sent yet on this connection
        self._outbox_ready = asyncio.Event()
        self._stopping = False
        self._stop_event = asyncio.Event()
        self._max_frame = 1 << 20  # the server's max_payload, from its welcome

    def stop(self) -> None:
        """Finish running jobs, report them, then return from ``run()``."""
        self._stopping = True
        self._stop_event.set()

    async def run(self) -> None:
        delay = self.reconnect_min
        while not self._stopping:
            try:
                await self._session()
                delay = self.reconnect_min
            except AuthError:
                raise
            except (OSError, ConnectionClosed, TimeoutError, InvalidStatus, protocol.ProtocolError) as exc:
                log.warning("agent.connection_lost", agent=self.name, error=str(exc) or type(exc).__name__,
                            retry_in=round(delay, 2))
            if self._stopping and not self._unacked:
                break
            with anyio.move_on_after(delay * random.uniform(0.5, 1.0)):
                await self._stop_event.wait()
            delay = min(delay * 2, self.reconnect_max)

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
            await ws.send(encode(self._hello))
            welcome = protocol.parse_server(await ws.recv())
            if not isinstance(welcome, Welcome):
                raise protocol.ProtocolError(protocol.UNEXPECTED, f"expected welcome, got {welcome}")
            log.info("agent.connected", agent=welcome.agent_id, url=self.url, kinds=list(self.kinds),
                     capacity=self.capacity, event_loop=logs.event_loop_name())
            self._max_frame = welcome.max_payload
            self.connected.set()
            # Outcomes the last connection did not see acked go first.
            self._outbox = list(self._unacked.values())
            self._outbox_ready.set()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._sender, ws)
                    tg.start_soon(self._heartbeats, ws, welcome.heartbeat_seconds)
                    tg.start_soon(self._stop_watcher, ws)
                    await self._reader(ws, tg)
                    tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # Report the cause (a dropped connection, usually), not the group.
                raise _first_leaf(group) from None

    async def _reader(self, ws: ClientConnection, tg: Any) -> None:
        async for frame in ws:
            msg = protocol.parse_server(frame)
            if isinstance(msg, Jobs):
                jobs = list(msg.jobs)
                for job in jobs:
                    self._running[job.id] = job
                tg.start_soon(self._run_jobs, jobs)
            elif isinstance(msg, Ack):
                for i in (*msg.accepted, *msg.rejected):
                    self._unacked.pop(i, None)
                self.completed += len(msg.accepted)
                if msg.rejected:
                    log.warning("agent.results_rejected", agent=self.name, job_ids=list(msg.rejected))
                if self._stopping and not self._running and not self._unacked:
                    await ws.close()
            elif isinstance(msg, ServerDrain):
                log.info("agent.server_draining", agent=self.name, deadline_seconds=msg.deadline_seconds)
            elif isinstance(msg, protocol.Error):
                log.warning("agent.server_error", agent=self.name, code=msg.code, message=msg.message)

    async def _run_jobs(self, jobs: list[Job]) -> None:
        """The jobs of one push, each concurrently, each reported as soon as it ends.

        One anyio task per push with a plain asyncio task per job under it
        (gather cancels them with it): an anyio task per job cost a third of
        the agent's CPU with short jobs.
        """
        is_async = inspect.iscoroutinefunction(self.handler)
        if len(jobs) == 1:
            await self._run_job(jobs[0], is_async)
        else:
            await asyncio.gather(*(self._run_job(job, is_async) for job in jobs))

    async def _run_job(self, job: Job, is_async: bool) -> None:
        try:
            if is_async:
                result = await self.handler(job)
            else:
                result = await anyio.to_thread.run_sync(self.handler, job)
            item = _outcome(job, result, self._max_frame - protocol.RESULTS_OVERHEAD)
        except PermanentError as exc:
            item = encode(Failed(job.id, job.lease_token, _summary(exc), retryable=False))
        except Exception as exc:  # the handler's failure is the job's, not ours
            item = encode(Failed(job.id, job.lease_token, _summary(exc), retryable=True))
        self._running.pop(job.id, None)
        self._unacked[job.id] = item
        self._outbox.append(item)
        self._outbox_ready.set()

    async def _sender(self, ws: ClientConnection) -> None:
        """Send every outcome that is ready in as few frames as fit.

        Jobs pushed together finish together: by the time this task runs, the
        other handlers of the batch have usually queued theirs too.
        """
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            items, self._outbox = self._outbox, []
            for frame in protocol.pack_results(items, self._max_frame):
                await ws.send(frame)  # if the connection drops, _unacked has them for the next

    async def _heartbeats(self, ws: ClientConnection, every: float) -> None:
        while True:
            await anyio.sleep(every)
            if self._running:
                await ws.send(encode(Heartbeat(tuple(self._running))))

    async def _stop_watcher(self, ws: ClientConnection) -> None:
        await self._stop_event.wait()
        await ws.send(encode(protocol.Drain()))
        log.info("agent.draining", agent=self.name, running=len(self._running))
        if not self._running and not self._unacked:
            await ws.close()

    async def run_until_signal(self) -> None:
        """``run()``, with SIGTERM/SIGINT turned into a graceful ``stop()``."""
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        self.stop()
                        return

            tg.start_soon(watch)
            await self.run()
            tg.cancel_scope.cancel()


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _outcome(job: Job, result: Any, max_size: int) -> str:
    """The encoded ``done``, or a permanent ``failed`` for a result the server could not take."""
    try:
        item = protocol.encode_done(job.id, job.lease_token, result)
    except (TypeError, ValueError) as exc:
        return encode(Failed(job.id, job.lease_token, f"result is not JSON-serializable: {exc}", retryable=False))
    if len(item) > max_size:
        return encode(Failed(job.id, job.lease_token, f"result of {len(item)} bytes is over the server's "
                             f"limit of {max_size} bytes", retryable=False))
    if "\\u0000" in item and protocol.contains_nul(result):
        return encode(Failed(job.id, job.lease_token, "result contains the character U+0000, which "
                             "PostgreSQL cannot store in jsonb", retryable=False))
    return item


def _summary(exc: BaseException, limit: int = 4000) -> str:
    """The exception and the last frames of its traceback, short enough to store."""
    text = "".join(traceback.format_exception(exc, limit=-5))
    return text[-limit:]


def _default_name() -> str:
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())
    return (host or "agent")[:64]
