"""Every SQL statement of the job lifecycle, and nothing else.

Rule of this module: a statement on a hot path (lease, complete, fail,
heartbeat, release, status) reaches rows only through a partial index over a
live status (see migrations/0001_jobs.sql), so its cost is O(rows it returns)
however many done/dead rows the table holds.

Functions take ``db``: an asyncpg Connection or Pool (both have fetch/execute).
Every value travels as a bind parameter; no SQL is built from input.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

NOTIFY_CHANNEL = "gpuq_jobs"
LIVE_STATES = ("pending", "leased", "scheduled")
# Mirrors the jobs_kind_format CHECK: kinds travel comma-joined in NOTIFY payloads.
KIND_PATTERN = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")


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

    def __post_init__(self) -> None:
        # The same rules as the table's CHECK constraints, as readable errors.
        if not isinstance(self.kind, str) or not KIND_PATTERN.fullmatch(self.kind):
            raise ValueError(f"bad job kind {self.kind!r}: 1-128 characters of A-Z a-z 0-9 _ . : / -")
        if not -32767 <= self.priority <= 32767:
            raise ValueError(f"priority {self.priority} out of range -32767..32767")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {self.max_attempts}")
        if self.delay_seconds < 0:
            raise ValueError(f"delay must not be negative, not {self.delay_seconds}")


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
_INPUT = """
    SELECT kind, coalesce(payload::jsonb, '{}'::jsonb) AS payload, priority, max_attempts,
           coalesce(run_at, now() + make_interval(secs => delay)) AS run_at, dedup_key, ord
    FROM unnest($1::text[], $2::text[], $3::smallint[], $4::int[], $5::timestamptz[],
                $6::float8[], $7::text[])
        WITH ORDINALITY AS t(kind, payload, priority, max_attempts, run_at, delay, dedup_key, ord)
"""
_STATUS_FOR_RUN_AT = "CASE WHEN run_at > now() THEN 'scheduled'::gpuq.job_status ELSE 'pending' END"

# Without dedup keys, ids come back in input order (INSERT ... SELECT ...
# ORDER BY assigns identities and returns rows in that order).
_ENQUEUE_PLAIN = f"""
INSERT INTO gpuq.jobs (kind, payload, priority, max_attempts, run_at, status)
SELECT kind, payload, priority, max_attempts, run_at, {_STATUS_FOR_RUN_AT}
FROM ({_INPUT}) AS input
ORDER BY ord
RETURNING id
"""  # noqa: S608 (composed of module constants only)

# With dedup keys (all distinct, all non-null): a key that already has a live
# job is skipped by ON CONFLICT and its slot gets the live job's id. Rows are
# matched back by key. A live job that commits after this statement's
# snapshot shows as NULL; the caller retries, and then sees it.
_ENQUEUE_DEDUP = f"""
WITH input AS ({_INPUT}), ins AS (
    INSERT INTO gpuq.jobs (kind, payload, priority, max_attempts, run_at, status, dedup_key)
    SELECT kind, payload, priority, max_attempts, run_at, {_STATUS_FOR_RUN_AT}, dedup_key
    FROM input ORDER BY ord
    ON CONFLICT (dedup_key) WHERE dedup_key IS NOT NULL AND status IN ('pending', 'leased', 'scheduled')
    DO NOTHING
    RETURNING id, dedup_key
)
SELECT input.ord, coalesce(ins.id, live.id) AS id, ins.id IS NOT NULL AS inserted
FROM input
LEFT JOIN ins USING (dedup_key)
LEFT JOIN gpuq.jobs live ON ins.id IS NULL AND live.dedup_key = input.dedup_key
    AND live.status IN ('pending', 'leased', 'scheduled')
