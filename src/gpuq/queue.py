"""The Python API of the job lifecycle over the named statements of ``sql/queries.sql``.

Enqueue, lease, complete, fail, heartbeat, release, reclaim, promote, prune: the SQL lives
there, written out in full; this module only shapes arguments and rows (the types are
``gpuq.jobs``'; the operator's control and reads are ``gpuq.admin``; notifications and the
wake-up handshake ``gpuq.wakeups``). Every hot statement reaches rows through a partial index
over a live status, so its cost is O(rows it returns) whatever the done/dead history
(docs/design.md). Functions take ``db`` (``gpuq.sql.DB``): an asyncpg Connection or Pool.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from gpuq.batches import Head
from gpuq.db import bulk_timeout
from gpuq.jobs import (
    FailOutcome,
    JobBackoff,
    LeasedJob,
    LeaseResult,
    Moved,
    NewJob,
    Shape,
    TraceContext,
)
from gpuq.plans import lease_args
from gpuq.sql import DB, queries
from gpuq.tenants import DEFAULT_TENANT
from gpuq.wakeups import notify, notify_cancel, notify_outcomes

DEFAULT_BACKOFF = JobBackoff()  # a failed job's retry delay unless the caller gives one

# --------------------------------------------------------------------------
# Enqueue
# --------------------------------------------------------------------------

# Rows arrive as parallel arrays: one round trip, one statement, one NOTIFY.
# run_at is the given time, else now() + delay; a row whose run_at is in the
# future starts 'scheduled' and the sweeper promotes it when due.
def _columns(jobs: Sequence[NewJob], trace: TraceContext | None) -> tuple[list[Any] | str | None, ...]:
    plain = (
        [j.kind for j in jobs], [_jsonb_param(j.payload) for j in jobs], [j.priority for j in jobs],
        [j.max_attempts for j in jobs], [j.run_at for j in jobs],
        [float(j.delay_seconds) for j in jobs], [j.dedup_key for j in jobs], [j.timeout_seconds for j in jobs],
    )
    # NULL arrays where no job sets those columns: unnest pads them with NULLs.
    placed = (None,) * 5 if not any(j.placed for j in jobs) else (
        [j.gpus for j in jobs], [j.gpu_memory_mb for j in jobs],
        [",".join(j.labels) if j.labels else None for j in jobs], [j.model for j in jobs],
        [j.concurrency_key for j in jobs])
    batching = (None, None) if not any(j.cost is not None or j.batch_key is not None for j in jobs) else (
        [j.cost for j in jobs], [j.batch_key for j in jobs])
    # The default tenant is stored as NULL (one spelling: reads and charges coalesce them).
    tenants = [None if j.tenant == DEFAULT_TENANT else j.tenant for j in jobs]
    return (*plain, *placed, *batching, tenants if any(tenants) else None, *(trace or (None, None)), *NewJob.yields(jobs))


async def enqueue_many(db: DB, jobs: Sequence[NewJob], trace: TraceContext | None = None) -> list[int]:
    """Insert jobs; return their ids in input order. ``trace``: the producer's (``gpuq.tracing``),
    stored with every one of them (None: none).

    Deduplication: a job whose ``dedup_key`` matches a live (pending, leased
    or scheduled) job is *not* inserted, and its slot gets the id of that
    existing live job. Once the live job is done or dead, the key is free.
    """
    if not jobs:
        return []
    keyed = [i for i, j in enumerate(jobs) if j.dedup_key is not None]
    if not keyed:
        rows = await db.fetch(queries["enqueue_plain"], *_columns(jobs, trace), timeout=bulk_timeout(len(jobs)))
        return [r["id"] for r in rows]
    ids: list[int] = [0] * len(jobs)
    plain = [i for i, j in enumerate(jobs) if j.dedup_key is None]
    if plain:
        rows = await db.fetch(queries["enqueue_plain"], *_columns([jobs[i] for i in plain], trace),
                              timeout=bulk_timeout(len(plain)))
        for i, r in zip(plain, rows, strict=True):
            ids[i] = r["id"]
    # Repeats of one key inside the batch: the first occurrence decides.
    first: dict[str, int] = {}
    for i in keyed:
        first.setdefault(jobs[i].dedup_key, i)  # type: ignore[arg-type]
    unique = list(first.values())
    got = await _enqueue_dedup(db, [jobs[i] for i in unique], trace)
    by_key = {jobs[i].dedup_key: job_id for i, job_id in zip(unique, got, strict=True)}
    for i in keyed:
        ids[i] = by_key[jobs[i].dedup_key]
    return ids


async def _enqueue_dedup(db: DB, jobs: Sequence[NewJob], trace: TraceContext | None) -> list[int]:
    for _ in range(5):
        rows = await db.fetch(queries["enqueue_dedup"], *_columns(jobs, trace), timeout=bulk_timeout(len(jobs)))
        ids = [r["id"] for r in rows]
        if None not in ids:
            return ids
        # A concurrent producer's job with our key committed after our
        # snapshot (or finished in between): the next statement sees it.
    raise RuntimeError("enqueue: a dedup_key conflict did not settle after 5 tries")


# --------------------------------------------------------------------------
# Lease: two phases, each on its own partial index
# --------------------------------------------------------------------------

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
    began (``wakeups.insert_horizon``); None: no insert can be in flight.
    Other jobs that land behind a cursor are the caller's to catch by
    dropping it.
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
    rows.sort(key=BY_SLOT)
    jobs = [leased_job(r) for r in rows if r["status"] == "leased"]  # the others went dead
    if len(jobs) < len(rows):
        await notify_outcomes(db, [r["id"] for r in rows if r["status"] != "leased"])
    picked = [r for r in rows if r["phase"] == 1]
    last = {r["kind"]: (r["priority"], r["id"]) for r in picked}  # slot order: the last of each kind wins
    last = {kind: _cursor(priority, job_id, settled) for kind, (priority, job_id) in last.items()}
    return LeaseResult(jobs, len(jobs) - len(picked), len(rows) - len(jobs), phase2_ran=len(picked) < n,
                       cursors=last)


BY_SLOT = operator.itemgetter("slot")


async def read_shapes(db: DB) -> list[Shape]:
    """Every placement class ever enqueued (gpuq.shapes: a few rows)."""
    return [Shape(r["kind"], r["shape"], r["gpus"], r["gpu_memory_mb"], frozenset(r["labels"]), r["model"],
                  r["keyed"], r["preemptible"]) for r in await db.fetch(queries["shapes"])]


async def lease_placed(db: DB, shape: Shape, slots: Sequence[str], lease_seconds: float) -> list[LeasedJob]:
    """Lease up to ``len(slots)`` pending jobs of one kind and shape, by priority then id (jobs_placed_idx);
    the i-th goes to ``slots[i]``. The caller chose agents that meet the shape's requirements."""
    if not slots:
        return []
    return _placed_jobs(shape, await db.fetch(queries["lease_placed"], shape.kind, shape.digest, list(slots),
                                              lease_seconds))


