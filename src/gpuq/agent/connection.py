"""The connection loop: one websocket to the server, reconnected with backoff, pumping frames
through ``AgentProtocol``; the reader hands pushed jobs to the slots (``async_slots``,
``thread_slots``), the senders send outcomes, progress, checkpoints and heartbeats."""

from __future__ import annotations

import asyncio
import inspect
import math
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from gpuq import gpus, logs, protocol
from gpuq.agent.async_slots import AsyncSlots
from gpuq.agent.batches import BatchHandler
from gpuq.agent.handlers import Handler
from gpuq.agent.slots import Slots
from gpuq.agent.thread_slots import ThreadSlots
from gpuq.loops import LoopBackoff, Outage, run_every
from gpuq.protocol import Ack, Cancel, Error, Hello, Jobs, Preempt, ServerDrain, Welcome
from gpuq.protocol.agent_side import AgentProtocol, ThreadSafeAgentProtocol
from gpuq.protocol.checkpoints import DEFAULT_CHECKPOINT_SECONDS
from gpuq.protocol.receipts import Receipt
from gpuq.signals import stop_on_signal

log = logs.get("agent")

PROGRESS_SEND_SECONDS = 0.5  # progress updates go out at most this often (the latest of each job)
# Jobs without devices held ready beyond capacity, so a freed slot starts the next at once
# (docs/design.md, "Keeping slots busy"): one hides the round trip for most jobs.
DEFAULT_PREFETCH = 1
# Jobs one batch handler call takes at most (hello.batch), with a batch handler: the server sends
# smaller batches when fewer jobs wait (its batching policy decides).
DEFAULT_MAX_BATCH = 64
# Of an interruption's notice (or a SIGTERM's drain deadline), what is kept for reporting: preemptible
# jobs yield within the rest (a quarter of a short notice).
INTERRUPTION_MARGIN_SECONDS = 5.0


def interruption_margin(notice_seconds: float) -> float:
    return min(INTERRUPTION_MARGIN_SECONDS, notice_seconds / 4)


class AuthError(RuntimeError):
    """The server refused our token (HTTP 401): retrying will not help."""