ORDER BY input.ord
"""  # noqa: S608 (composed of module constants only)


def _columns(jobs: Sequence[NewJob]) -> tuple[list[Any], ...]:
    return (
        [j.kind for j in jobs], [_json(j.payload) for j in jobs], [j.priority for j in jobs],
        [j.max_attempts for j in jobs], [j.run_at for j in jobs],
        [float(j.delay_seconds) for j in jobs], [j.dedup_key for j in jobs],
    )


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
        rows = await db.fetch(_ENQUEUE_PLAIN, *_columns(jobs))
        return [r["id"] for r in rows]
    ids: list[int] = [0] * len(jobs)
    plain = [i for i, j in enumerate(jobs) if j.dedup_key is None]
    if plain:
        rows = await db.fetch(_ENQUEUE_PLAIN, *_columns([jobs[i] for i in plain]))
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
        rows = await db.fetch(_ENQUEUE_DEDUP, *_columns(jobs))
        ids = [r["id"] for r in rows]
        if None not in ids:
            return ids
        # A concurrent producer's job with our key committed after our
        # snapshot (or finished in between): the next statement sees it.
    raise RuntimeError("enqueue: a dedup_key conflict did not settle after 5 tries")


# --------------------------------------------------------------------------
# Lease: two phases, each on its own partial index
# --------------------------------------------------------------------------

# Both phases in one statement (one round trip, one commit):
# Phase 1 (picked): claim pending rows. One index probe per kind on
# jobs_pending_idx (kind, priority DESC, id) WHERE status='pending', each
# reading at most $2 entries; SKIP LOCKED keeps concurrent leasers disjoint.
# Phase 2 (expired): reclaim leases that expired (their agent vanished without
# a disconnect we saw, e.g. another dispatcher died), walking jobs_leased_idx
# from the oldest expiry, for the slots phase 1 left. When phase 1 filled the
# batch its LIMIT is 0 and PostgreSQL does not even start that scan. A
# reclaimed row whose attempts are used up goes dead instead.
# The UPDATE finds the locked rows by ctid (a TID scan: no primary-key descent
# per row, which would deepen with history); a row we hold locked cannot move.
_PAYLOAD = "j.payload::text AS payload_json"  # text, not jsonb: the pool decodes jsonb
_EXHAUSTED = "(a.phase = 2 AND j.attempts >= j.max_attempts)"
_LEASE = f"""
WITH picked AS (
    SELECT c.ctid, row_number() OVER (ORDER BY c.priority DESC, c.id) AS rn
    FROM unnest($1::text[]) AS k(kind)
    CROSS JOIN LATERAL (
        SELECT ctid, id, priority FROM gpuq.jobs
        WHERE status = 'pending' AND kind = k.kind
        ORDER BY priority DESC, id
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) c
    ORDER BY c.priority DESC, c.id
    LIMIT $2
), expired AS (
    SELECT e.ctid, (SELECT count(*) FROM picked) + row_number() OVER (ORDER BY e.lease_expires_at, e.id) AS rn
    FROM (
        SELECT ctid, id, lease_expires_at FROM gpuq.jobs
        WHERE status = 'leased' AND lease_expires_at < now() AND kind = ANY($1::text[])
        ORDER BY lease_expires_at
        LIMIT greatest($2 - (SELECT count(*) FROM picked), 0)
        FOR UPDATE SKIP LOCKED
    ) e
), assigned AS (
    SELECT p.ctid, p.phase, s.agent, s.slot
    FROM (SELECT ctid, rn, 1 AS phase FROM picked UNION ALL SELECT ctid, rn, 2 FROM expired) p
    JOIN unnest($3::text[]) WITH ORDINALITY AS s(agent, slot) ON s.slot = p.rn
)
UPDATE gpuq.jobs j
SET status = CASE WHEN {_EXHAUSTED} THEN 'dead'::gpuq.job_status ELSE 'leased' END,
    attempts = CASE WHEN {_EXHAUSTED} THEN j.attempts ELSE j.attempts + 1 END,
    lease_token = CASE WHEN {_EXHAUSTED} THEN j.lease_token ELSE gen_random_uuid() END,
    leased_by = CASE WHEN {_EXHAUSTED} THEN j.leased_by ELSE a.agent END,
    lease_expires_at = CASE WHEN {_EXHAUSTED} THEN j.lease_expires_at ELSE now() + make_interval(secs => $4) END,
    started_at = CASE WHEN {_EXHAUSTED} THEN j.started_at ELSE now() END,
    finished_at = CASE WHEN {_EXHAUSTED} THEN now() END,
    last_error = CASE WHEN {_EXHAUSTED} THEN 'lease expired after the last attempt' ELSE j.last_error END
