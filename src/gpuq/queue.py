"""The Python API of the job lifecycle over the named statements of ``sql/queries.sql``.

The SQL lives there, written out in full; this module only shapes arguments
and rows. Every hot statement reaches rows through a partial index over a
live status, so its cost is O(rows it returns) whatever the done/dead history
(docs/design.md). Functions take ``db``: an asyncpg Connection or Pool (both
have fetch/execute). Every value travels as a bind parameter.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from gpuq.kinds import KIND_RULE, is_kind
from gpuq.plans import lease_args
from gpuq.protocol.describe import LABEL_RULE, MODEL_RULE, is_label, is_model
from gpuq.sql import queries

NOTIFY_CHANNEL = "gpuq_jobs"  # also in queries.sql (notify) and the trigger of migration 0001
LIVE_STATES = ("pending", "leased", "scheduled")


class DB(Protocol):
    async def fetch(self, query: str, *args: Any) -> list[Any]: ...
    async def fetchrow(self, query: str, *args: Any) -> Any: ...
    async def fetchval(self, query: str, *args: Any) -> Any: ...
    async def execute(self, query: str, *args: Any) -> str: ...


@dataclass(frozen=True, slots=True)
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

    @property
    def payload(self) -> Any:
        return json.loads(self.payload_json)


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

    @property
    def placed(self) -> bool:
        """Whether it has a placement requirement (else any agent of its kind may take it)."""
        return bool(self.gpus or self.gpu_memory_mb is not None or self.labels or self.model is not None
                    or self.concurrency_key is not None)

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
        if self.timeout_seconds is not None and self.timeout_seconds < 1:
            raise ValueError(f"timeout must be at least 1 second, not {self.timeout_seconds}")
        check_placement(self.gpus, self.gpu_memory_mb, self.labels, self.model, self.concurrency_key)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Retry delay: base * 2**(attempt-1), capped, times a jitter in [1-jitter, 1]."""

    base_seconds: float = 1.0
    cap_seconds: float = 300.0
    jitter: float = 0.5


# --------------------------------------------------------------------------
# Enqueue
# --------------------------------------------------------------------------

# Rows arrive as parallel arrays: one round trip, one statement, one NOTIFY.
# run_at is the given time, else now() + delay; a row whose run_at is in the
# future starts 'scheduled' and the sweeper promotes it when due.
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


def _columns(jobs: Sequence[NewJob]) -> tuple[list[Any] | None, ...]:
    plain = (
        [j.kind for j in jobs], [_json(j.payload) for j in jobs], [j.priority for j in jobs],
        [j.max_attempts for j in jobs], [j.run_at for j in jobs],
        [float(j.delay_seconds) for j in jobs], [j.dedup_key for j in jobs], [j.timeout_seconds for j in jobs],
    )
    if not any(j.placed for j in jobs):
        return (*plain, None, None, None, None, None)  # NULL arrays: unnest pads them with NULLs
    return (*plain, [j.gpus for j in jobs], [j.gpu_memory_mb for j in jobs],
            [",".join(j.labels) if j.labels else None for j in jobs], [j.model for j in jobs],
            [j.concurrency_key for j in jobs])


async def enqueue_many(db: DB, jobs: Sequence[NewJob]) -> list[int]:
    """Insert jobs; return their ids in input order.

    Deduplication: a job whose ``dedup_key`` matches a live (pending, leased
    or scheduled) job is *not* inserted, and its slot gets the id of that
    existing live job. Once the live job is done or dead, the key is free.
    """
    if not jobs:
        return []
    keyed = [i for i, j in enumerate(jobs) if j.dedup_key is not None]
    if not keyed:
        rows = await db.fetch(queries["enqueue_plain"], *_columns(jobs))
        return [r["id"] for r in rows]
    ids: list[int] = [0] * len(jobs)
    plain = [i for i, j in enumerate(jobs) if j.dedup_key is None]
    if plain:
        rows = await db.fetch(queries["enqueue_plain"], *_columns([jobs[i] for i in plain]))
        for i, r in zip(plain, rows, strict=True):
            ids[i] = r["id"]
    # Repeats of one key inside the batch: the first occurrence decides.
    first: dict[str, int] = {}
    for i in keyed:
        first.setdefault(jobs[i].dedup_key, i)  # type: ignore[arg-type]
    unique = list(first.values())
    got = await _enqueue_dedup(db, [jobs[i] for i in unique])
    by_key = {jobs[i].dedup_key: job_id for i, job_id in zip(unique, got, strict=True)}
    for i in keyed:
        ids[i] = by_key[jobs[i].dedup_key]
    return ids