class Agent:
    """The I/O around ``AgentProtocol``: one websocket, reconnected with backoff, and the handlers."""

    def __init__(
        self,
        url: str,
        token: str,
        kinds: Iterable[str],
        capacity: int,
        handler: Handler | None = None,
        name: str | None = None,
        *,
        devices: Iterable[protocol.Device] | None = None,
        labels: Iterable[str] = (),
        models: Iterable[str] = (),
        prefetch: int = DEFAULT_PREFETCH,
        ssl_context: ssl.SSLContext | None = None,
        reconnect_min: float = 0.2,
        reconnect_max: float = 30.0,
        drain_seconds: float | None = None,
        batch_handler: BatchHandler | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        interruption_notice: float | None = None,
        checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS,
    ):
        self.url, self.token = url, token
        self.kinds = tuple(kinds)
        self.capacity = capacity
        self.name = name or _default_name()
        self.ssl = ssl_context
        self.reconnect_min, self.reconnect_max = reconnect_min, reconnect_max
        # asyncio events (not anyio's) so an Agent can be built before the loop runs.
        self.connected = asyncio.Event()  # set on the first welcome (handy for tests and demos)
        # The GPUs jobs may get: given, or what NVML sees (none without an NVIDIA driver).
        self.devices = gpus.detect() if devices is None else tuple(devices)
        self._usage = gpus.Usage(self.devices)
        self._faults = gpus.Faults(self.devices)  # Xid and ECC errors, where NVML reads them
        self._ready = asyncio.Event()  # the protocol has frames to send
        self._stop_event = asyncio.Event()
        self._reconnect_now = _Nudge()  # stop() cuts the current reconnect wait short, not the later ones
        # On SIGTERM (run_until_signal), stop with this deadline; None: wait for every report.
        self.drain_seconds = drain_seconds
        self.interruption_notice = interruption_notice  # on SIGTERM, interrupt() with it (None: a stop)
        self._deadline: float | None = None  # monotonic: run() returns by then (stop(deadline_seconds))
        self._running: anyio.CancelScope | None = None  # run()'s, while it runs
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._progress_due = asyncio.Event()  # a handler reported progress since the last send
        self._checkpoint_due = asyncio.Event()  # a handler checkpointed since the last look
        hello = Hello(self.name, self.kinds, capacity, devices=self.devices, labels=tuple(labels),
                      models=tuple(models), prefetch=prefetch, batch=max_batch if batch_handler else 0)
        self._slots = handler_slots(hello, handler, batch_handler, self._ready.set, self._report_progress,
                                    checkpoint=self._checkpoint, checkpoint_seconds=checkpoint_seconds)
        self.protocol = self._slots.protocol

    @property
    def handler(self) -> Handler | None:
        """The handler the slots run (replaceable, by one of the same kind: async or sync)."""
        return self._slots.handler

    @handler.setter
    def handler(self, handler: Handler | None) -> None:
        self._slots.handler = handler

    @property
    def batch_handler(self) -> BatchHandler | None:
        """The batch handler the slots run (replaceable, by one of the same kind: async or sync)."""
        return self._slots.batch_handler

    @batch_handler.setter
    def batch_handler(self, batch_handler: BatchHandler | None) -> None:
        self._slots.batch_handler = batch_handler

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

    def stop(self, deadline_seconds: float | None = None) -> None:
        """Finish running jobs, report them, then return from ``run()``. With ``deadline_seconds``,
        return by then at the latest: what still runs or is unreported is logged (``agent.unreported``)
        and left to the server, which gives running jobs back when the connection ends. While the
        server is unreachable the agent keeps trying with its reconnect backoff, never faster."""
        self.protocol.drain()
        self._ready.set()
        self._checkpoint_due.set()  # those waiting for their interval go now
        self._reconnect_now.set()  # try to report now, not after the current backoff
        if deadline_seconds is not None:
            at = time.monotonic() + deadline_seconds
            self._deadline = at if self._deadline is None else min(self._deadline, at)
            self._arm_deadline()
        self._stop_event.set()

    def interrupt(self, notice_seconds: float) -> None:
        """This machine goes away in ``notice_seconds`` (a spot interruption; call it on the agent's loop):
        drain, give back the ready jobs, have running preemptible jobs yield within the notice less
        ``interruption_margin``, and return from ``run()`` by the notice."""
        within = max(0.0, notice_seconds - interruption_margin(notice_seconds))
        log.info("agent.interrupted", agent=self.name, notice_seconds=notice_seconds, yield_within=within,
                 running=len(self.protocol.running))
        self.stop(notice_seconds)
        self._yield_running(within)

    def _terminated(self) -> None:
        """SIGTERM: ``interrupt()``, or a stop in which preemptible jobs yield (by their grace, or the drain's)."""
        if self.interruption_notice is not None:
            self.interrupt(self.interruption_notice)
            return
        self.stop(self.drain_seconds)
        drain = self.drain_seconds
        self._yield_running(None if drain is None else max(0.0, drain - interruption_margin(drain)))

    def _yield_running(self, within: float | None) -> None:
        if ids := self.protocol.yield_running(within):
            self._slots.preempt(ids, within or 0.0)
        self._ready.set()

    async def run(self) -> None:
        """Connect, run jobs, reconnect with backoff; return once stopped and everything is acked
        (or at the stop's deadline)."""
        with anyio.CancelScope() as self._running:
            self._arm_deadline()
            try:
                await run_every(self.reconnect_min, self._connection,
                                backoff=LoopBackoff(self.reconnect_min, self.reconnect_max),
                                errors=(OSError, ConnectionClosed, TimeoutError, InvalidHandshake,
                                        protocol.ProtocolError),
                                outage=Outage(log, "agent.connection_lost", agent=self.name),
                                until=self._done, wake=self._reconnect_now)
            finally:
                self._running = None
                if self._deadline_timer is not None:
                    self._deadline_timer.cancel()

    def _arm_deadline(self) -> None:
        """While run() runs and a stop gave a deadline, end run() then."""
        if self._running is None or self._deadline is None:
            return
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        loop = asyncio.get_running_loop()
        self._deadline_timer = loop.call_later(max(0.0, self._deadline - time.monotonic()), self._give_up)

    def _give_up(self) -> None:
        if self._running is None or self.protocol.finished:
            return
        log.error("agent.unreported", agent=self.name, running=sorted(self.protocol.running),
                  unacked=sorted(self.protocol.unacked), reason="the stop's deadline passed")
        self._running.cancel()

    def _done(self) -> bool:
        return self.protocol.draining and not self.protocol.unacked

    async def _connection(self) -> None:
        try:
            await self._session()
        finally:  # the server takes back what it has not seen reported
            self.protocol.connection_lost(self._slots.handlers_end_with_session)

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
                    self._slots.session_started(tg)
                    tg.start_soon(self._sender, ws)
                    tg.start_soon(self._heartbeats, welcome.heartbeat_seconds)
                    tg.start_soon(self._progress_sender)
                    tg.start_soon(self._checkpoint_sender)
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
                tg.start_soon(self._slots.run_jobs, list(msg.jobs))
            elif isinstance(msg, Ack) and msg.rejected:
                log.warning("agent.results_rejected", agent=self.name, job_ids=list(msg.rejected))
            elif isinstance(msg, Cancel):  # a ready job it names ended here: its report goes now
                self._cancel(msg.ids)
                self._ready.set()
            elif isinstance(msg, Preempt):  # the protocol marked them; jobs held ready went back (release)
                self._slots.preempt(msg.ids, msg.deadline_seconds)
                self._ready.set()
            elif isinstance(msg, ServerDrain):
                log.info("agent.server_draining", agent=self.name, deadline_seconds=msg.deadline_seconds)
            elif isinstance(msg, Error):
                log.warning("agent.server_error", agent=self.name, code=msg.code, message=msg.message)
            if self.protocol.finished:
                await ws.close()

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

    def _cancel(self, ids: tuple[int, ...]) -> None:
        """The server cancelled these running jobs (the protocol marked them ``cancelled``)."""
        self._slots.cancel(ids)
        if ids:
            log.info("agent.jobs_cancelled", agent=self.name, job_ids=list(ids))

    def _report_progress(self, job_id: int, item: str) -> None:
        """``job.progress()``, from the loop or a handler's thread: keep it; wake the sender once."""
        loop = self._slots.loop
        if self.protocol.progress(job_id, item) and loop is not None:
            try:
                loop.call_soon_threadsafe(self._progress_due.set)
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

    def _checkpoint(self, job_id: int, lease_token: str, data_json: str) -> Receipt:
        """``job.checkpoint()``, from the loop or a handler's thread: keep it; wake the sender once."""
        receipt, ask = self.protocol.checkpoints.add(job_id, lease_token, data_json)
        if ask and (loop := self._slots.loop) is not None:
            try:
                loop.call_soon_threadsafe(self._checkpoint_due.set)
            except RuntimeError:  # the loop has closed: the agent is gone, and so is the job
                pass
        return receipt

    async def _checkpoint_sender(self) -> None:
        """Send each job's checkpoint when its interval lapses (the protocol says when that is)."""
        while True:
            self._checkpoint_due.clear()
            next_in = self.protocol.checkpoints.due()
            self._ready.set()
            with anyio.move_on_after(math.inf if next_in is None else next_in):
                await self._checkpoint_due.wait()

    async def _heartbeats(self, every: float) -> None:
        while True:
            await anyio.sleep(every)
            for index, source, error in self._faults.read():
                log.warning("agent.device_fault", agent=self.name, device=index, source=source, error=error)
                self.protocol.device_fault((index,), source, error)
            self.protocol.heartbeat(self._usage.read())
            self._ready.set()

    async def run_until_signal(self) -> None:
        """``run()``, with SIGTERM/SIGINT turned into a graceful stop (``_terminated``)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signal, self._terminated)
            await self.run()
            tg.cancel_scope.cancel()


class _Nudge:
    """An event that wakes one wait: each ``set()`` cuts short the wait under way (or the next one)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


