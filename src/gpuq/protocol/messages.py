"""The agent protocol's messages as types: what each side may send. No parsing, encoding or state.

One frozen dataclass per message of docs/protocol.md; ``ClientMessage`` is
what an agent sends, ``ServerMessage`` what the server sends. ``parse``
builds them from frames (strictly), ``frames`` encodes them. A pushed job
(``JobMessage``) is also what a handler gets: it carries the two fields that
change while it runs (``cancelled``, and where ``progress()`` and ``checkpoint()`` report).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuq.protocol.codes import PROTOCOL_VERSION
from gpuq.protocol.describe import Device, DeviceUsage
from gpuq.protocol.fields import checkpoint_data, progress_item
from gpuq.protocol.receipts import Receipt
from gpuq.protocol.slots import SlotReport

__all__ = ["Ack", "Cancel", "Checkpoint", "CheckpointItem", "Checkpointed", "ClientMessage", "DeviceFault", "Done", "Drain",
           "Error", "Failed", "Heartbeat", "Hello", "JobMessage", "Jobs", "Outcome", "Preempt", "Preempted", "Progress",
           "ProgressUpdate", "Release", "Results", "ServerDrain", "ServerMessage", "Started", "Update", "Welcome",
           "attach_checkpointer", "attach_reporter", "mark_cancelled", "mark_preempted", "on_preempt"]


@dataclass(frozen=True, slots=True)
class _JobIds:
    """A message that only names jobs. Each subclass is its own message: equal only to its own type."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _LeasedJob:
    """The first fields of what is said about one leased job: its id, and the lease token that fences it."""

    id: int
    lease_token: str


# --------------------------------------------------------------------------
# Messages from the agent
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    agent: str
    kinds: tuple[str, ...]
    capacity: int
    protocol: int = PROTOCOL_VERSION
    # Protocol 4: what the agent has (describe.py). Sent only by agents of version 4 or later.
    devices: tuple[Device, ...] = ()
    labels: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    # Protocol 5: jobs the server may push beyond ``capacity``, held ready for the next free slot.
    prefetch: int = 0
    # Protocol 7: jobs one batch handler call takes (0: no batch handler; never send this agent a batch).
    batch: int = 0


@dataclass(frozen=True, slots=True)
class Done(_LeasedJob):
    result: Any


@dataclass(frozen=True, slots=True)
class Failed(_LeasedJob):
    error: str
    retryable: bool


@dataclass(frozen=True, slots=True)
class Preempted(_LeasedJob):
    """Protocol 9: the job stopped because the server asked it to yield (``Preempt``): it goes back to
    pending, its attempt not counted."""


Outcome = Done | Failed | Preempted


@dataclass(frozen=True, slots=True)
class Results:
    """Many outcomes in one frame: how the agent library reports (one frame, one parse)."""

    outcomes: tuple[Outcome, ...]
    started: tuple[int, ...] = ()  # protocol 5: as ``Started``, in the same frame


class Started(_JobIds):
    """From the agent (protocol 5): these jobs' handlers have started (a prefetched job that never
    started goes back without counting its attempt)."""

    __slots__ = ()