async def _enqueue_dedup(db: DB, jobs: Sequence[NewJob]) -> list[int]:
    for _ in range(5):
        rows = await db.fetch(queries["enqueue_dedup"], *_columns(jobs))
        ids = [r["id"] for r in rows]
        if None not in ids:
            return ids
        # A concurrent producer's job with our key committed after our
        # snapshot (or finished in between): the next statement sees it.
    raise RuntimeError("enqueue: a dedup_key conflict did not settle after 5 tries")


# --------------------------------------------------------------------------
# Lease: two phases, each on its own partial index
# --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LeaseResult:
    jobs: list[LeasedJob]
    reclaimed: int = 0  # of ``jobs``, how many came from expired leases
    dead: int = 0  # expired leases found with no attempts left, now dead
    phase2_ran: bool = False  # phase 1 left slots, so expired leases were looked for
    # kind -> (priority, id) of the last pending job leased: where the next lease of it starts
    cursors: dict[str, tuple[int, int]] = field(default_factory=dict)


async def lease(db: DB, kinds: Sequence[str], n: int, agent: str, lease_seconds: float) -> LeaseResult:
    """Lease up to ``n`` jobs of ``kinds`` for ``agent``: pending first, then expired."""
    return await lease_slots(db, kinds, [agent] * n, lease_seconds)


# A cursor never goes below this priority: the insert trigger looks lease floors
# up only for jobs above it (migration 0005), so no floor may be lower.
LOWEST_CURSOR_PRIORITY = 0
_AFTER_EVERY_ID = 2**63 - 1


def _cursor(priority: int, job_id: int, settled: int | None) -> tuple[int, int]:
    """Where the next lease of a kind starts, after the last job this one took.

    Not past an id that may still commit (``settled``); jobs that land above the
    level it stops in are the floors' to catch (docs/design.md, "Wake-ups").
    Below priority 0, at the end of level 0.
    """
    if priority < LOWEST_CURSOR_PRIORITY:
        priority, job_id = LOWEST_CURSOR_PRIORITY, _AFTER_EVERY_ID
    return priority, job_id if settled is None else min(job_id, settled)


async def lease_slots(db: DB, kinds: Sequence[str], slots: Sequence[str], lease_seconds: float,
                      cursors: Mapping[str, tuple[int, int]] | None = None,
                      settled: int | None = None) -> LeaseResult:
    """Lease up to ``len(slots)`` jobs of ``kinds``; the i-th job leased goes to ``slots[i]``.

    Phase 1 claims pending rows (jobs_pending_idx, priority then id, SKIP
    LOCKED), for each kind from its cursor on (``cursors``, as the last
    result's ``cursors`` left them; none: from the start), so the dead index
    entries earlier leases left behind are not walked again (docs/design.md,
    "Lease cursors"). Ids are drawn at insert, not at commit, so a job can
    commit behind a cursor: the cursors returned never pass ``settled``, an
    id up to which every job had committed or rolled back before this lease
    began (``insert_horizon``); None: no insert can be in flight. Other jobs
    that land behind a cursor are the caller's to catch by dropping it.
    Phase 2, only for the slots phase 1 left, reclaims expired leases
    (jobs_leased_idx), sending those out of attempts to dead.
    One statement.

    One statement serves many agents that take the same kinds: the dispatcher
    lists each agent once per free credit, interleaved, and every job's
    ``leased_by`` names the agent it is pushed to. ``db`` must be a connection
    or pool from ``gpuq.db`` (they carry ``PLAN_SETTINGS``).
    """
    n = len(slots)
    if n <= 0 or not kinds:
        return LeaseResult([])
    rows = await db.fetch(queries["lease_slots"], *lease_args(kinds, slots, lease_seconds, cursors))
    # UPDATE ... RETURNING does not keep the pick order: restore the slots' order
    # (pending by priority and id, then reclaimed ones by expiry).
    rows.sort(key=_BY_SLOT)
    jobs = [_leased(r) for r in rows if r["status"] == "leased"]  # the others went dead
    if len(jobs) < len(rows):
        await notify_outcomes(db, [r["id"] for r in rows if r["status"] != "leased"])
    picked = [r for r in rows if r["phase"] == 1]
    last = {r["kind"]: (r["priority"], r["id"]) for r in picked}  # slot order: the last of each kind wins
    last = {kind: _cursor(priority, job_id, settled) for kind, (priority, job_id) in last.items()}
    return LeaseResult(jobs, len(jobs) - len(picked), len(rows) - len(jobs), phase2_ran=len(picked) < n,
                       cursors=last)