FROM assigned a
WHERE j.ctid = a.ctid
RETURNING j.id, j.kind, j.attempts, j.max_attempts, j.lease_token::text AS lease_token,
          j.priority, j.leased_by, {_PAYLOAD}, j.status, a.phase, a.slot
"""  # noqa: S608 (composed of module constants only)


@dataclass(frozen=True, slots=True)
class LeaseResult:
    jobs: list[LeasedJob]
    reclaimed: int = 0  # of ``jobs``, how many came from expired leases
    dead: int = 0  # expired leases found with no attempts left, now dead
    phase2_ran: bool = False  # phase 1 left slots, so expired leases were looked for


async def lease(db: DB, kinds: Sequence[str], n: int, agent: str, lease_seconds: float) -> LeaseResult:
    """Lease up to ``n`` jobs of ``kinds`` for ``agent``: pending first, then expired."""
    return await lease_slots(db, kinds, [agent] * n, lease_seconds)


async def lease_slots(db: DB, kinds: Sequence[str], slots: Sequence[str], lease_seconds: float) -> LeaseResult:
    """Lease up to ``len(slots)`` jobs of ``kinds``; the i-th job leased goes to ``slots[i]``.

    One statement serves many agents that take the same kinds: the dispatcher
    lists each agent once per free credit, interleaved, and every job's
    ``leased_by`` names the agent it is pushed to. ``db`` must be a connection
    or pool from ``gpuq.db`` (they carry ``PLAN_SETTINGS``).
    """
    n = len(slots)
    if n <= 0 or not kinds:
        return LeaseResult([])
    rows = await db.fetch(_LEASE, list(kinds), n, list(slots), float(lease_seconds))
    # UPDATE ... RETURNING does not keep the pick order: restore the slots' order
    # (pending by priority and id, then reclaimed ones by expiry).
    rows.sort(key=_BY_SLOT)
    jobs = [_leased(r) for r in rows if r["status"] == "leased"]  # the others went dead
    picked = sum(r["phase"] == 1 for r in rows)
    return LeaseResult(jobs, len(jobs) - picked, len(rows) - len(jobs), phase2_ran=picked < n)


_BY_SLOT = operator.itemgetter("slot")


# Planner statistics of a queue are always stale: ANALYZE saw 0 pending rows,
# then 100k arrived. Trusting them, the planner reads *every* pending row of
# the kind with a bitmap scan and sorts them (O(pending), ~40 ms at 50k)
# instead of walking the pending index in order and stopping after n. These
# settings leave it only the ordered walk. Every connection gpuq.db opens
# starts with them (startup parameters: no round trip); every hot statement
# is meant to walk a partial index anyway, so nothing else loses a good plan.
# With no other plan left, planning the lease again for each call's values
# is pure cost (0.37 ms of a 0.5 ms lease of one job): the generic plan of
# the prepared statement is the same walk, so use it from the first call.
PLAN_SETTINGS = {"enable_bitmapscan": "off", "enable_seqscan": "off", "plan_cache_mode": "force_generic_plan"}


async def explain_lease(conn: Any, kinds: Sequence[str], n: int) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the lease statement, rolled back: the plan as a dict.

    For the history-independence checks in tests and ``gpuq bench lease-history``.
    """
    return await explain(conn, _LEASE, list(kinds), n, ["explain"] * n, 30.0)


