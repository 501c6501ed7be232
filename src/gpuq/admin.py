"""The operator's side of the queue over ``sql/queries.sql``: control and reads, not the job lifecycle.

Control: pause and resume kinds, limits, kinds' default timeouts, batching
policies, tenants' weights and the usage half-life, retry, cancel and preempt jobs
(the ``gpuq`` admin commands and the dashboard's actions). Reads: one job,
pages of jobs, live counts, tenants' usage (``gpuq show``/``jobs``/``status``,
``/status`` and the dashboard). Each read stays bounded whatever the history:
a page walks at most ``LIST_WINDOW`` ids, counts read the partial indexes.
Functions take ``db`` (``gpuq.sql.DB``); every value travels as a bind parameter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from gpuq.backlog import COUNT_CAP
from gpuq.jobs import (
    LIVE_STATES,
    MAX_BATCH_ITEMS,
    MAX_BATCH_WAIT_MS,
    MAX_COST,
    JobFilter,
    JobPage,
    RetryFilter,
    StatusCounts,
    check_timeout,
)
from gpuq.kinds import KIND_RULE, is_kind
from gpuq.sql import DB, queries
from gpuq.tenants import Tenant, check_half_life, check_tenant, check_weight, with_shares

# A page of a list that may reach into history examines at most this many ids
# of the primary key: a filter that matches nothing costs one window, not the table.
LIST_WINDOW = 10_000


# -- control (issue #15) -------------------------------------------------------


async def pause(db: DB, kind: str, by: str) -> bool:
    """Stop every dispatcher leasing ``kind`` (running jobs finish); False if it was paused already."""
    return await db.fetchval(queries["pause_kind"], kind, by) is not None


async def resume(db: DB, kind: str) -> bool:
    """Lease ``kind`` again and wake the dispatchers; False if it was not paused."""
    return await db.fetchval(queries["resume_kind"], kind) is not None


async def set_kind_timeout(db: DB, kind: str, timeout_seconds: int | None) -> None:
    """Jobs of ``kind`` without a timeout of their own get ``timeout_seconds`` per attempt (None: no default)."""
    if not is_kind(kind):
        raise ValueError(f"bad job kind {kind!r}: {KIND_RULE}")
    check_timeout(timeout_seconds)
    await db.execute(queries["kind_timeout_set"], kind, timeout_seconds)


async def kind_timeouts(db: DB) -> dict[str, int]:
    return {r["kind"]: r["timeout_seconds"] for r in await db.fetch(queries["kind_timeouts"])}


async def paused(db: DB) -> dict[str, dict[str, Any]]:
    """Paused kinds -> who paused them (``by``) and when (``since``, ISO 8601)."""
    rows = await db.fetch(queries["paused_kinds"])
    return {r["kind"]: {"since": r["paused_at"].isoformat(), "by": r["paused_by"]} for r in rows}


async def retry_count(db: DB, which: RetryFilter) -> int:
    """How many dead or cancelled jobs ``retry`` would send back (a dry run)."""
    return int(await db.fetchval(queries["retry_count"], *which.args()))


async def retry(db: DB, which: RetryFilter, fresh: bool = False) -> int:
    """Send matching dead or cancelled jobs back to pending with fresh attempts; how many went.
    They keep their checkpoint (the next attempt resumes from it) unless ``fresh``."""
    return int(await db.fetchval(queries["retry"], *which.args(), fresh) or 0)


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


async def set_batching(db: DB, kind: str, max_items: int | None, max_wait_ms: int = 0,
                       max_cost: int | None = None) -> None:
    """Lease ``kind``'s jobs in batches of at most ``max_items`` for agents that take batches, across
    every dispatcher: a partial batch goes once its oldest job waited ``max_wait_ms``, and a batch's
    costs sum to at most ``max_cost`` (None: no budget). ``max_items`` None removes the policy."""
    if not is_kind(kind):
        raise ValueError(f"bad job kind {kind!r}: {KIND_RULE}")
    if max_items is not None and not 1 <= max_items <= MAX_BATCH_ITEMS:
        raise ValueError(f"max_items must be 1-{MAX_BATCH_ITEMS}, not {max_items}")
    if not 0 <= max_wait_ms <= MAX_BATCH_WAIT_MS:
        raise ValueError(f"max_wait_ms must be 0-{MAX_BATCH_WAIT_MS}, not {max_wait_ms}")
    if max_cost is not None and not 1 <= max_cost <= MAX_COST:
        raise ValueError(f"max_cost must be a positive whole number, not {max_cost}")
    await db.execute(queries["batch_policy_set"], kind, max_items, max_wait_ms, max_cost)


async def batching(db: DB) -> list[dict[str, Any]]:
    """Every kind's batching policy: ``{kind, max_items, max_wait_ms, max_cost, updated_at}``."""
    return [dict(r) for r in await db.fetch(queries["batch_policies"])]