def _placed_jobs(shape: Shape, rows: list[Any]) -> list[LeasedJob]:
    return [placed_job(shape, r) for r in sorted(rows, key=BY_SLOT)]


def placed_job(shape: Shape, r: Any, batch: int | None = None) -> LeasedJob:
    return LeasedJob(r["id"], r["kind"], r["attempts"], r["max_attempts"], r["lease_token"], r["priority"],
                     r["leased_by"], r["payload_json"], r["timeout_seconds"], shape.gpus, shape.gpu_memory_mb,
                     r["queued_ms"], shape.model, batch, grace_seconds=r["grace_seconds"] if shape.preemptible else None,
                     trace=None if (tp := r["traceparent"]) is None else (tp, r["tracestate"]),
                     failed_devices=tuple(r.get("failed_devices") or ()), resume_json=r["checkpoint_json"])


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
        rows = await conn.fetch(queries["lease_limited"], shape.kind, shape.digest, list(slots), lease_seconds,
                                LIMITED_SCAN if scan_keys else len(slots))
    return _placed_jobs(shape, rows)


async def placed_head_wait(db: DB, shape: Shape) -> float | None:
    """Seconds the shape's next pending job has been due (None: none pending)."""
    return await db.fetchval(queries["placed_head"], shape.kind, shape.digest)


