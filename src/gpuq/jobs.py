"""The job types the queue takes and returns, and their validation: no I/O.

``NewJob`` is a job to insert; ``NewJob.from_mapping`` builds one from loose
fields (the ``gpuq enqueue`` flags, its JSON lines, ``gpuq.enqueue``) with one
readable ``ValueError`` for any bad field. The other types are what the
queue's statements return or take as filters (``gpuq.queue``, ``gpuq.admin``).
Nothing here loads asyncpg or the SQL.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from gpuq.kinds import KIND_RULE, is_kind
from gpuq.protocol.describe import LABEL_RULE, MODEL_RULE, is_label, is_model
from gpuq.tenants import check_tenant

LIVE_STATES = ("pending", "leased", "scheduled")
# A preemptible job's defaults (the columns' of migration 0023, and enqueue's).
DEFAULT_GRACE_SECONDS = 30.0
DEFAULT_MAX_PREEMPTIONS = 10
MAX_GRACE_SECONDS = 86400.0
# A W3C trace context, (traceparent, tracestate or None): what a job carries of its producer's trace.
TraceContext = tuple[str, str | None]
LIST_STATES = ("pending", "leased", "scheduled", "done", "dead", "cancelled", "failed")  # failed: dead or cancelled


@dataclass(frozen=True, slots=True)
class NewJob:
    kind: str
    payload: Any = None
    priority: int = 0
    max_attempts: int = 5
    delay_seconds: float = 0.0
    run_at: datetime | None = None
    dedup_key: str | None = None
    timeout_seconds: int | None = None  # how long one attempt may run (None: no limit)
    # Placement (docs/design.md, "GPU placement"): all unset, any agent of the kind may run it.
    gpus: int = 0  # devices it takes, on one agent
    gpu_memory_mb: int | None = None  # the least memory of each of those devices
    labels: tuple[str, ...] = ()  # labels the agent must have, all of them
    model: str | None = None  # the model it would rather find warm
    concurrency_key: str | None = None  # what global limits count it under
    # Batching (docs/design.md, "Batching"): its share of a batch's max_cost, and the key that
    # keeps unlike jobs apart (only jobs of one batch_key share a batch).
    cost: int | None = None
    batch_key: str | None = None
    # Fair share (docs/design.md, "Fair share"): whose GPU-seconds it charges (None: the default tenant).
    tenant: str | None = None
    # Preemption (docs/design.md, "Preemption"): it may be asked to yield, with grace_seconds to stop
    # in, at most max_preemptions times; then it goes back to pending without counting the attempt.
    preemptible: bool = False
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS

    @property
    def placed(self) -> bool:
        """Whether it has a placement requirement (else any agent of its kind may take it): a
        preemptible job has one (an agent that can yield, protocol 9)."""
        return bool(self.gpus or self.gpu_memory_mb is not None or self.labels or self.model is not None
                    or self.concurrency_key is not None or self.preemptible)

    def __post_init__(self) -> None:
        # The table's rules (the kind CHECK, the placement trigger), as readable errors.
        if not is_kind(self.kind):
            raise ValueError(f"bad job kind {self.kind!r}: {KIND_RULE}")
        if not -32767 <= self.priority <= 32767:
            raise ValueError(f"priority {self.priority} out of range -32767..32767")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts}")
        if self.delay_seconds < 0:
            raise ValueError(f"delay must not be negative, not {self.delay_seconds}")
        check_timeout(self.timeout_seconds)
        check_placement(self.gpus, self.gpu_memory_mb, self.labels, self.model, self.concurrency_key)
        check_batching(self.cost, self.batch_key)
        check_preemption(self.grace_seconds, self.max_preemptions)
        if self.tenant is not None:
            check_tenant(self.tenant)

    @staticmethod
    def yields(jobs: Sequence[NewJob]) -> tuple[list[Any] | None, ...]:
        """The insert's preemption arrays (preemptible, grace_seconds, max_preemptions): NULL arrays
        where no job is preemptible (unnest pads them with NULLs)."""
        if not any(j.preemptible for j in jobs):
            return None, None, None
        return [j.preemptible for j in jobs], [float(j.grace_seconds) for j in jobs], [j.max_preemptions for j in jobs]

    @classmethod
    def from_mapping(cls, given: Mapping[str, Any]) -> NewJob:
        """A job from loose fields: NewJob's own names, or ``delay`` and ``timeout`` for
        ``delay_seconds`` and ``timeout_seconds`` (the names of ``gpuq enqueue``'s flags and of
        its JSON lines). Anything missing takes NewJob's default. ``ValueError`` for anything
        else than an object with a valid ``kind``, an unknown field, or a bad value."""
        if not isinstance(given, Mapping) or "kind" not in given:
            raise ValueError('expected an object with a "kind"')
        values: dict[str, Any] = {}
        for name, value in given.items():
            real = SHORT_NAMES.get(name, name)
            if real in values:
                raise ValueError(f"{real} given twice (as {name} and {real})")
            values[real] = value
        unknown = set(values) - _FIELDS
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        for name, value in values.items():
            _check_type(name, value)
        if values.get("labels") is not None:
            values["labels"] = tuple(values["labels"])
        return cls(**values)


SHORT_NAMES = {"delay": "delay_seconds", "timeout": "timeout_seconds", "grace": "grace_seconds"}  # the CLI's names of NewJob's fields
_FIELDS = {f.name for f in fields(NewJob)}
_NULLABLE = {"payload", "run_at", "dedup_key", "timeout_seconds", "gpu_memory_mb", "model", "concurrency_key",
             "cost", "batch_key", "tenant"}
_WHOLE = {"priority", "max_attempts", "gpus", "timeout_seconds", "gpu_memory_mb", "cost", "max_preemptions"}
_TEXT = {"kind", "dedup_key", "model", "concurrency_key", "batch_key", "tenant"}


def _check_type(name: str, value: Any) -> None:
    """A field's type, as a readable error (the value's rules are NewJob's)."""
    if name in _NULLABLE and value is None or name == "payload":
        return
    if name in _WHOLE and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{name} must be a whole number, not {value!r}")
    if name in ("delay_seconds", "grace_seconds") and (not isinstance(value, int | float) or isinstance(value, bool)):
        raise ValueError(f"{name.removesuffix('_seconds')} must be a number of seconds, not {value!r}")
    if name == "preemptible" and not isinstance(value, bool):
        raise ValueError(f"preemptible must be true or false, not {value!r}")
    if name in _TEXT and not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {value!r}")
    if name == "run_at" and not isinstance(value, datetime):
        raise ValueError(f"run_at must be a datetime, not {value!r}")
    if name == "labels" and (isinstance(value, str) or not isinstance(value, Sequence)
                             or not all(isinstance(x, str) for x in value)):
        raise ValueError(f"labels must be a list of labels, not {value!r}")