def handler_slots(hello: Hello, handler: Handler | None, batch_handler: BatchHandler | None,
                  wake: Callable[[], None], report_progress: Callable[[int, str], None], *,
                  checkpoint: Callable[[int, str, str], Receipt] | None = None,
                  checkpoint_seconds: float = DEFAULT_CHECKPOINT_SECONDS) -> Slots:
    """The slots that run these handlers, with the protocol they record outcomes in
    (``slots.protocol``, checking ``hello``): async handlers run in asyncio tasks, sync ones in
    worker threads, which call the protocol from there (so it locks). ``wake``: frames to send;
    ``report_progress``: where ``job.progress()`` goes; ``checkpoint``: where ``job.checkpoint()``
    goes (None: nowhere), each job's at most once per ``checkpoint_seconds``. ``ValueError`` for
    neither handler, or one of each kind, or a negative interval. ``Agent`` and ``gpuq.testing``
    both run handlers in these."""
    is_async = _all_async(handler, batch_handler)
    protocol_class = AgentProtocol if is_async else ThreadSafeAgentProtocol
    slots_class = AsyncSlots if is_async else ThreadSlots
    agent_protocol = protocol_class(hello)
    agent_protocol.checkpoints.interval = checkpoint_seconds
    return slots_class(agent_protocol, handler, wake, report_progress, batch_handler, checkpoint)


def _is_async(f: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(f) or (callable(f) and inspect.iscoroutinefunction(type(f).__call__))


def _all_async(handler: Handler | None, batch_handler: BatchHandler | None) -> bool:
    """Whether the handlers are async (else they are sync, and run in worker threads): both one or
    the other. ``ValueError`` for neither, or one of each."""
    given = [f for f in (handler, batch_handler) if f is not None]
    if not given:
        raise ValueError("an agent needs a handler, a batch_handler, or both")
    kinds = {_is_async(f) for f in given}
    if len(kinds) > 1:
        raise ValueError("handler and batch_handler must both be async, or both sync")
    return kinds.pop()


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _default_name() -> str:
    host = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())
    return (host or "agent")[:64]