async def batch_head(db: DB, kind: str, n: int, shape: Shape | None = None) -> list[Head]:
    """The next ``n`` pending jobs of ``kind`` in lease order, plain ones or those of ``shape``, as
    the batch rules read them (none while the kind is paused or limited, nor any under a limited
    key). Locks nothing: ``lease_batched`` takes them."""
    if shape is None:
        rows = await db.fetch(queries["batch_head"], kind, n)
    else:
        rows = await db.fetch(queries["batch_head_placed"], kind, shape.digest, n)
    return [Head(r["id"], r["cost"], r["batch_key"], r["waited_ms"], r["timeout_seconds"]) for r in rows]


async def lease_batched(db: DB, kind: str, batches: Sequence[tuple[str, Sequence[int]]],
                        lease_seconds: float, shape: Shape | None = None) -> dict[int, LeasedJob]:
    """Lease batches of pending jobs of ``kind``, plain ones or those of ``shape``: ``(agent, job ids)``
    each, recorded on each job as ``batch_id`` (its first job's id) and ``batch_size``; each leased
    job by id, its ``batch`` that id (one leased, cancelled or paused since ``batch_head`` is not
    among them)."""
    ids, agents, batch_ids, sizes = [], [], [], []
    for agent, members in batches:
        for job_id in members:
            ids.append(job_id)
            agents.append(agent)
            batch_ids.append(members[0])
            sizes.append(len(members))
    rows = await db.fetch(queries["lease_batched"], kind, ids, agents, lease_seconds, batch_ids, sizes,
                          None if shape is None else shape.digest)
    if shape is None:
        return {r["id"]: leased_job(r, r["batch_id"]) for r in rows}
    return {r["id"]: placed_job(shape, r, r["batch_id"]) for r in rows}


async def placed_pending(db: DB) -> dict[tuple[str, str], tuple[int, datetime]]:
    """(kind, shape) -> (pending jobs, the oldest's creation) of placed jobs."""
    return {(r["kind"], r["shape"]): (r["n"], r["oldest"]) for r in await db.fetch(queries["placed_pending"])}


def leased_job(r: Any, batch: int | None = None) -> LeasedJob:
    return LeasedJob(r["id"], r["kind"], r["attempts"], r["max_attempts"], r["lease_token"], r["priority"],
                     r["leased_by"], r["payload_json"], r["timeout_seconds"], queued_ms=r.get("queued_ms"),
                     batch=batch, trace=None if (tp := r["traceparent"]) is None else (tp, r["tracestate"]),
                     resume_json=r["checkpoint_json"])


# --------------------------------------------------------------------------
# Outcomes: fenced by (status = 'leased', lease_token)
# --------------------------------------------------------------------------

async def complete_many(db: DB, results: Iterable[tuple[int, str, Any]], charge: bool = False,
                        ran: Sequence[float | None] | None = None) -> set[int]:
    """Mark jobs done where (id, lease_token) still holds the lease.

    Returns the ids accepted; any other was rejected by fencing (its lease was reclaimed or it is
    no longer leased) and changed nothing. ``charge`` (fair share on): each job's GPU-seconds (``ran``:
    its run time where known, else its lease's age) go to its tenant's usage in the same statement.
    """
    ids, tokens, values = [], [], []
    for job_id, token, result in results:
        ids.append(job_id)
        tokens.append(token)
        values.append(_jsonb_param(result))
    if not ids:
        return set()
    charged = (list(ran or [None] * len(ids)),) if charge else ()
    rows = await db.fetch(queries["complete_many_charged" if charge else "complete_many"], ids, tokens, values, *charged)
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
        data.append(_jsonb_param(u.data))
    if not ids:
        return set()
    rows = await db.fetch(queries["record_progress"], ids, tokens, fractions, messages, data)
    return {r["id"] for r in rows}


async def record_checkpoints(db: DB, checkpoints: Sequence[tuple[int, str, str]]) -> set[int]:
    """Store checkpoints ``(id, lease_token, data as JSON text)`` of jobs still leased with that
    token (each job once); returns the ids stored: any other was refused by fencing."""
    if not checkpoints:
        return set()
    ids, tokens, data = (list(c) for c in zip(*checkpoints, strict=True))
    return {r["id"] for r in await db.fetch(queries["record_checkpoints"], ids, tokens, data)}