def check_timeout(timeout_seconds: int | None) -> None:
    """A job's or a kind's timeout: None (no limit) or at least one second (``ValueError``)."""
    if timeout_seconds is not None and timeout_seconds < 1:
        raise ValueError(f"timeout must be at least 1 second, not {timeout_seconds}")


def check_placement(gpus: int, gpu_memory_mb: int | None, labels: Sequence[str], model: str | None,
                    concurrency_key: str | None) -> None:
    """The placement trigger's rules (migration 0014), as readable errors before the insert (``ValueError``)."""
    if isinstance(labels, str):
        raise ValueError(f"labels must be a list of labels, not the string {labels!r}")
    if not 0 <= gpus <= 64:
        raise ValueError(f"gpus must be 0-64, not {gpus}")
    if gpu_memory_mb is not None and (gpu_memory_mb < 1 or gpus < 1):
        raise ValueError("gpu_memory_mb must be a positive number of MiB, and needs gpus of at least 1")
    if len(labels) > 16 or not all(is_label(x) for x in labels):
        raise ValueError(f"labels must be at most 16 of: {LABEL_RULE}")
    if model is not None and not is_model(model):
        raise ValueError(f"bad model name {model!r}: {MODEL_RULE}")
    if concurrency_key is not None and not 1 <= len(concurrency_key) <= 256:
        raise ValueError("concurrency_key must be 1-256 characters")