class Release(_JobIds):
    """From the agent (protocol 5): it will not start these prefetched jobs (it is draining)."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Heartbeat:
    ids: tuple[int, ...]
    devices: tuple[DeviceUsage, ...] | None = None  # protocol 4, when the agent can read them (NVML)
    slots: SlotReport | None = None  # protocol 6: busy time and gaps since the last report


@dataclass(frozen=True, slots=True)
class Update:
    """From the agent (protocol 4): its labels and/or warm models changed (None: unchanged)."""

    labels: tuple[str, ...] | None
    models: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Drain:
    """From the agent: send me no more jobs (I am finishing and leaving)."""


@dataclass(frozen=True, slots=True)
class ProgressUpdate(_LeasedJob):
    """How far one running job has got: ``fraction`` 0-1, an optional message and JSON ``data``."""

    fraction: float
    message: str | None
    data: Any


@dataclass(frozen=True, slots=True)
class Progress:
    """From the agent (protocol 3): the latest progress of running jobs, coalesced."""

    updates: tuple[ProgressUpdate, ...]


@dataclass(frozen=True, slots=True)
class DeviceFault:
    """From the agent (protocol 9): these devices of its hello are bad. ``source``: ``handler`` (the
    handler raised ``DeviceError``; ``job`` is its job), ``xid`` or ``ecc`` (NVML saw the error)."""

    devices: tuple[int, ...]
    source: str
    error: str
    job: int | None = None


@dataclass(frozen=True, slots=True)
class CheckpointItem(_LeasedJob):
    """One job's checkpoint: ``seq``, the agent's number for it (the server's answer names it),
    and ``data``, any JSON but null."""

    seq: int
    data: Any


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """From the agent (protocol 9): running jobs' checkpoints, each to store fenced by its lease."""

    items: tuple[CheckpointItem, ...]


ClientMessage = (Hello | Done | Failed | Preempted | Results | Heartbeat | Drain | Progress | Update | Started
                 | Release | DeviceFault | Checkpoint)


# --------------------------------------------------------------------------
# Messages from the server
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Welcome:
    agent_id: str  # this connection's id: the jobs' leased_by
    lease_seconds: float
    heartbeat_seconds: float
    max_payload: int
    protocol: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class JobMessage:
    """A job pushed to the agent: what its handler gets.

    ``cancelled`` turns true when the server cancels the job (``gpuq cancel``):
    a sync handler checks it and returns early; an async one is cancelled.
    ``preempted`` turns true when the server asks a preemptible job to yield
    (protocol 9): the handler may checkpoint and stop (raise, or return early
    with ``gpuq.agent.Preempted``) before ``preempt_deadline`` (``time.monotonic()``),
    when the agent stops it. ``progress()`` reports how far it has got.
    """

    id: int
    lease_token: str
    kind: str
    payload: Any
    attempt: int
    timeout: float | None = None  # seconds this attempt may run (protocol 2); the agent stops it then
    devices: tuple[int, ...] = ()  # the device indices this job was given (protocol 4; GPU jobs only)
    queued_ms: int | None = None  # how long it had been due when leased (protocol 6)
    batch: int | None = None  # protocol 7: the batch it runs in (one handler call), numbered per connection
    # Protocol 8: the producer's trace, (traceparent, tracestate or None), when it had one: the
    # handler's span continues it.
    trace: tuple[str, str | None] | None = None
    # Protocol 9: the job's last stored checkpoint (an earlier attempt's ``checkpoint()``), or None.
    resume_from: Any = None
    grace_seconds: float | None = None  # protocol 9: a preemptible job's time to yield once asked (None: not preemptible)
    cancelled: bool = field(default=False, compare=False)
    preempted: bool = field(default=False, compare=False)  # protocol 9: asked to yield (checkpoint, stop)
    preempt_deadline: float | None = field(default=None, compare=False)  # time.monotonic() it is stopped at
    # Called once when it is asked to yield (``on_preempt``: ``run_process`` sends its child SIGTERM).
    on_preempted: list[Callable[[], None]] | None = field(default=None, compare=False, repr=False)
    # Where progress() sends an encoded update (the agent sets it); None: nowhere.
    reporter: Callable[[int, str], None] | None = field(default=None, compare=False, repr=False)
    # Where checkpoint() sends (id, lease token, data as JSON) for a receipt (the agent sets it).
    checkpointer: Callable[[int, str, str], Receipt] | None = field(default=None, compare=False, repr=False)

    def progress(self, fraction: float, message: str | None = None, data: Any = None) -> None:
        """Report how far this job has got: ``fraction`` from 0 to 1, an optional message (cut to
        1024 characters) and any JSON ``data`` (up to 8 KiB). Call it as often as you like, from
        any thread: the agent keeps only the latest and sends it at most twice a second, and the
        server writes it at most once a second. ``ValueError`` for a bad value."""
        item = progress_item(self.id, self.lease_token, fraction, message, data)
        if self.reporter is not None:
            self.reporter(self.id, item)

    def checkpoint(self, data: Any) -> Receipt:
        """Store ``data`` (any JSON but None, up to 8 KiB: a step, the URI of weights the handler
        saved) as this job's checkpoint: an attempt that runs it again (a retry, a lost lease)
        gets it as ``job.resume_from``. Stored fenced by the lease, like an outcome; the agent
        sends a job's first at once and then at most one per ``checkpoint_seconds`` (the latest;
        one still waiting goes out before the job's outcome). Call it from any thread. The
        receipt says whether it was stored: ``await job.checkpoint(data)`` (async handlers) or
        ``job.checkpoint(data).wait()`` (sync ones) gives True, or False when it was refused (the
        lease was lost) or could not be sent. ``ValueError`` for bad data."""
        data_json = checkpoint_data(data)
        if self.checkpointer is None:
            return Receipt.resolved(False)
        return self.checkpointer(self.id, self.lease_token, data_json)


def mark_cancelled(job: JobMessage) -> None:
    """Set ``job.cancelled``: the one field of a pushed job that changes (server cancel, or its timeout)."""
    object.__setattr__(job, "cancelled", True)


def mark_preempted(job: JobMessage, deadline: float) -> None:
    """Set ``job.preempted`` and its deadline (the agent's clock), and call what waits for it."""
    if job.preempted:
        return
    object.__setattr__(job, "preempt_deadline", deadline)
    object.__setattr__(job, "preempted", True)
    for callback in job.on_preempted or ():
        callback()


def on_preempt(job: JobMessage, callback: Callable[[], None]) -> None:
    """Call ``callback`` when the job is asked to yield (at once if it was)."""
    if job.preempted:
        callback()
        return
    if job.on_preempted is None:
        object.__setattr__(job, "on_preempted", [])
    assert job.on_preempted is not None
    job.on_preempted.append(callback)


def attach_reporter(job: JobMessage, reporter: Callable[[int, str], None]) -> None:
    """Where ``job.progress()`` sends its updates (the agent's side of the connection)."""
    object.__setattr__(job, "reporter", reporter)


def attach_checkpointer(job: JobMessage, checkpointer: Callable[[int, str, str], Receipt]) -> None:
    """Where ``job.checkpoint()`` sends its checkpoints (the agent's side of the connection)."""
    object.__setattr__(job, "checkpointer", checkpointer)


@dataclass(frozen=True, slots=True)
class Jobs:
    jobs: tuple[JobMessage, ...]


@dataclass(frozen=True, slots=True)
class Ack:
    """Outcomes persisted (committed) by the server, and those fencing refused."""

    accepted: tuple[int, ...]
    rejected: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ServerDrain:
    """From the server: no more jobs will come; finish, report, then reconnect."""

    deadline_seconds: float


@dataclass(frozen=True, slots=True)
class Error:
    code: str
    message: str


class Cancel(_JobIds):
    """From the server (protocol 2): these jobs of yours were cancelled; stop their handlers.
    Their outcome, if any is sent, will be refused by fencing."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Checkpointed:
    """From the server (protocol 9): checkpoints (by the agent's ``seq``) committed, and those
    refused (fencing: the job is not held with that lease token any more)."""

    stored: tuple[int, ...]
    refused: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Preempt:
    """From the server (protocol 9): yield these running jobs of yours; the agent stops those still
    running ``deadline_seconds`` from now and reports them ``preempted``."""

    ids: tuple[int, ...]
    deadline_seconds: float


ServerMessage = Welcome | Jobs | Ack | ServerDrain | Error | Cancel | Checkpointed | Preempt