async def explain(conn: Any, statement: str, *args: Any) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of any statement with ``args``, rolled back: the plan as a dict.

    ``conn`` must be a Connection (the statement runs inside a transaction).
    """
    tx = conn.transaction()
    await tx.start()
    try:
        raw = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, *args)
    finally:
        await tx.rollback()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]
    return dict(plan)


def plan_buffers(plan: dict[str, Any], *, reads_only: bool = False) -> int:
    """Shared buffers (hit + read) the executed plan touched, planning excluded.

    ``reads_only``: only the finding and locking of the rows (the ``picked``
    and ``expired`` CTEs), not the writing of new row versions and their index entries, whose
    B-tree descent grows (logarithmically) with the table like any insert's.
    """
    nodes = [plan["Plan"]]
    if reads_only:
        nodes = [n for n in plan["Plan"].get("Plans", [])
                 if n.get("Subplan Name") in ("CTE picked", "CTE expired")]
    return sum(int(n.get("Shared Hit Blocks", 0)) + int(n.get("Shared Read Blocks", 0)) for n in nodes)


def plan_indexes(plan: dict[str, Any]) -> set[str]:
    """Names of every index the plan scans, and the relations it scans sequentially."""
    found: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if "Index Name" in node:
            found.add(node["Index Name"])
        if node.get("Node Type") == "Seq Scan":
            found.add(f"seqscan:{node.get('Relation Name')}")
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return found


def _leased(r: Any) -> LeasedJob:
    return LeasedJob(r["id"], r["kind"], r["attempts"], r["max_attempts"], r["lease_token"], r["priority"],
                     r["leased_by"], r["payload_json"])


# --------------------------------------------------------------------------
# Outcomes: fenced by (status = 'leased', lease_token)
# --------------------------------------------------------------------------

# Outcomes, heartbeats and releases find their rows by id, in the primary key:
# O(batch). Their status test is written status::text = 'leased' on purpose.
# Written status = 'leased' it matches jobs_leased_idx's predicate, and with a
# queue's always-stale statistics ("no row is leased") the planner prefers to
# read every leased row from that index and hash them: completing 110 jobs
# with 20,000 leased took 6.6 ms that way, 0.76 ms by id.
_COMPLETE_MANY = """
UPDATE gpuq.jobs j
SET status = 'done', result = d.result::jsonb, finished_at = now(), lease_expires_at = NULL
FROM unnest($1::bigint[], $2::uuid[], $3::text[]) AS d(id, token, result)
WHERE j.id = d.id AND j.status::text = 'leased' AND j.lease_token = d.token
RETURNING j.id
"""


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
    rows = await db.fetch(_COMPLETE_MANY, ids, tokens, values)
    return {r["id"] for r in rows}


async def complete(db: DB, job_id: int, token: str, result: Any = None) -> bool:
    return job_id in await complete_many(db, [(job_id, token, result)])


# A retryable failure with attempts left goes 'scheduled' after a backoff;
# anything else goes 'dead'. The jitter spreads retries of a burst apart.
_FAIL_MANY = """
WITH f AS (
    SELECT * FROM unnest($1::bigint[], $2::uuid[], $3::text[], $4::bool[]) AS f(id, token, error, retryable)
)
UPDATE gpuq.jobs j
SET status = CASE WHEN f.retryable AND j.attempts < j.max_attempts
                  THEN 'scheduled'::gpuq.job_status ELSE 'dead' END,
    run_at = CASE WHEN f.retryable AND j.attempts < j.max_attempts
                  THEN now() + make_interval(secs => least($6::float8, $5::float8 * power(2, j.attempts - 1))
                                                     * (1 - $7::float8 * random()))
                  ELSE j.run_at END,
    finished_at = CASE WHEN f.retryable AND j.attempts < j.max_attempts THEN NULL ELSE now() END,
    last_error = f.error, lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
FROM f
WHERE j.id = f.id AND j.status::text = 'leased' AND j.lease_token = f.token
RETURNING j.id, j.status, j.run_at
"""


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
    rows = await db.fetch(_FAIL_MANY, ids, tokens, errors, retry,
                          backoff.base_seconds, backoff.cap_seconds, backoff.jitter)
    return {r["id"]: FailOutcome(r["id"], str(r["status"]), r["run_at"]) for r in rows}


async def fail(db: DB, job_id: int, token: str, error: str, retryable: bool = True,
               backoff: Backoff = Backoff()) -> FailOutcome | None:
    """Fenced failure of one job; None if the lease no longer holds."""
    return (await fail_many(db, [(job_id, token, error, retryable)], backoff)).get(job_id)


_HEARTBEAT = """
UPDATE gpuq.jobs
SET lease_expires_at = now() + make_interval(secs => $3)
WHERE id = ANY($1::bigint[]) AND status::text = 'leased' AND leased_by = $2  -- by id: see _COMPLETE_MANY
RETURNING id
"""


async def heartbeat(db: DB, ids: Sequence[int], agent: str, lease_seconds: float) -> set[int]:
    """Extend the leases ``agent`` holds on ``ids``; return those extended."""
    if not ids:
        return set()
    rows = await db.fetch(_HEARTBEAT, list(ids), agent, float(lease_seconds))
    return {r["id"] for r in rows}


# --------------------------------------------------------------------------
# Returning work: disconnects, expired leases, due retries (each NOTIFYs)
# --------------------------------------------------------------------------

# The attempt that was running still counts: a job that keeps killing its
# agents runs out of attempts and ends dead instead of looping forever.
_BACK_TO_PENDING = """
UPDATE gpuq.jobs j
SET status = CASE WHEN j.attempts >= j.max_attempts THEN 'dead'::gpuq.job_status ELSE 'pending' END,
    finished_at = CASE WHEN j.attempts >= j.max_attempts THEN now() END,
    last_error = CASE WHEN j.attempts >= j.max_attempts THEN $2 ELSE j.last_error END,
    lease_token = NULL, lease_expires_at = NULL, leased_by = NULL
