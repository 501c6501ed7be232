"""The agent's side of the protocol, as a state machine without I/O.

One ``AgentProtocol`` lives as long as the agent, across reconnects: the jobs
it runs and the outcomes the server has not acknowledged survive a dropped
connection. ``connection_made()`` starts each connection with ``hello``; the
I/O layer (``gpuq.agent``) feeds frames to ``receive()`` and sends what
``frames_to_send()`` returns. The rules:

- the first frame from the server must be ``welcome``; then the outcomes not
  yet acknowledged are sent again (fencing makes a repeat harmless);
- an outcome is kept until an ``ack`` names its job;
- outcomes ready at once go out in as few ``results`` frames as fit
  ``max_payload``; a result the server could not take (not JSON, too large,
  U+0000) becomes a permanent ``failed`` instead;
- after ``drain()`` the agent is ``finished`` once nothing runs and every
  outcome is acknowledged;
- a ``cancel`` marks the named running jobs ``cancelled`` (the I/O layer
  stops their handlers); their outcomes are reported as usual, and fenced;
- ``progress`` keeps only the latest update of each running job, from any
  thread, until ``send_progress()`` (the I/O layer calls it at most twice a
  second); a job's outcome drops its unsent update, and updates are not kept
  across a reconnect (the new connection does not hold those jobs);
- checkpoints (version 9): ``checkpoints`` (a ``CheckpointQueue``: its
  rules) keeps each running job's latest, from any thread, and makes those
  whose interval lapsed ready (``checkpoints.due()``); ``frames_to_send``
  sends them before anything else, so a job's outcome (or any message that
  ends its attempt), which makes its waiting one ready, follows it; ``checkpointed`` resolves the receipts, and a lost
  connection resolves the rest False;
- ``update()`` changes labels or warm models: sent at once when connected,
  and the next ``hello`` carries them, so a reconnect never loses them;
- slots (version 5, ``hello.prefetch``): at most ``capacity`` jobs without
  devices run at once; ``take()`` says which pushed jobs start now, the rest
  wait *ready* (prefetched) and ``next_jobs()`` hands the next one to a slot
  the moment its job ends. A job with devices starts when they are free
  (version 6: the server may push one for busy devices, to start behind the
  job running there), first in, first out on each device. Every start is told to the server (``started`` ids, in
  the next ``results`` frame when there is one). A ready job that is
  cancelled ends at once as cancelled; on ``drain()`` the ready jobs are given
  back (``release``); a lost connection drops them (the server took them back).
- batches (version 7, ``hello.batch`` above 0): the jobs of one push with the
  same ``batch`` number run in one handler call and take one slot (or their
  devices once); a push that breaks a batch's rules (``batches.check_batches``)
  is a ``ProtocolError`` before anything of it is kept. What a slot runs is a
  *unit*: a job or a ``Batch``. A cancelled item of a ready batch ends at once
  and the batch goes on without it; one of a running batch is only marked
  (the slot reports it ``cancelled`` when the batch handler returns).
- preemption (version 9): a job pushed with ``grace_seconds`` is preemptible;
  ``preempt`` marks the named running jobs ``preempted`` with a deadline (the
  I/O layer stops them then) and gives back (``release``) those that wait
  ready; ``yield_running`` marks every preemptible one (the agent is leaving);
  ``job_preempted`` reports one that yielded.
- device faults (version 9): ``device_fault()`` says devices of the hello are
  bad (a handler's ``DeviceError``, an Xid or ECC error NVML read); kept
  until a connection of version 9 is open (at most ``MAX_KEPT_FAULTS``), never
  sent on an earlier one.
- ``ThreadSafeAgentProtocol``: the same, every method that changes state
  under one lock, for an agent whose sync handlers' slots run in worker
  threads and call ``job_started``, ``job_done``/``job_failed`` and
  ``next_jobs`` from there (an async agent pays nothing for it).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from gpuq.protocol.batches import Batch, Unit, check_batches, job_ids, units
from gpuq.protocol.checkpoints import DEFAULT_CHECKPOINT_SECONDS, CheckpointQueue
from gpuq.protocol.codes import (
    BATCH_SINCE,
    CHECKPOINT_SINCE,
    PREFETCH_SINCE,
    QUARANTINE_SINCE,
    SLOTS_SINCE,
    ErrorCode,
    ProtocolError,
)
from gpuq.protocol.describe import DeviceUsage
from gpuq.protocol.frames import (
    RESULTS_OVERHEAD,
    done_or_failed,
    encode,
    fault_frame,
    pack_progress,
    pack_results,
)
from gpuq.protocol.messages import (
    Ack,
    Cancel,
    Checkpointed,
    Drain,
    Failed,
    Heartbeat,
    Hello,
    JobMessage,
    Jobs,
    Preempt,
    Release,
    ServerMessage,
    Update,
    Welcome,
    mark_cancelled,
)
from gpuq.protocol.parse import parse_client, parse_server
from gpuq.protocol.slots import SlotClock
from gpuq.protocol.yielding import Yielding

MAX_KEPT_FAULTS = 64  # device faults kept while no version 9 connection is open; more are dropped


class State(Enum):
    DISCONNECTED = "disconnected"
    AWAITING_WELCOME = "awaiting_welcome"
    OPEN = "open"


class AgentProtocol(Yielding):
    def __init__(self, hello: Hello, clock: Callable[[], float] = time.monotonic):
        parse_client(encode(hello), 1 << 20)  # the server's rules, checked before connecting
        self.hello = hello
        self.agent_id: str | None = None  # this connection's id, from its welcome (the jobs' leased_by)
        self.clock = clock
        self.slots: SlotClock | None = None  # this connection's count (version 6)
        self.state = State.DISCONNECTED
        self.running: dict[int, JobMessage] = {}
        self.unacked: dict[int, str] = {}  # job id -> encoded outcome, until the server acks
        self.completed = 0  # outcomes the server accepted
        self.draining = False
        self.max_frame = 1 << 20  # the server's max_payload, from its welcome
        self._control: list[str] = []
        self._outcomes: list[str] = []  # encoded outcomes not sent yet on this connection
        # job id -> its latest progress update (encoded) not sent yet; written from handlers' threads.
        self._progress: dict[int, str] = {}
        self._progress_asked = False  # progress() has asked for a send_progress() not yet done
        self._progress_lock = threading.Lock()
        self.checkpoints = CheckpointQueue(DEFAULT_CHECKPOINT_SECONDS, clock)  # version 9; any thread may add
        self.ready: deque[Unit] = deque()  # pushed jobs (and batches) without devices waiting for a slot
        self.ready_gpu: list[Unit] = []  # pushed jobs (and batches) waiting for their devices, in push order
        self._slots_busy = 0  # jobs without devices running now (at most capacity)
        self._devices_busy: set[int] = set()  # devices a running job holds
        self._started: list[int] = []  # started since the last frames_to_send (told in the next)
        self._speaks_started = False  # this connection's version has ``started`` (5)
        self._max_batch = 0  # this connection's: the hello's ``batch`` from version 7, else 0
        self._faults, self._speaks_faults = list[str](), False  # device_fault frames kept; version 9 connection?

    @property
    def finished(self) -> bool:
        """Draining, nothing running, every outcome acknowledged: the agent may leave."""
        return self.draining and not self.running and not self.unacked

    # -- connection ----------------------------------------------------------

    def connection_made(self) -> None:
        self.state = State.AWAITING_WELCOME
        self._control, self._outcomes = [encode(self.hello)], []

    def connection_lost(self, handlers_stopped: bool = False) -> None:
        """The server took back every job it had not seen reported; the ready ones are not ours now,
        nor, with ``handlers_stopped`` (async handlers end with their connection), the running ones."""
        self.state = State.DISCONNECTED
        for job_id in list(self.running) if handlers_stopped else [i for u in self.waiting for i in job_ids(u)]:
            self.running.pop(job_id, None)
            self._progress.pop(job_id, None)
        self.checkpoints.lost(job.lease_token for job in self.running.values())
        self.ready.clear()
        self.ready_gpu = []
        self._slots_busy = 0
        self._devices_busy = set()
        self._started = []

    def receive(self, frame: str | bytes) -> ServerMessage:
        """Take one frame from the server; what it says is the event (``Welcome``, ``Jobs``,
        ``Ack``, ``ServerDrain``, ``Error``, or ``Cancel`` naming the jobs still running), its
        bookkeeping already done."""
        msg = parse_server(frame)
        if self.state is State.AWAITING_WELCOME:
            if not isinstance(msg, Welcome):
                raise ProtocolError(ErrorCode.UNEXPECTED, f"expected welcome, got {msg}")
            self.state, self.max_frame, self.agent_id = State.OPEN, msg.max_payload, msg.agent_id
            self._speaks_started, self._speaks_faults = msg.protocol >= PREFETCH_SINCE, msg.protocol >= QUARANTINE_SINCE
            self._max_batch = self.hello.batch if msg.protocol >= BATCH_SINCE else 0
            self.checkpoints.enabled = msg.protocol >= CHECKPOINT_SINCE
            self.slots = None
            if msg.protocol >= SLOTS_SINCE:
                self.slots = SlotClock(self.hello.capacity, (d.index for d in self.hello.devices), self.clock())
            self._outcomes = list(self.unacked.values())  # what the last connection did not see acked
            if self.draining:
                self._control.append(encode(Drain()))
            return msg
        if isinstance(msg, Welcome):
            raise ProtocolError(ErrorCode.UNEXPECTED, f"a second welcome: {msg}")
        if isinstance(msg, Jobs):
            check_batches(msg.jobs, self._max_batch)  # before anything of the push is kept
            for job in msg.jobs:
                self.running[job.id] = job
            if self.slots is not None:
                now = self.clock()
                for unit in units(msg.jobs):
                    self.slots.pushed(unit.id, unit.queued_ms, now)
        elif isinstance(msg, Ack):
            for i in (*msg.accepted, *msg.rejected):
                self.unacked.pop(i, None)
            self.completed += len(msg.accepted)
        elif isinstance(msg, Checkpointed):
            self.checkpoints.answered(msg.stored, msg.refused)
        elif isinstance(msg, Cancel):
            running = [self.running[i] for i in msg.ids if i in self.running]
            for job in running:
                mark_cancelled(job)
            waiting = self._end_waiting({job.id for job in running}) if running else set()
            return Cancel(tuple(job.id for job in running if job.id not in waiting))
        elif isinstance(msg, Preempt):
            return self._preempt(msg)
        return msg

    def _end_waiting(self, cancelled: set[int]) -> set[int]:
        """Cancelled jobs that never started end here, before they start (a ready batch goes on
        without them, or goes when none is left): their ids."""
        ended: list[JobMessage] = []

        def still_waits(unit: Unit) -> bool:
            if isinstance(unit, Batch):
                ended.extend(j for j in unit.jobs if j.id in cancelled)
                unit.jobs = [j for j in unit.jobs if j.id not in cancelled]
                gone = not unit.jobs
            elif gone := unit.id in cancelled:
                ended.append(unit)
            if gone:
                self._forget(unit)
            return not gone

        self.ready = deque(unit for unit in self.ready if still_waits(unit))
        self.ready_gpu = [unit for unit in self.ready_gpu if still_waits(unit)]
        for job in ended:
            self.job_failed(job, "cancelled", retryable=False)
        return {job.id for job in ended}

    # -- slots ---------------------------------------------------------------

    @property
    def waiting(self) -> list[Unit]:
        """The pushed jobs (and batches) not started yet (prefetched)."""
        return [*self.ready, *self.ready_gpu]

    def take(self, jobs: Iterable[JobMessage]) -> list[Unit]:
        """Pushed jobs to start now, each batch as one ``Batch``; the others wait ready for
        ``next_jobs()`` (or, pushed while the agent drains, go back at once; all of them once it leaves)."""
        if self.leaving:
            self._give_back(list(units(jobs)))
            return []
        now: list[Unit] = []
        for job in units(jobs):
            if job.devices:
                self.ready_gpu.append(job)
            elif self._slots_busy < self.hello.capacity:
                self._slots_busy += 1
                now.append(job)
                if self.slots is not None:
                    self.slots.assigned(job.id, (), self.clock())
            else:
                self.ready.append(job)
        if self.ready_gpu:
            now.extend(self._devices_freed())
        if self.draining:
            self._give_back(self.waiting)
        return now

    def job_started(self, job: Unit) -> None:
        """Its handler starts now: the server is told (with the next frame), each item of a batch."""
        if self._speaks_started:
            self._started.extend(job_ids(job))
        if self.slots is not None:
            self.slots.started(job.id, self.clock())

    def next_jobs(self, ended: Unit, ran: tuple[float, float] | None = None) -> list[Unit]:
        """``ended``'s handler returned (its outcome is queued): the jobs to start now, the first in
        its slot. A job without devices frees a slot for the next ready one; a job with devices
        frees them for the ready jobs that wait on them (several, when it had several). ``ran``:
        the handler's own (start, end) on ``clock``, when the I/O layer timed it (in a thread)."""
        clock = self.slots
        if clock is not None:
            now = ran[1] if ran else self.clock()
            clock.ended(ended.id, ended.devices, now, ran[0] if ran else None)
        if ended.devices:
            self._devices_busy.difference_update(ended.devices)
            return self._devices_freed() if self.ready_gpu else []
        if self.ready and not self.draining and self.state is State.OPEN:
            job = self.ready.popleft()
            if clock is not None:
                clock.assigned(job.id, (), now, freed=now)
            return [job]
        self._slots_busy = max(0, self._slots_busy - 1)
        if clock is not None:
            clock.slot_freed(now)
        return []

    def _devices_freed(self) -> list[Unit]:
        """Ready jobs with devices that may start now, in push order: each device runs its jobs first
        in, first out, so a multi-GPU job is never overtaken on the devices it waits for."""
        if self.draining or self.state is not State.OPEN:
            return []
        now: list[Unit] = []
        blocked = set(self._devices_busy)
        for job in self.ready_gpu:
            if blocked.isdisjoint(job.devices):
                self._devices_busy.update(job.devices)
                now.append(job)
            blocked.update(job.devices)
        if now:
            started = {job.id for job in now}
            self.ready_gpu = [job for job in self.ready_gpu if job.id not in started]
            if self.slots is not None:
                at = self.clock()
                for job in now:
                    self.slots.assigned(job.id, job.devices, at)
        return now

    def _forget(self, job: Unit) -> None:
        if self.slots is not None:
            self.slots.forget(job.id)

    # -- outcomes ------------------------------------------------------------

    def job_done(self, job: JobMessage, result: Any) -> None:
        # Encoded before the lock: a result can be large.
        self._finish(job, done_or_failed(job.id, job.lease_token, result, self.max_frame))

    def job_failed(self, job: JobMessage, error: str, retryable: bool) -> None:
        self._finish(job, encode(Failed(job.id, job.lease_token, error, retryable)))

    def _finish(self, job: JobMessage, item: str) -> None:
        self.running.pop(job.id, None)
        self._progress.pop(job.id, None)  # the outcome says more
        self.checkpoints.finish(job.id, job.lease_token)  # its waiting one goes out before the outcome
        self.unacked[job.id] = item
        self._outcomes.append(item)

    # -- progress ------------------------------------------------------------

    def progress(self, job_id: int, item: str) -> bool:
        """Keep ``item`` (``progress_item``) as the latest update of a running job; any thread may
        call it. True when the caller must arrange a ``send_progress()``: the first since the last."""
        with self._progress_lock:
            if job_id not in self.running:
                return False
            self._progress[job_id] = item
            ask, self._progress_asked = not self._progress_asked, True
            return ask

    def send_progress(self) -> None:
        """Queue the updates kept since the last call, in as few ``progress`` frames as fit."""
        with self._progress_lock:
            items, self._progress, self._progress_asked = list(self._progress.values()), {}, False
        limit = self.max_frame - RESULTS_OVERHEAD - 30
        if self.state is State.OPEN and (items := [i for i in items if len(i) <= limit]):
            self._control.extend(pack_progress(items, self.max_frame))

    # -- control -------------------------------------------------------------

    def heartbeat(self, usage: tuple[DeviceUsage, ...] | None = None) -> None:
        """Extend the leases of the running jobs, report device ``usage`` when known and (version 6)
        the slots' busy time and gaps since the last heartbeat (nothing to send when no job runs
        and there is nothing to report)."""
        report = self.slots.report() if self.slots is not None and self.state is State.OPEN else None
        if report is not None and report.empty:
            report = None
        if self.running or usage is not None or report is not None:
            self._control.append(encode(Heartbeat(tuple(self.running), usage, report)))

    def update(self, labels: Iterable[str] | None = None, models: Iterable[str] | None = None) -> None:
        """New labels and/or warm models (None: unchanged): told to the server now if connected,
        and in every later ``hello``. ``ProtocolError`` for a bad name, before anything changes."""
        msg = Update(None if labels is None else tuple(labels), None if models is None else tuple(models))
        checked = parse_client(encode(msg), 1 << 20)  # the server's rules, checked here
        assert isinstance(checked, Update)
        self.hello = dataclasses.replace(
            self.hello, labels=self.hello.labels if checked.labels is None else checked.labels,
            models=self.hello.models if checked.models is None else checked.models)
        if self.state is State.OPEN:
            self._control.append(encode(checked))

    def device_fault(self, devices: Iterable[int], source: str, error: str, job_id: int | None = None) -> None:
        """Devices of the hello are bad (``fault_frame``): sent on the first version 9 connection."""
        if (frame := fault_frame(self.hello, devices, source, error, job_id)) and len(self._faults) < MAX_KEPT_FAULTS:
            self._faults.append(frame)

    def drain(self) -> None:
        """Ask for no more jobs: the agent is leaving; the ready jobs go back, checkpoints at once."""
        self.draining, self.checkpoints.interval = True, 0.0
        if self.state is State.OPEN:
            self._control.append(encode(Drain()))
            self._give_back(self.waiting)

    def _give_back(self, units: list[Unit]) -> None:
        """Release these ready units (``release``): they will not start here."""
        if not units or self.state is not State.OPEN or not self._speaks_started:
            return
        ids = tuple(job_id for unit in units for job_id in job_ids(unit))
        self._control.append(encode(Release(ids)))
        for job_id in ids:
            self.running.pop(job_id, None)
        for unit in units:
            self._forget(unit)
        gone = {id(unit) for unit in units}
        self.ready = deque(unit for unit in self.ready if id(unit) not in gone)
        self.ready_gpu = [unit for unit in self.ready_gpu if id(unit) not in gone]

    def frames_to_send(self) -> list[str]:
        if self.state is not State.OPEN:
            out, self._control = self._control, []  # the hello, nothing else before the welcome
            return out
        faults, self._faults = (self._faults, []) if self._speaks_faults else ([], self._faults)
        out = self.checkpoints.frames(self.max_frame) + faults + self._control  # first: before a job's end
        out += pack_results(self._outcomes, self.max_frame, tuple(self._started))
        self._control, self._outcomes, self._started = [], [], []
        return out


# Every method that changes state: the I/O layer calls them from its event loop, a sync slot from its thread.
_CHANGES_STATE = ("connection_made", "connection_lost", "receive", "take", "job_started", "next_jobs", "_finish",
                  "send_progress", "heartbeat", "update", "drain", "frames_to_send", "device_fault", "yield_running")


class ThreadSafeAgentProtocol(AgentProtocol):
    """``AgentProtocol`` with every method that changes state under one lock (sync handlers)."""

    def __init__(self, hello: Hello, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.RLock()
        super().__init__(hello, clock)


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def locked(self: ThreadSafeAgentProtocol, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


for _name in _CHANGES_STATE:
    setattr(ThreadSafeAgentProtocol, _name, _locked(getattr(AgentProtocol, _name)))