_BY_SLOT = operator.itemgetter("slot")


@dataclass(frozen=True, slots=True)
class Shape:
    """A placement class: what every job of ``kind`` with this ``shape`` needs (gpuq.shapes)."""

    kind: str
    shape: str
    gpus: int
    gpu_memory_mb: int | None
    labels: frozenset[str]
    model: str | None
    keyed: bool

    @property
    def plain(self) -> bool:
        """The kind's plain jobs (no requirement): what a kind limit makes the dispatcher lease as a shape."""
        return self.shape == ""

    @classmethod
    def of_plain(cls, kind: str) -> Shape:
        return cls(kind, "", 0, None, frozenset(), None, False)


async def shapes(db: DB) -> list[Shape]:
    return [Shape(r["kind"], r["shape"], r["gpus"], r["gpu_memory_mb"], frozenset(r["labels"]), r["model"],
                  r["keyed"]) for r in await db.fetch(queries["shapes"])]


async def lease_placed(db: DB, shape: Shape, slots: Sequence[str], lease_seconds: float) -> list[LeasedJob]:
    """Lease up to ``len(slots)`` pending jobs of one kind and shape, by priority then id (jobs_placed_idx);
    the i-th goes to ``slots[i]``. The caller chose agents that meet the shape's requirements."""
    if not slots:
        return []
    return _placed_jobs(shape, await db.fetch(queries["lease_placed"], shape.kind, shape.shape, list(slots),
                                              lease_seconds))


def _placed_jobs(shape: Shape, rows: list[Any]) -> list[LeasedJob]:
    return [LeasedJob(r["id"], r["kind"], r["attempts"], r["max_attempts"], r["lease_token"], r["priority"],
                      r["leased_by"], r["payload_json"], r["timeout_seconds"], shape.gpus, shape.gpu_memory_mb,
                      r["queued_ms"])
            for r in sorted(rows, key=_BY_SLOT)]


# A limited lease reads at most this many of a keyed shape's next jobs looking
# for keys with room: jobs behind that many of full keys wait for them to drain.
LIMITED_SCAN = 1000


async def lease_limited(db: DB, shape: Shape, slots: Sequence[str], lease_seconds: float,
                        scan_keys: bool) -> list[LeasedJob]:
    """Lease up to ``len(slots)`` of a shape's pending jobs (``shape.plain``: the kind's plain jobs)
    within the kind's and the keys' limits (gpuq.limits), one limited lease at a time across every
    dispatcher (an advisory lock in its transaction). ``scan_keys``: some key has a limit, so read
    up to LIMITED_SCAN jobs for keys with room (else only as many as the slots)."""
    from gpuq.db import transaction

    if not slots:
        return []
    async with transaction(db) as conn:
        await conn.execute(queries["limits_lock"])
        rows = await conn.fetch(queries["lease_limited"], shape.kind, shape.shape, list(slots), lease_seconds,
                                LIMITED_SCAN if scan_keys else len(slots))
    return _placed_jobs(shape, rows)