async def set_tenant(db: DB, name: str, weight: float | None) -> None:
    """Tenant ``name`` weighs ``weight`` (``default``: the jobs that name none); None removes its
    weight (back to 1). Fair share is on while some tenant has a weight; every dispatcher is told."""
    check_tenant(name)
    if weight is not None:
        check_weight(weight)
    await db.execute(queries["tenant_set"], name, weight)


async def tenant_weights(db: DB) -> dict[str, float]:
    """The weights set (none: fair share is off)."""
    return {r["name"]: r["weight"] for r in await db.fetch(queries["tenant_weights"])}


async def tenants(db: DB) -> list[Tenant]:
    """While fair share is on, each tenant with a weight, usage or work: its usage (decayed, with its
    running jobs' so far), shares, running and pending jobs (up to ``COUNT_CAP``); else none.
    O(tenants with work + COUNT_CAP a tenant), never history."""
    return with_shares(await db.fetch(queries["tenant_usage"], COUNT_CAP))


async def set_half_life(db: DB, seconds: float) -> None:
    """Usage halves every ``seconds`` from now on, on every server."""
    check_half_life(seconds)
    await db.execute(queries["half_life_set"], float(seconds))


async def half_life(db: DB) -> float:
    return float(await db.fetchval(queries["half_life"]))


async def limits(db: DB) -> list[dict[str, Any]]:
    """Every limit: ``{scope, name, max_running, running}``."""
    return [dict(r) for r in await db.fetch(queries["limits"])]


async def cancel(db: DB, *job_ids: int) -> dict[int, str]:
    """Cancel live jobs: they end ``cancelled`` and are not retried; a running agent's
    result is fenced out. Returns each job cancelled and the state it left
    (jobs already finished, or unknown, are not in it)."""
    return {r["id"]: r["was"] for r in await db.fetch(queries["cancel"], list(job_ids))}


async def preempt(db: DB, *job_ids: int) -> dict[int, float]:
    """Ask running jobs to yield (``gpuq.preempt``): those preemptible, with preemptions left and not
    asked within their grace time. Each job asked -> its grace seconds (the agent stops it then,
    and it goes back to pending without counting the attempt)."""
    return {r["id"]: r["grace_seconds"] for r in await db.fetch(queries["preempt"], list(job_ids))}


# -- reads ---------------------------------------------------------------------


async def show(db: DB, job_id: int) -> dict[str, Any] | None:
    """Every column of one job (payload and result decoded), or None if there is no such job."""
    row = await db.fetchrow(queries["show"], job_id)
    if row is None:
        return None
    out = dict(row)
    for key in ("payload", "result", "progress", "checkpoint"):
        out[key] = None if out[key] is None else json.loads(out[key])
    return out


async def attempts(db: DB, job_id: int) -> list[dict[str, Any]]:
    """The attempts of one job that did not succeed, oldest first (the job row holds the last one)."""
    return [dict(r) for r in await db.fetch(queries["job_attempts"], job_id)]


async def last_agents(db: DB, job_ids: Sequence[int]) -> dict[int, str]:
    """Job id -> the agent of its latest attempt that did not succeed (for jobs that have one)."""
    return {r["job_id"]: r["agent"] for r in await db.fetch(queries["last_agents"], list(job_ids))}


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


def _indexed(which: JobFilter) -> bool:
    """Does the page read an index of its own (True), or walk recent ids from the newest?"""
    return (which.state is not None and which.state != "done") or which.key is not None


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
