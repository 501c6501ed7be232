"""The rules of one agent connection, as the server sees it: a state machine without I/O.

The I/O layer (``gpuq.server``) feeds it every frame with ``receive(frame, now)``
and acts on what it returns: events for the dispatcher (``events.py``), ``frames_to_send()``
for the socket and ``close_to_send()`` once the connection must end. The
dispatcher queues jobs, acks and drains through it. What the connection
holds and may take (credit, devices, usage) is its ``ledger`` (``ledger.py``);
every rule of the connection lives here:

- ``hello`` first, within ``hello_timeout`` (``check_deadline``); a bad one
  closes (4003 for an unsupported version, else 4000) after an ``error``;
- a refused frame is answered with ``error`` and the connection goes on, up
  to ``max_errors``; a fatal one closes (1003 for a binary frame, else 4000);
- at most ``max_messages_per_second`` frames per second, averaged over
  ``burst_seconds``, else 4008;
- the ledger gives credit from the hello until the agent drains or the
  connection closes; an outcome is settled in it by its lease token;
- a heartbeat only for jobs this connection holds (``not_held``);
- the connection speaks the agent's version (any of ``SUPPORTED_VERSIONS``,
  1 to 8); a message of a later version than the connection's is refused
  (``unexpected``); ``cancel`` messages go only to agents of version 2 or
  later and only name jobs the connection holds;
- ``progress`` (version 3) counts only for jobs held with that lease token;
  updates for any other job are dropped without an error (a job the agent
  still runs after a reconnect is not this connection's);
- version 4: the hello's devices, labels and models describe the agent;
  ``update`` replaces labels and/or models, heartbeats may carry device
  usage; ``labels`` and ``models`` here, ``ledger.usage``, are always the latest;
- version 5: the agent says which jobs it ``started`` and gives back those
  it will not start (``release``: back to pending at once);
- version 6: each pushed job says how long it was due (``queued_ms``);
  heartbeats may report the slots' busy time and gaps (``slots``, summed over
  the last minute in ``ledger.busy``);
- version 7: jobs pushed with the same ``batch`` go as one batch, held as one
  job (``ledger.hold_batch``), only to an agent whose hello takes batches that
  large; anything else about a batch (``started``, outcomes, ``release``,
  ``cancel``) is per item, as for any job.
- version 8: a pushed job carries its producer's trace (``traceparent``, and
  ``tracestate`` if any) when it has one; never before version 8.
- version 9: the agent reports bad devices (``device_fault``, for devices its
  hello named; others are dropped); the server's quarantine is
  ``ledger.quarantined``. A job whose last attempt failed on devices of this
  agent gets others here when enough fit (``failed_devices``).
- version 9: a pushed job carries its last checkpoint (``resume_from``) when
  it has one; the agent's ``checkpoint`` items count only for jobs held with
  that lease token: the others are answered ``refused`` at once, the held
  ones once the dispatcher has written them (``send_checkpointed``); a preemptible job is pushed
  with its ``grace_seconds``, ``preempt`` asks the agent to yield held jobs by a deadline,
  ``preempted`` settles a job like any outcome (``unexpected`` before version 9).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, Protocol

from gpuq.protocol.batches import group
from gpuq.protocol.codes import (
    CANCEL_SINCE,
    CHECKPOINT_SINCE,
    PLACEMENT_SINCE,
    PREEMPT_SINCE,
    PREFETCH_SINCE,
    PROGRESS_SINCE,
    QUARANTINE_SINCE,
    SLOTS_SINCE,
    TRACE_SINCE,
    CloseCode,
    ErrorCode,
    ProtocolError,
)
from gpuq.protocol.events import (
    AgentUpdated,
    CheckpointsReceived,
    DeviceFaulted,
    DrainRequested,
    Event,
    FrameRefused,
    HeartbeatReceived,
    HelloReceived,
    JobsReleased,
    OutcomesReceived,
    ProgressReceived,
    SlotsReported,
)
from gpuq.protocol.frames import encode, job_message, jobs_frame
from gpuq.protocol.ledger import Ledger, avoiding_first, failed_here
from gpuq.protocol.messages import (
    Ack,
    Cancel,
    Checkpoint,
    Checkpointed,
    CheckpointItem,
    ClientMessage,
    DeviceFault,
    Done,
    Drain,
    Error,
    Failed,
    Heartbeat,
    Hello,
    Outcome,
    Preempt,
    Preempted,
    Progress,
    ProgressUpdate,
    Release,
    Results,
    ServerDrain,
    Started,
    Update,
    Welcome,
)
from gpuq.protocol.parse import parse_client

HELLO_TIMEOUT_SECONDS = 10.0
MAX_ERRORS_PER_CONNECTION = 100  # then the connection is closed with 4000
RATE_BURST_SECONDS = 2.0


class State(Enum):
    AWAITING_HELLO = "awaiting_hello"
    OPEN = "open"
    CLOSED = "closed"


class PushedJob(Protocol):
    """What a leased job must offer to be pushed (``queue.LeasedJob`` does)."""

    id: int
    lease_token: str
    kind: str
    payload_json: str
    attempt: int


class TokenBucket:
    """``rate`` events per second on average, bursts of ``rate * burst_seconds``."""

    def __init__(self, rate: float, burst_seconds: float, now: float):
        self.rate, self.capacity = rate, rate * burst_seconds
        self.tokens, self.stamp = self.capacity, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class ServerProtocol:
    def __init__(self, *, max_payload: int, max_messages_per_second: float, now: float,
                 hello_timeout: float = HELLO_TIMEOUT_SECONDS, max_errors: int = MAX_ERRORS_PER_CONNECTION):
        self.state = State.AWAITING_HELLO
        self.hello: Hello | None = None
        self.hello_deadline = now + hello_timeout
        self.max_payload = max_payload
        self.max_errors = max_errors
        self.errors = 0
        self.draining = False
        self.ledger = Ledger()  # what this connection holds and may take
        self.labels: tuple[str, ...] = ()  # version 4: the hello's, then each update's
        self.models: tuple[str, ...] = ()
        self.last_heartbeat: float | None = None  # when the last heartbeat came (the clock of receive)
        self._now = now
        self._bucket = TokenBucket(max_messages_per_second, RATE_BURST_SECONDS, now)
        self._out: list[str] = []
        self._close: tuple[CloseCode, str] | None = None

    # -- input ---------------------------------------------------------------

    def receive(self, frame: str | bytes, now: float) -> list[Event]:
        """Take one frame from the agent; return what the dispatcher must act on."""
        if self.state is State.CLOSED:
            return []
        self._now = now
        if self.state is State.OPEN and not self._bucket.take(now):
            self._close_with(CloseCode.RATE_LIMITED, "too many messages")
            return []
        try:
            msg = parse_client(frame, self.max_payload)
            return self._hello(msg) if self.state is State.AWAITING_HELLO else self._message(msg)
        except ProtocolError as exc:
            return [self._refuse(exc)]

    def check_deadline(self, now: float) -> None:
        """Close with 4002 if no hello came before the deadline."""
        if self.state is State.AWAITING_HELLO and now >= self.hello_deadline:
            self._close_with(CloseCode.HELLO_TIMEOUT, "no hello in time")

    @property
    def version(self) -> int:
        """The protocol version of this connection: the agent's (its hello was checked)."""
        return self.hello.protocol if self.hello else 0

    def _hello(self, msg: ClientMessage) -> list[Event]:
        if not isinstance(msg, Hello):
            raise ProtocolError(ErrorCode.UNEXPECTED, "the first message must be hello", fatal=True)
        self.hello, self.state = msg, State.OPEN
        self.labels, self.models = msg.labels, msg.models
        self.ledger.open(msg)
        return [HelloReceived(msg)]

    def _message(self, msg: ClientMessage) -> list[Event]:
        if isinstance(msg, Done | Failed | Preempted):
            return [self._outcomes((msg,))]
        if isinstance(msg, Results):
            if msg.started:
                self._started(msg.started)
            return [self._outcomes(msg.outcomes)]
        if isinstance(msg, Started):
            self._started(msg.ids)
            return []
        if isinstance(msg, Release):
            return self._release(msg.ids)
        if isinstance(msg, Heartbeat):
            self.last_heartbeat = self._now
            if msg.devices is not None:
                self._placement_message("device usage in a heartbeat")
                self.ledger.record_usage(msg.devices)
            events = self._heartbeat(msg.ids)
            if msg.slots is not None:
                self._needs(SLOTS_SINCE, "slots in a heartbeat")
                self.ledger.busy.add(msg.slots, self._now)
                events.append(SlotsReported(msg.slots))
            return events
        if isinstance(msg, Update):
            self._placement_message("update")
            self.labels = self.labels if msg.labels is None else msg.labels
            self.models = self.models if msg.models is None else msg.models
            return [AgentUpdated()]
        if isinstance(msg, Drain):
            self.draining = True
            self.ledger.stop()
            return [DrainRequested()]
        if isinstance(msg, Progress):
            return self._progress(msg.updates)
        if isinstance(msg, DeviceFault):
            return self._device_fault(msg)
        if isinstance(msg, Checkpoint):
            return self._checkpoint(msg.items)
        raise ProtocolError(ErrorCode.UNEXPECTED, "hello was already received on this connection")

    def _outcomes(self, outcomes: tuple[Outcome, ...]) -> OutcomesReceived:
        self._needs(PREEMPT_SINCE if any(isinstance(o, Preempted) for o in outcomes) else 0, "preempted")
        given = self.ledger.devices_in_use
        failed_on = {o.id: (o.lease_token, given[o.id]) for o in outcomes
                     if type(o) is Failed and o.id in given and self.ledger.holds(o.id, o.lease_token)} if given else {}
        return OutcomesReceived(*self.ledger.settle(outcomes, self._now), failed_on)

    def _started(self, ids: tuple[int, ...]) -> None:
        self._needs(PREFETCH_SINCE, "started")
        self.ledger.mark_started(ids, self._now)

    def _release(self, ids: tuple[int, ...]) -> list[Event]:
        """Give back held jobs the agent never started; a started one stays (its outcome will come)."""
        self._needs(PREFETCH_SINCE, "release")
        back = self.ledger.release(ids)
        return [JobsReleased(back)] if back else []

    def _device_fault(self, msg: DeviceFault) -> list[Event]:
        """Only the devices the hello named count; a fault naming none of them is dropped."""
        self._needs(QUARANTINE_SINCE, "device_fault")
        known = {d.index for d in self.ledger.devices}
        mine = tuple(i for i in msg.devices if i in known)
        return [DeviceFaulted(DeviceFault(mine, msg.source, msg.error, msg.job))] if mine else []

    def _needs(self, version: int, what: str) -> None:
        if self.version < version:
            raise ProtocolError(ErrorCode.UNEXPECTED, f"{what} needs protocol {version}; this "
                                f"connection speaks {self.version}")

    def _placement_message(self, what: str) -> None:
        self._needs(PLACEMENT_SINCE, what)

    def _progress(self, updates: tuple[ProgressUpdate, ...]) -> list[Event]:
        self._needs(PROGRESS_SINCE, "progress")
        holds = self.ledger.holds
        mine = tuple(u for u in updates if holds(u.id, u.lease_token))
        return [ProgressReceived(mine)] if mine else []

    def _checkpoint(self, items: tuple[CheckpointItem, ...]) -> list[Event]:
        """Checkpoints of jobs held with that token go to be written; the others are refused now."""
        self._needs(CHECKPOINT_SINCE, "checkpoint")
        holds = self.ledger.holds
        mine = tuple(c for c in items if holds(c.id, c.lease_token))
        if len(mine) < len(items):
            self.send_checkpointed((), tuple(c.seq for c in items if not holds(c.id, c.lease_token)))
        return [CheckpointsReceived(mine)] if mine else []

    def _heartbeat(self, ids: tuple[int, ...]) -> list[Event]:
        mine = self.ledger.held
        held = tuple(i for i in ids if i in mine)
        events: list[Event] = [HeartbeatReceived(held)] if held else []
        if len(held) < len(ids):
            foreign = sorted(set(ids) - set(held))[:20]
            events.append(self._refuse(ProtocolError(
                ErrorCode.NOT_HELD, f"heartbeat for jobs not leased to this connection: {foreign}")))
        return events

    def _refuse(self, exc: ProtocolError) -> FrameRefused:
        self.errors += 1
        if self.state is State.AWAITING_HELLO:
            # Any bad first message ends the connection, and says why first.
            self._out.append(encode(Error(exc.code, exc.message)))
            self._close_with(exc.close if exc.close is CloseCode.UNSUPPORTED_VERSION
                             else CloseCode.PROTOCOL_ERROR, exc.message)
        elif exc.fatal:
            self._close_with(exc.close if exc.close is CloseCode.UNSUPPORTED_DATA
                             else CloseCode.PROTOCOL_ERROR, exc.message)
        elif self.errors > self.max_errors:
            self._close_with(CloseCode.PROTOCOL_ERROR, "too many protocol errors")
        else:
            self._out.append(encode(Error(exc.code, exc.message)))
        return FrameRefused(exc.code, exc.message)

    # -- output --------------------------------------------------------------

    def accept(self, welcome: Welcome) -> None:
        self._out.append(encode(welcome))

    def send_jobs(self, jobs: list[Any]) -> list[Any]:
        """Push leased jobs (``PushedJob``s): they are held, and take credit, until their outcome. A job
        with ``gpus`` is given that many free devices of at least its ``gpu_memory_mb``; jobs with the
        same ``batch`` (version 7) go as one batch, held as one job. The jobs returned were not
        pushed (the caller gives them back): no devices for them, or a batch this agent cannot take."""
        pushed: list[str] = []
        refused: list[Any] = []
        queued, traced = self.version >= SLOTS_SINCE, self.version >= TRACE_SINCE
        resumes, yielding = self.version >= CHECKPOINT_SINCE, self.version >= PREEMPT_SINCE
        units = group(jobs)
        # An agent with devices holds first the jobs that must avoid some (``avoiding_first``).
        holds = {id(unit): self._hold(unit) for unit in avoiding_first(units)} if self.ledger.devices else None
        for unit in units:
            held = self._hold(unit) if holds is None else holds[id(unit)]
            if held is None:
                refused.extend(unit)
                continue
            devices, number = held
            pushed.extend(job_message(j.id, j.lease_token, j.kind, j.payload_json, j.attempt,
                                      getattr(j, "timeout_seconds", None), devices,
                                      getattr(j, "queued_ms", None) if queued else None, number,
                                      getattr(j, "trace", None) if traced else None,
                                      getattr(j, "resume_json", None) if resumes else None,
                                      getattr(j, "grace_seconds", None) if yielding else None)
                          for j in unit)
            if yielding:  # what preemption may ask to yield (a plain slot's victims: Preempting)
                self.ledger.preemptible.update(j.id for j in unit if getattr(j, "grace_seconds", None) is not None)
        if pushed:
            self._out.append(jobs_frame(pushed))
        return refused

    def _hold(self, unit: list[Any]) -> tuple[tuple[int, ...], int | None] | None:
        """Hold one job, or one batch (its items of one kind and one GPU count): the devices given
        and the batch's number; None when it cannot be held."""
        first = unit[0]
        gpus = getattr(first, "gpus", 0)
        memory = max((j.gpu_memory_mb or 0) for j in unit) if gpus else 0
        model = getattr(first, "model", None)
        if getattr(first, "batch", None) is None:
            devices = self.ledger.hold(first.id, first.lease_token, first.kind, gpus, memory, model,
                                       failed_here(first, self.hello) if gpus else frozenset())
            return None if devices is None else (devices, None)
        if any(j.kind != first.kind or getattr(j, "gpus", 0) != gpus for j in unit):
            return None  # the agent would refuse the frame: one batch runs one kind on one set of devices
        return self.ledger.hold_batch([(j.id, j.lease_token) for j in unit], first.kind, gpus, memory, model)

    def send_ack(self, accepted: tuple[int, ...], rejected: tuple[int, ...]) -> None:
        self._out.append(encode(Ack(accepted, rejected)))

    def send_checkpointed(self, stored: tuple[int, ...], refused: tuple[int, ...]) -> None:
        """Answer the agent's checkpoints (by its ``seq``): committed, or refused by fencing."""
        self._out.append(encode(Checkpointed(stored, refused)))

    def cancel(self, ids: Iterable[int]) -> list[int]:
        """Tell the agent these jobs were cancelled: those this connection holds, if its version
        has ``cancel`` (a version 1 agent runs them to the end; fencing refuses the outcome).
        They stay held, and keep their credit, until the agent reports them."""
        return self._tell(ids, CANCEL_SINCE, lambda held: Cancel(held))

    def preempt(self, ids: Iterable[int], deadline_seconds: float) -> list[int]:
        """Ask the agent to yield these jobs by ``deadline_seconds`` from now, as ``cancel`` tells (version 9)."""
        return self._tell(ids, PREEMPT_SINCE, lambda held: Preempt(held, deadline_seconds))

    def _tell(self, ids: Iterable[int], since: int, message: Callable[[tuple[int, ...]], Cancel | Preempt]) -> list[int]:
        held = [i for i in ids if i in self.ledger.held]
        if not held or self.version < since or self.state is not State.OPEN:
            return []
        self._out.append(encode(message(tuple(held))))
        return held

    def send_drain(self, deadline_seconds: float) -> None:
        self._out.append(encode(ServerDrain(deadline_seconds)))

    def frames_to_send(self) -> list[str]:
        out, self._out = self._out, []
        return out

    def close_to_send(self) -> tuple[CloseCode, str] | None:
        """The close code and reason once the connection must end; None while it goes on."""
        return self._close

    def _close_with(self, code: CloseCode, reason: str) -> None:
        if self._close is None:
            self._close = (code, close_reason(reason))
        self.state = State.CLOSED
        self.ledger.stop()


def close_reason(text: str) -> str:
    """At most 123 bytes of UTF-8: a close frame holds 125, two of them the code."""
    return text.encode()[:123].decode(errors="ignore")