async def set_limit(db: DB, scope: str, name: str, max_running: int | None) -> None:
    """At most ``max_running`` jobs leased at once of kind ``name`` (scope ``kind``) or under
    concurrency key ``name`` (scope ``key``), across every dispatcher; None removes the limit."""
    if scope not in ("kind", "key"):
        raise ValueError(f"a limit is per kind or per key, not {scope!r}")
    if scope == "kind" and not is_kind(name):
        raise ValueError(f"bad job kind {name!r}: {KIND_RULE}")
    if scope == "key" and not 1 <= len(name) <= 256:
        raise ValueError("concurrency_key must be 1-256 characters")
    if max_running is not None and max_running < 0:
        raise ValueError(f"a limit must be 0 or more jobs, not {max_running}")
    await db.execute(queries["limit_set"], scope, name, max_running)


async def limits(db: DB) -> list[dict[str, Any]]:
    """Every limit: ``{scope, name, max_running, running}``."""
    return [dict(r) for r in await db.fetch(queries["limits"])]


async def placed_head_wait(db: DB, shape: Shape) -> float | None:
    """Seconds the shape's next pending job has been due (None: none pending)."""
    return await db.fetchval(queries["placed_head"], shape.kind, shape.shape)


async def placed_pending(db: DB) -> dict[tuple[str, str], tuple[int, datetime]]:
    """(kind, shape) -> (pending jobs, the oldest's creation) of placed jobs."""
    return {(r["kind"], r["shape"]): (r["n"], r["oldest"]) for r in await db.fetch(queries["placed_pending"])}


def _leased(r: Any) -> LeasedJob:
    return LeasedJob(r["id"], r["kind"], r["attempts"], r["max_attempts"], r["lease_token"], r["priority"],
                     r["leased_by"], r["payload_json"], r["timeout_seconds"], queued_ms=r.get("queued_ms"))


# --------------------------------------------------------------------------
# Outcomes: fenced by (status = 'leased', lease_token)
# --------------------------------------------------------------------------

async def complete_many(db: DB, results: Iterable[tuple[int, str, Any]]) -> set[int]:
    """Mark jobs done where (id, lease_token) still holds the lease.

    Returns the ids that were accepted; any other id was rejected by fencing
    (its lease was reclaimed or it is no longer leased) and changed nothing.
    """
    ids, tokens, values = [], [], []
    for job_id, token, result in results:
        ids.append(job_id)
        tokens.append(token)
        values.append(_json(result))
    if not ids:
        return set()
    rows = await db.fetch(queries["complete_many"], ids, tokens, values)
    return {r["id"] for r in rows}


async def complete(db: DB, job_id: int, token: str, result: Any = None) -> bool:
    return job_id in await complete_many(db, [(job_id, token, result)])


async def record_progress(db: DB, updates: Iterable[Any]) -> set[int]:
    """Store progress updates (``ProgressUpdate``: id, lease_token, fraction, message, data) of
    jobs still leased with that token, and notify ``gpuq_progress``; returns the ids written."""
    ids, tokens, fractions, messages, data = [], [], [], [], []
    for u in updates:
        ids.append(u.id)
        tokens.append(u.lease_token)
        fractions.append(u.fraction)
        messages.append(u.message)
        data.append(_json(u.data))
    if not ids:
        return set()
    rows = await db.fetch(queries["record_progress"], ids, tokens, fractions, messages, data)
    return {r["id"] for r in rows}


@dataclass(frozen=True, slots=True)
class FailOutcome:
    id: int
    status: str  # 'scheduled' (will retry at run_at) or 'dead'
    run_at: datetime


async def fail_many(
    db: DB, failures: Iterable[tuple[int, str, str, bool]], backoff: Backoff = Backoff()
) -> dict[int, FailOutcome]:
    """Record failures ``(id, token, error, retryable)``; return accepted ids -> outcome."""
    ids, tokens, errors, retry = [], [], [], []
    for job_id, token, error, retryable in failures:
        ids.append(job_id)
        tokens.append(token)
        errors.append(error)
        retry.append(retryable)
    if not ids:
        return {}
    rows = await db.fetch(queries["fail_many"], ids, tokens, errors, retry,
                          backoff.base_seconds, backoff.cap_seconds, backoff.jitter)
    return {r["id"]: FailOutcome(r["id"], str(r["status"]), r["run_at"]) for r in rows}