def check_batching(cost: int | None, batch_key: str | None) -> None:
    """The table's CHECKs on a job's batching columns (migration 0017), as readable errors (``ValueError``)."""
    if cost is not None and not 0 <= cost <= MAX_COST:
        raise ValueError(f"cost must be a whole number 0-{MAX_COST}, not {cost}")
    if batch_key is not None and not 1 <= len(batch_key) <= 200:
        raise ValueError("batch_key must be 1-200 characters")


def check_preemption(grace_seconds: float, max_preemptions: int) -> None:
    """The placement trigger's rules on a job's preemption columns (migration 0023), as readable errors."""
    if not 0 < grace_seconds <= MAX_GRACE_SECONDS:
        raise ValueError(f"grace must be above 0 and at most {MAX_GRACE_SECONDS:g} seconds, not {grace_seconds}")
    if max_preemptions < 0:
        raise ValueError(f"max_preemptions must not be negative, not {max_preemptions}")


MAX_COST = 2**63 - 1  # bigint
# A batching policy's bounds (gpuq.batch_policies' CHECKs, migration 0017).
MAX_BATCH_ITEMS = 4096
MAX_BATCH_WAIT_MS = 3_600_000


# Not frozen: serve builds one per leased job, and a frozen dataclass's __init__ sets each of
# these fields with object.__setattr__ (6x the cost: 3.3 us against 0.5 for this one). Nothing
# changes one after it is built (dataclasses.replace makes a new one).
@dataclass(slots=True)
class LeasedJob:
    id: int
    kind: str
    attempt: int
    max_attempts: int
    lease_token: str
    priority: int
    leased_by: str
    # The payload as PostgreSQL's JSON text: serve splices it into the push
    # (protocol.job_message) and never decodes or re-encodes it.
    payload_json: str
    timeout_seconds: int | None = None  # this attempt's limit: the agent stops the handler then
    gpus: int = 0  # placed jobs: devices to give it on its agent, each with at least gpu_memory_mb
    gpu_memory_mb: int | None = None
    queued_ms: int | None = None  # how long it had been due when leased (the agent counts gaps by it)
    model: str | None = None  # placed jobs: the model it would rather find warm (the agent holds it while it runs)
    batch: int | None = None  # batched jobs: the batch's number (its jobs go in one handler call)
    # The producer's trace (None: none), pushed to agents of protocol 8 (docs/design.md, "Tracing").
    trace: TraceContext | None = None
    grace_seconds: float | None = None  # a preemptible job's time to yield (pushed to agents of protocol 9)
    # Placed jobs: the devices ('agent:index') its last attempt failed on; placement avoids them when it can.
    failed_devices: tuple[str, ...] = ()
    # The job's last checkpoint as PostgreSQL's JSON text (None: none), pushed to agents of protocol 9
    # as ``resume_from`` (docs/design.md, "Checkpoints"); spliced like the payload.
    resume_json: str | None = None

    @property
    def payload(self) -> Any:
        return json.loads(self.payload_json)


@dataclass(frozen=True, slots=True)
class JobBackoff:
    """How long a failed job waits before its next attempt (computed in SQL by ``fail_many`` and
    ``expire_deadlines``): base * 2**(attempt-1), capped, times a jitter in [1-jitter, 1]."""

    base_seconds: float = 1.0
    cap_seconds: float = 300.0
    jitter: float = 0.5