async def fail_many(
    db: DB, failures: Iterable[tuple[int, str, str, bool]], backoff: JobBackoff = DEFAULT_BACKOFF,
    charge: bool = False, ran: Sequence[float | None] | None = None,
) -> dict[int, FailOutcome]:
    """Record failures ``(id, token, error, retryable)``; return accepted ids -> outcome. ``charge``:
    as ``complete_many``'s."""
    ids, tokens, errors, retry = [], [], [], []
    for job_id, token, error, retryable in failures:
        ids.append(job_id)
        tokens.append(token)
        errors.append(error)
        retry.append(retryable)
    if not ids:
        return {}
    charged = (list(ran or [None] * len(ids)),) if charge else ()
    rows = await db.fetch(queries["fail_many_charged" if charge else "fail_many"], ids, tokens, errors, retry,
                          backoff.base_seconds, backoff.cap_seconds, backoff.jitter, *charged)
    return {r["id"]: FailOutcome(r["id"], str(r["status"]), r["run_at"]) for r in rows}


async def fail(db: DB, job_id: int, token: str, error: str, retryable: bool = True,
               backoff: JobBackoff = DEFAULT_BACKOFF) -> FailOutcome | None:
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

# The attempt that was running still counts: a job that keeps killing its
# agents runs out of attempts and ends dead instead of looping forever.
async def move_and_notify(db: DB, name: str, *args: Any) -> Moved:
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
    count their attempt (a prefetched job, or one leased while the agent left, never ran), and,
    while fair share is on, charge their GPU-seconds so far."""
    return await move_and_notify(db, "release_agent", agent, "agent disconnected during the last attempt",
                                  list(started))


async def release_unstarted(db: DB, jobs: Sequence[tuple[int, str]]) -> Moved:
    """Jobs ``(id, lease_token)`` an agent gives back unstarted: pending again, the attempt not counted."""
    if not jobs:
        return Moved([], [], set())
    return await move_and_notify(db, "release_unstarted", [i for i, _ in jobs], [t for _, t in jobs])


async def release_jobs(db: DB, ids: Sequence[int], undelivered: bool = False) -> Moved:
    """Give up leases held by this process (dispatcher shutdown); ``undelivered``: jobs no agent
    got (their agent left before the push), whose attempt does not count."""
    if not ids:
        return Moved([], [], set())
    return await move_and_notify(db, "release_jobs", list(ids), "released during the last attempt", undelivered)


async def reclaim_expired(db: DB, limit: int = 1000) -> Moved:
    """Sweeper: expired leases back to pending (or dead when out of attempts); while fair share is
    on each charges its GPU-seconds until the lease expired."""
    return await move_and_notify(db, "reclaim_expired", limit, "lease expired after the last attempt")


async def expire_deadlines(db: DB, limit: int, grace_seconds: float, backoff: JobBackoff = DEFAULT_BACKOFF) -> Moved:
    """Fail attempts still leased ``grace_seconds`` past their deadline (error ``timeout``, retried
    after the backoff while attempts remain, else dead; charged while fair share is on), and tell
    their agents to stop them."""
    rows = await db.fetch(queries["expire_deadlines"], limit, float(grace_seconds), backoff.base_seconds,
                          backoff.cap_seconds)
    moved = Moved([r["id"] for r in rows if r["status"] != "dead"], [r["id"] for r in rows if r["status"] == "dead"],
                  {r["kind"] for r in rows})
    await notify_cancel(db, [r["id"] for r in rows])  # to the dispatchers holding them
    if moved.dead:
        await notify_outcomes(db, moved.dead)
    return moved


async def promote_due(db: DB, limit: int = 1000) -> Moved:
    """Sweeper: scheduled rows whose run_at has come become pending."""
    return await move_and_notify(db, "promote_due", limit)


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


def _jsonb_param(value: Any) -> str | None:
    """JSON text for a jsonb array element (asyncpg would read a list as a nested array)."""
    return None if value is None else _compact_json(value)


# One encoder for every payload and result: json.dumps with any option builds a new one per call.
_compact_json = json.JSONEncoder(separators=(",", ":")).encode