async def fail(db: DB, job_id: int, token: str, error: str, retryable: bool = True,
               backoff: Backoff = Backoff()) -> FailOutcome | None:
    """Fenced failure of one job; None if the lease no longer holds."""
    return (await fail_many(db, [(job_id, token, error, retryable)], backoff)).get(job_id)


async def heartbeat(db: DB, ids: Sequence[int], agent: str, lease_seconds: float) -> set[int]:
    """Extend the leases ``agent`` holds on ``ids``; return those extended."""
    if not ids:
        return set()
    rows = await db.fetch(queries["heartbeat"], list(ids), agent, float(lease_seconds))
    return {r["id"] for r in rows}


# --------------------------------------------------------------------------
# Returning work: disconnects, expired leases, due retries (each NOTIFYs)
# --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Moved:
    """Rows moved by a maintenance statement: back to pending, or dead."""

    pending: list[int]
    dead: list[int]
    kinds: set[str]


# The attempt that was running still counts: a job that keeps killing its
# agents runs out of attempts and ends dead instead of looping forever.
async def _move_and_notify(db: DB, name: str, *args: Any) -> Moved:
    rows = await db.fetch(queries[name], *args)
    moved = Moved([r["id"] for r in rows if r["status"] == "pending"],
                  [r["id"] for r in rows if r["status"] == "dead"],
                  {r["kind"] for r in rows if r["status"] == "pending"})
    if moved.kinds:
        await notify(db, moved.kinds, behind=True)
    if moved.dead:
        await notify_outcomes(db, moved.dead)
    return moved


async def release_agent(db: DB, agent: str, started: Sequence[int]) -> Moved:
    """An agent disconnected: its leased jobs go back to pending at once; only the ``started`` ones
    count their attempt (a prefetched job, or one leased while the agent left, never ran)."""
    return await _move_and_notify(db, "release_agent", agent, "agent disconnected during the last attempt",
                                  list(started))


async def release_unstarted(db: DB, jobs: Sequence[tuple[int, str]]) -> Moved:
    """Jobs ``(id, lease_token)`` an agent gives back unstarted: pending again, the attempt not counted."""
    if not jobs:
        return Moved([], [], set())
    return await _move_and_notify(db, "release_unstarted", [i for i, _ in jobs], [t for _, t in jobs])


async def release_jobs(db: DB, ids: Sequence[int], undelivered: bool = False) -> Moved:
    """Give up leases held by this process (dispatcher shutdown); ``undelivered``: jobs no agent
    got (their agent left before the push), whose attempt does not count."""
    if not ids:
        return Moved([], [], set())
    return await _move_and_notify(db, "release_jobs", list(ids), "released during the last attempt", undelivered)


async def reclaim_expired(db: DB, limit: int = 1000) -> Moved:
    """Sweeper: expired leases back to pending (or dead when out of attempts)."""
    return await _move_and_notify(db, "reclaim_expired", limit, "lease expired after the last attempt")


async def expire_deadlines(db: DB, limit: int, grace_seconds: float, backoff: Backoff = Backoff()) -> Moved:
    """Fail attempts still leased ``grace_seconds`` past their deadline (error ``timeout``, retried
    after the backoff while attempts remain, else dead), and tell their agents to stop them."""
    rows = await db.fetch(queries["expire_deadlines"], limit, float(grace_seconds), backoff.base_seconds,
                          backoff.cap_seconds)
    moved = Moved([r["id"] for r in rows if r["status"] != "dead"], [r["id"] for r in rows if r["status"] == "dead"],
                  {r["kind"] for r in rows})
    await _notify_ids(db, "notify", CANCEL_PREFIX, [r["id"] for r in rows])  # to the dispatchers holding them
    if moved.dead:
        await notify_outcomes(db, moved.dead)
    return moved


async def promote_due(db: DB, limit: int = 1000) -> Moved:
    """Sweeper: scheduled rows whose run_at has come become pending."""
    return await _move_and_notify(db, "promote_due", limit)