FROM ({select}) AS picked
WHERE j.id = picked.id
RETURNING j.id, j.kind, j.status
"""

# ``_BACK_TO_PENDING`` with each selection of rows to return. The selections
# are fixed strings (no input), so the statements are too.
_RELEASE_AGENT = _BACK_TO_PENDING.format(
    select="SELECT id FROM gpuq.jobs WHERE status = 'leased' AND leased_by = $1 FOR UPDATE"
)
_RELEASE_IDS = _BACK_TO_PENDING.format(
    select="SELECT id FROM gpuq.jobs WHERE status::text = 'leased' AND id = ANY($1::bigint[]) FOR UPDATE"  # by id
)
_RECLAIM_EXPIRED = _BACK_TO_PENDING.format(
    select="SELECT id FROM gpuq.jobs WHERE status = 'leased' AND lease_expires_at < now() "
    "ORDER BY lease_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED"
)

_PROMOTE_DUE = """
UPDATE gpuq.jobs j SET status = 'pending'
FROM (SELECT id FROM gpuq.jobs WHERE status = 'scheduled' AND run_at <= now()
      ORDER BY run_at LIMIT $1 FOR UPDATE SKIP LOCKED) AS due
WHERE j.id = due.id
RETURNING j.id, j.kind, j.status
"""


@dataclass(frozen=True, slots=True)
class Moved:
    """Rows moved by a maintenance statement: back to pending, or dead."""

    pending: list[int]
    dead: list[int]
    kinds: set[str]


async def _move_and_notify(db: DB, query: str, *args: Any) -> Moved:
    rows = await db.fetch(query, *args)
    moved = Moved([r["id"] for r in rows if r["status"] == "pending"],
                  [r["id"] for r in rows if r["status"] == "dead"],
                  {r["kind"] for r in rows if r["status"] == "pending"})
    if moved.kinds:
        await notify(db, moved.kinds)
    return moved


async def release_agent(db: DB, agent: str) -> Moved:
    """An agent disconnected: its leased jobs go back to pending at once."""
    return await _move_and_notify(db, _RELEASE_AGENT, agent, "agent disconnected during the last attempt")


async def release_jobs(db: DB, ids: Sequence[int]) -> Moved:
    """Give up leases held by this process (dispatcher shutdown, undeliverable jobs)."""
    if not ids:
        return Moved([], [], set())
    return await _move_and_notify(db, _RELEASE_IDS, list(ids), "released during the last attempt")


async def reclaim_expired(db: DB, limit: int = 1000) -> Moved:
    """Sweeper: expired leases back to pending (or dead when out of attempts)."""
    return await _move_and_notify(db, _RECLAIM_EXPIRED, limit, "lease expired after the last attempt")


async def promote_due(db: DB, limit: int = 1000) -> Moved:
    """Sweeper: scheduled rows whose run_at has come become pending."""
    return await _move_and_notify(db, _PROMOTE_DUE, limit)


async def notify(db: DB, kinds: Iterable[str]) -> None:
    payload = ",".join(sorted(set(kinds)))
    await db.execute("SELECT pg_notify($1, $2)", NOTIFY_CHANNEL, payload if len(payload) <= 7000 else "*")


_CANCEL = """
UPDATE gpuq.jobs
SET status = 'dead', last_error = 'cancelled', finished_at = now(),
    lease_token = NULL, lease_expires_at = NULL