@dataclass(frozen=True, slots=True)
class Shape:
    """A placement class: what every job of ``kind`` whose requirements hash to ``digest`` needs
    (a row of gpuq.shapes; ``digest`` is the ``shape`` column the placement trigger fills)."""

    kind: str
    digest: str
    gpus: int
    gpu_memory_mb: int | None
    labels: frozenset[str]
    model: str | None
    keyed: bool
    preemptible: bool = False  # its jobs go only to agents that can yield them (protocol 9)

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, digest)``: how dispatchers and placement name the shape (``placement.ShapeKey``)."""
        return self.kind, self.digest

    @property
    def plain(self) -> bool:
        """The kind's plain jobs (no requirement): what a kind limit makes the dispatcher lease as a shape."""
        return self.digest == ""

    @classmethod
    def of_plain(cls, kind: str) -> Shape:
        return cls(kind, "", 0, None, frozenset(), None, False)


@dataclass(frozen=True, slots=True)
class LeaseResult:
    jobs: list[LeasedJob]
    reclaimed: int = 0  # of ``jobs``, how many came from expired leases
    dead: int = 0  # expired leases found with no attempts left, now dead
    phase2_ran: bool = False  # phase 1 left slots, so expired leases were looked for
    # kind -> (priority, id) of the last pending job leased: where the next lease of it starts
    cursors: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FailOutcome:
    id: int
    status: str  # 'scheduled' (will retry at run_at) or 'dead'
    run_at: datetime


@dataclass(frozen=True, slots=True)
class Moved:
    """Rows moved by a maintenance statement: back to pending, or dead."""

    pending: list[int]
    dead: list[int]
    kinds: set[str]


@dataclass(frozen=True, slots=True)
class RetryFilter:
    """Which dead or cancelled jobs ``retry`` sends back: every given criterion must hold (None: any)."""

    ids: Sequence[int] | None = None
    kind: str | None = None
    error: str | None = None  # a substring of last_error
    since: datetime | None = None  # finished at or after
    until: datetime | None = None  # finished before
    state: str | None = None  # only 'dead' or only 'cancelled' (None: both)
    key: str | None = None  # concurrency key

    def args(self) -> tuple[Any, ...]:
        if self == RetryFilter():
            raise ValueError("retry needs job ids or at least one filter (kind, error text, time range, state, key)")
        if self.state not in (None, "dead", "cancelled"):
            raise ValueError(f"retry takes dead or cancelled jobs, not {self.state!r}")
        return (None if self.ids is None else list(self.ids), self.kind, self.error, self.since, self.until,
                self.state, self.key)


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Which jobs a list shows: every given criterion must hold (None: any)."""

    kind: str | None = None
    state: str | None = None  # one of LIST_STATES
    key: str | None = None  # concurrency key
    error: str | None = None  # a substring of last_error

    def __post_init__(self) -> None:
        if self.kind is not None and not is_kind(self.kind):
            raise ValueError(f"bad job kind {self.kind!r}: {KIND_RULE}")
        if self.state is not None and self.state not in LIST_STATES:
            raise ValueError(f"state must be one of {', '.join(LIST_STATES)}, not {self.state!r}")


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[dict[str, Any]]
    older: int | None  # the ``before`` of the next page (None: nothing older)
    searched_to: int | None  # a bounded walk stopped at this id (None: the whole list was read)


def error_line(error: str | None) -> str:
    """What a list shows of an error: its last line (a traceback's exception), or ""."""
    lines = (error or "").strip().splitlines()
    return lines[-1] if lines else ""


@dataclass
class StatusCounts:
    live: dict[str, dict[str, int]]  # status -> kind -> count
    oldest_pending_seconds: float | None
    history_estimate: int  # done + dead, from planner statistics (approximate)
    paused: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> {since, by}
    oldest_pending_by_kind: dict[str, float] = field(default_factory=dict)  # kind -> seconds

    def total(self, status: str) -> int:
        return sum(self.live.get(status, {}).values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "live": self.live,
            "totals": {s: self.total(s) for s in LIVE_STATES},
            "oldest_pending_seconds": self.oldest_pending_seconds,
            "history_estimate": self.history_estimate,
            "paused": self.paused,
        }