OUTCOMES_CHANNEL = "gpuq_outcomes"  # job ids that ended (done, dead, cancelled): what gpuq.wait listens to
PROGRESS_CHANNEL = "gpuq_progress"  # job ids whose progress was written: what gpuq.wait(on_progress=) listens to
_IDS_PER_NOTIFY = 300  # ids of up to 19 digits stay under NOTIFY's 8000-byte payload


async def notify_outcomes(db: DB, ids: Sequence[int]) -> None:
    """Tell waiters these jobs ended (the completer's statements do it themselves)."""
    await _notify_ids(db, "notify_outcomes", "", ids)


async def _notify_ids(db: DB, name: str, prefix: str, ids: Sequence[int]) -> None:
    """Statement ``name`` with ``prefix`` + comma-joined ``ids``, as many times as the payload limit needs."""
    for i in range(0, len(ids), _IDS_PER_NOTIFY):
        await db.execute(queries[name], prefix + ",".join(map(str, ids[i:i + _IDS_PER_NOTIFY])))


async def notify(db: DB, kinds: Iterable[str], behind: bool = False) -> None:
    """Wake the dispatchers for ``kinds``; ``behind``: the jobs went back to pending, behind
    any lease cursor (``kind!``), so the next lease of the kind starts from the top."""
    payload = ",".join(k + "!" if behind else k for k in sorted(set(kinds)))
    await db.execute(queries["notify"], payload if len(payload) <= 7000 else "*")


@dataclass(frozen=True, slots=True)
class Wakeup:
    """A parsed notification: ``kinds`` -> the top priority inserted, or None when the jobs may
    be behind a cursor (moved back to pending, or an old payload); ``every``: any kind may have
    new jobs ('+', '*'); ``rewind``: and they may be behind any cursor ('*')."""

    kinds: dict[str, int | None]
    every: bool = False
    rewind: bool = False


CANCEL_PREFIX = "cancel:"  # gpuq.cancel() announces leased jobs it cancelled: 'cancel:41,42'


def parse_cancel(payload: str) -> list[int]:
    """The job ids of a ``cancel:ID,...`` notification (anything unreadable is skipped)."""
    return [int(i) for i in payload[len(CANCEL_PREFIX):].split(",") if i.isdigit()]


def parse_wakeup(payload: str) -> Wakeup:
    """``+`` (inserted while a dispatcher waits, migration 0005), ``kind@priority`` (inserted
    above a lease floor), ``kind!`` (moved back), ``kind``, or ``*``."""
    if payload == "+":
        return Wakeup({}, every=True)
    if payload == "*" or not payload:
        return Wakeup({}, every=True, rewind=True)
    kinds: dict[str, int | None] = {}
    for entry in payload.split(","):
        kind, _, top = entry.rstrip("!").partition("@")
        priority = int(top) if top and not entry.endswith("!") else None
        previous = kinds.get(kind, priority)
        kinds[kind] = None if previous is None or priority is None else max(previous, priority)
    return Wakeup(kinds)


@dataclass(frozen=True, slots=True)
class Armed:
    """What ``arm_wakeups`` found: the server's clock and the wake-up mark before and after
    (epoch ms), and the transactions that may have inserted without seeing the new mark."""

    now_ms: int
    previous: int
    until: int
    stragglers: list[str]


async def arm_wakeups(db: DB, ttl_ms: int) -> Armed:
    """Ask producers to NOTIFY for the next ``ttl_ms`` (docs/design.md, "Wake-ups")."""
    row = await db.fetchrow(queries["arm_wakeups"], ttl_ms)
    return Armed(row["now_ms"], row["previous"], row["until"], list(row["stragglers"]))


async def insert_horizon(db: DB) -> tuple[int, list[str]]:
    """The highest job id drawn, and the transactions that must end before it is settled."""
    row = await db.fetchrow(queries["insert_horizon"])
    return row["last_id"], list(row["writers"])


async def stragglers_left(db: DB, xids: Sequence[str]) -> list[str]:
    """Those of the transactions ``xids`` that have not ended."""
    return list(await db.fetchval(queries["stragglers_left"], list(xids)))