WHERE id = $1 AND status IN ('pending', 'leased', 'scheduled')
RETURNING id
"""


async def cancel(db: DB, job_id: int) -> bool:
    """Cancel a live job (it becomes dead; a running agent's result is then fenced out)."""
    return await db.fetchval(_CANCEL, job_id) is not None


# --------------------------------------------------------------------------
# Retention: delete old history in bounded windows of the primary key
# --------------------------------------------------------------------------

# Examines only ids in [$1, $2): O(window) whatever the table size. Reports
# whether the window reached rows created after the cutoff (ids grow with
# time, so the rest of the table is younger: the walk can stop there).
_PRUNE_WINDOW = """
WITH w AS (
    SELECT id, status, finished_at, created_at FROM gpuq.jobs WHERE id >= $1 AND id < $2
), del AS (
    DELETE FROM gpuq.jobs j USING w
    WHERE j.id = w.id AND w.status IN ('done', 'dead') AND w.finished_at < now() - make_interval(secs => $3)
    RETURNING 1
)
SELECT (SELECT count(*) FROM del) AS deleted,
       coalesce((SELECT bool_or(created_at >= now() - make_interval(secs => $3)) FROM w), false) AS reached_young,
       (SELECT max(id) FROM gpuq.jobs) AS max_id
"""


async def prune_window(db: DB, start_id: int, window: int, retention_seconds: float) -> tuple[int, bool, int | None]:
    row = await db.fetchrow(_PRUNE_WINDOW, start_id, start_id + window, float(retention_seconds))
    return row["deleted"], row["reached_young"], row["max_id"]


async def min_job_id(db: DB) -> int | None:
    return await db.fetchval("SELECT min(id) FROM gpuq.jobs")


# --------------------------------------------------------------------------
# Status: live counts from the partial indexes, history only as an estimate
# --------------------------------------------------------------------------

# Each branch is answered from its own partial index; done/dead rows are
# never visited. (GROUP BY over the whole table is what stalled the old system.)
STATUS_COUNTS_SQL = """
SELECT 'pending' AS status, kind, count(*) AS n, min(created_at) AS oldest
  FROM gpuq.jobs WHERE status = 'pending' GROUP BY kind
UNION ALL
SELECT 'leased', kind, count(*), min(started_at) FROM gpuq.jobs WHERE status = 'leased' GROUP BY kind
UNION ALL
SELECT 'scheduled', kind, count(*), min(run_at) FROM gpuq.jobs WHERE status = 'scheduled' GROUP BY kind
"""

# Planner statistics, not a count: O(1). Good enough for "how big is history".
_TABLE_ESTIMATE = """
SELECT greatest(c.reltuples, 0)::bigint FROM pg_class c
WHERE c.oid = 'gpuq.jobs'::regclass
"""


@dataclass
class StatusCounts:
    live: dict[str, dict[str, int]]  # status -> kind -> count
    oldest_pending_seconds: float | None
    history_estimate: int  # done + dead, from planner statistics (approximate)

    def total(self, status: str) -> int:
        return sum(self.live.get(status, {}).values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "live": self.live,
            "totals": {s: self.total(s) for s in LIVE_STATES},
            "oldest_pending_seconds": self.oldest_pending_seconds,
            "history_estimate": self.history_estimate,
        }


async def status_counts(db: DB) -> StatusCounts:
    rows = await db.fetch(STATUS_COUNTS_SQL)
    now = await db.fetchval("SELECT now()")
    live: dict[str, dict[str, int]] = {s: {} for s in LIVE_STATES}
    oldest = None
    for r in rows:
        live[r["status"]][r["kind"]] = r["n"]
        if r["status"] == "pending" and (oldest is None or r["oldest"] < oldest):
            oldest = r["oldest"]
    estimate = await db.fetchval(_TABLE_ESTIMATE)
    n_live = sum(sum(k.values()) for k in live.values())
    return StatusCounts(live, (now - oldest).total_seconds() if oldest else None, max(0, estimate - n_live))


def _json(value: Any) -> str | None:
    """JSON text for a jsonb array element (asyncpg would read a list as a nested array)."""
    return None if value is None else _to_json(value)


# One encoder for every payload and result: json.dumps with any option builds a new one per call.
_to_json = json.JSONEncoder(separators=(",", ":")).encode