async def set_floors(db: DB, dispatcher: int, floors: Mapping[str, int]) -> None:
    """Record the priorities the dispatcher's lease cursors reached: inserts above them notify."""
    await db.execute(queries["set_floors"], dispatcher, list(floors), list(floors.values()))


async def clear_floors(db: DB, dispatcher: int) -> None:
    """Drop a dispatcher's lease floors, and those of dispatchers that are gone."""
    await db.execute(queries["clear_floors"], dispatcher)


# -- admin (issue #15) -------------------------------------------------------


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


async def pause(db: DB, kind: str, by: str) -> bool:
    """Stop every dispatcher leasing ``kind`` (running jobs finish); False if it was paused already."""
    return await db.fetchval(queries["pause_kind"], kind, by) is not None


async def resume(db: DB, kind: str) -> bool:
    """Lease ``kind`` again and wake the dispatchers; False if it was not paused."""
    return await db.fetchval(queries["resume_kind"], kind) is not None


async def set_kind_timeout(db: DB, kind: str, seconds: int | None) -> None:
    """Jobs of ``kind`` without a timeout of their own get ``seconds`` per attempt (None: no default)."""
    if not is_kind(kind):
        raise ValueError(f"bad job kind {kind!r}: {KIND_RULE}")
    if seconds is not None and seconds < 1:
        raise ValueError(f"timeout must be at least 1 second, not {seconds}")
    await db.execute(queries["kind_timeout_set"], kind, seconds)


async def kind_timeouts(db: DB) -> dict[str, int]:
    return {r["kind"]: r["timeout_seconds"] for r in await db.fetch(queries["kind_timeouts"])}


async def paused(db: DB) -> dict[str, dict[str, Any]]:
    """Paused kinds -> who paused them (``by``) and when (``since``, ISO 8601)."""
    rows = await db.fetch(queries["paused_kinds"])
    return {r["kind"]: {"since": r["paused_at"].isoformat(), "by": r["paused_by"]} for r in rows}


async def retry_count(db: DB, which: RetryFilter) -> int:
    """How many dead or cancelled jobs ``retry`` would send back (a dry run)."""
    return int(await db.fetchval(queries["retry_count"], *which.args()))


async def retry(db: DB, which: RetryFilter) -> int:
    """Send matching dead or cancelled jobs back to pending with fresh attempts; how many went."""
    return int(await db.fetchval(queries["retry"], *which.args()) or 0)


async def cancel(db: DB, *job_ids: int) -> dict[int, str]:
    """Cancel live jobs: they end ``cancelled`` and are not retried; a running agent's
    result is fenced out. Returns each job cancelled and the state it left
    (jobs already finished, or unknown, are not in it)."""
    return {r["id"]: r["was"] for r in await db.fetch(queries["cancel"], list(job_ids))}


async def show(db: DB, job_id: int) -> dict[str, Any] | None:
    """Every column of one job (payload and result decoded), or None if there is no such job."""
    row = await db.fetchrow(queries["show"], job_id)
    if row is None:
        return None
    out = dict(row)
    for key in ("payload", "result", "progress"):
        out[key] = None if out[key] is None else json.loads(out[key])
    return out


async def attempts(db: DB, job_id: int) -> list[dict[str, Any]]:
    """The attempts of one job that did not succeed, oldest first (the job row holds the last one)."""
    return [dict(r) for r in await db.fetch(queries["job_attempts"], job_id)]


async def last_agents(db: DB, job_ids: Sequence[int]) -> dict[int, str]:
    """Job id -> the agent of its latest attempt that did not succeed (for jobs that have one)."""
    return {r["job_id"]: r["agent"] for r in await db.fetch(queries["last_agents"], list(job_ids))}


# -- listing jobs (the dashboard) ----------------------------------------------

LIST_STATES = ("pending", "leased", "scheduled", "done", "dead", "cancelled", "failed")  # failed: dead or cancelled
# A page of a list that may reach into history examines at most this many ids
# of the primary key: a filter that matches nothing costs one window, not the table.
LIST_WINDOW = 10_000


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


async def list_jobs(db: DB, which: JobFilter, before: int | None = None, limit: int = 50) -> JobPage:
    """One page of jobs below id ``before``, newest first, keyset-paginated (never OFFSET).

    Live states read their partial indexes, dead and cancelled jobs
    ``jobs_failed_idx``, a concurrency key ``jobs_keyed_idx``; anything else
    (done, or no state, by kind or error text) walks at most
    ``LIST_WINDOW`` ids of the primary key per page, so no page costs more
    than that however much history the table holds.
    """
    if before is None and not _indexed(which):
        before = (await db.fetchval(queries["max_job_id"]) or 0) + 1
    name, args = list_statement(which, before, limit)
    jobs = [dict(r) for r in await db.fetch(queries[name], *args)]
    if len(jobs) == limit:
        return JobPage(jobs, jobs[-1]["id"], None)
    floor = args[1] if name == "jobs_recent" else 0
    return JobPage(jobs, floor or None, floor or None)  # a short page of a bounded walk: go on below it


def list_statement(which: JobFilter, before: int | None, limit: int) -> tuple[str, tuple[Any, ...]]:
    """The named statement and parameters of one page of ``list_jobs``."""
    top = (2**63 - 1) if before is None else before
    state = which.state
    if state in ("pending", "leased", "scheduled"):
        return "jobs_live", (state, top, which.kind, which.key, which.error, limit)
    if state in ("dead", "cancelled", "failed"):
        return "jobs_failed", (top, which.kind, None if state == "failed" else state, which.key, which.error, limit)
    if which.key is not None:
        return "jobs_keyed", (which.key, top, which.kind, state, which.error, limit)
    return "jobs_recent", (top, max(0, top - LIST_WINDOW), which.kind, state, which.key, which.error, limit)


def error_line(error: str | None) -> str:
    """What a list shows of an error: its last line (a traceback's exception), or ""."""
    lines = (error or "").strip().splitlines()
    return lines[-1] if lines else ""


def _indexed(which: JobFilter) -> bool:
    """Does the page read an index of its own (True), or walk recent ids from the newest?"""
    return (which.state is not None and which.state != "done") or which.key is not None


# --------------------------------------------------------------------------
# Retention: delete old history in bounded windows of the primary key
# --------------------------------------------------------------------------

# Examines only ids in [start, start + window): O(window) whatever the table
# size. Reports whether the window reached rows created after the cutoff (ids
# grow with time, so the rest of the table is younger: the walk can stop there).
async def prune_window(db: DB, start_id: int, window: int, retention_seconds: float) -> tuple[int, bool, int | None]:
    row = await db.fetchrow(queries["prune_window"], start_id, start_id + window, float(retention_seconds))
    return row["deleted"], row["reached_young"], row["max_id"]


async def min_job_id(db: DB) -> int | None:
    return await db.fetchval(queries["min_job_id"])


# --------------------------------------------------------------------------
# Status: live counts from the partial indexes, history only as an estimate
# --------------------------------------------------------------------------

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


async def status_counts(db: DB) -> StatusCounts:
    """Live counts, each state from its own partial index; history only as the planner's estimate."""
    rows = await db.fetch(queries["status_counts"])
    live: dict[str, dict[str, int]] = {s: {} for s in LIVE_STATES}
    oldest: dict[str, datetime] = {}
    for r in rows:
        live[r["status"]][r["kind"]] = r["n"]
        if r["status"] == "pending":
            oldest[r["kind"]] = r["oldest"]
    estimate, now = await db.fetchrow(queries["table_estimate"])
    n_live = sum(sum(k.values()) for k in live.values())
    ages = {kind: (now - at).total_seconds() for kind, at in oldest.items()}
    return StatusCounts(live, max(ages.values(), default=None), max(0, estimate - n_live), await paused(db), ages)


def _json(value: Any) -> str | None:
    """JSON text for a jsonb array element (asyncpg would read a list as a nested array)."""
    return None if value is None else _to_json(value)


# One encoder for every payload and result: json.dumps with any option builds a new one per call.
_to_json = json.JSONEncoder(separators=(",", ":")).encode
