"""What each dashboard page shows, as plain data from the server's own state and indexed queries.

No view scans history: counts come from the partial indexes (``status_counts``),
agents from the dispatcher's memory (docs/design.md, "Dashboard").
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from gpuq import admin, quarantine, schedules
from gpuq.fleet import Fleet
from gpuq.jobs import LIST_STATES, JobFilter, error_line


async def overview(fleet: Fleet) -> dict[str, Any]:
    """Per kind: pending, leased, scheduled, paused, unplaceable, the oldest pending job's age;
    the fleet: agents, busy fraction; while fair share is on, each tenant's usage and shares."""
    counts = await admin.status_counts(fleet.pool)
    unplaceable = await fleet.unplaceable()
    kinds = sorted({k for by_kind in counts.live.values() for k in by_kind} | set(counts.paused) | set(unplaceable))
    rows = [{
        "kind": k,
        "pending": counts.live["pending"].get(k, 0),
        "leased": counts.live["leased"].get(k, 0),
        "scheduled": counts.live["scheduled"].get(k, 0),
        "paused": k in counts.paused,
        "unplaceable": sum(u["pending"] for u in unplaceable.get(k, [])),
        "oldest_pending": age(counts.oldest_pending_by_kind.get(k)),
    } for k in kinds]
    return {"kinds": rows, "agents": fleet.agent_count, "history_estimate": counts.history_estimate,
            "busy_fraction": fleet.busy()["busy_fraction"], "read_at": datetime.now(UTC),
            "tenants": await admin.tenants(fleet.pool)}


def agents(fleet: Fleet) -> list[dict[str, Any]]:
    """Every agent connected to this server, as an operator reads it."""
    return [{**a, "last_heartbeat": age(a["last_heartbeat_seconds"])} for a in fleet.agents()]


def age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# Payloads, results and progress are shown pretty-printed up to this many
# characters: a page never carries a multi-megabyte blob.
SHOWN_CHARS = 64_000
STATES = ("", *LIST_STATES)  # "" = any


async def jobs(fleet: Fleet, which: JobFilter, before: int | None) -> dict[str, Any]:
    """One page of the job list (keyset: ``before`` is the id the page starts below)."""
    page = await admin.list_jobs(fleet.pool, which, before)
    # A job that failed or was lost no longer names its agent: the list shows its last attempt's.
    gone = [j["id"] for j in page.jobs if j["leased_by"] is None and j["attempts"]]
    last = await admin.last_agents(fleet.pool, gone) if gone else {}
    for j in page.jobs:
        j["leased_by"] = j["leased_by"] or last.get(j["id"])
        j["error"] = error_line(j["error"])  # a traceback's last line says what happened
    return {"jobs": page.jobs, "older": page.older, "searched_to": page.searched_to, "before": before,
            "filter": which, "retryable": which.state in ("dead", "cancelled", "failed")}


async def job(fleet: Fleet, job_id: int) -> dict[str, Any] | None:
    """One job as its page shows it: every column, its attempts, the one running or done last."""
    shown = await admin.show(fleet.pool, job_id)
    if shown is None:
        return None
    tried = await admin.attempts(fleet.pool, job_id)
    if shown["status"] in ("leased", "done") and shown["started_at"] is not None:
        tried.append({"attempt": shown["attempts"], "agent": shown["leased_by"], "started_at": shown["started_at"],
                      "ended_at": shown["finished_at"], "error": None,
                      "became": "running" if shown["status"] == "leased" else "done"})
    for a in tried:
        a["took"] = None if a["ended_at"] is None or a["started_at"] is None else age(
            (a["ended_at"] - a["started_at"]).total_seconds())
    return {**shown, "attempt_rows": tried, "payload_text": pretty(shown["payload"]),
            "result_text": pretty(shown["result"]), "progress_text": pretty(shown["progress"]),
            "checkpoint_text": pretty(shown["checkpoint"])}


def pretty(value: Any) -> str | None:
    """A JSON value as indented text, cut at SHOWN_CHARS (the page says so)."""
    if value is None:
        return None
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + f"\n… ({len(text) - SHOWN_CHARS} more characters)"


async def controls(fleet: Fleet) -> dict[str, Any]:
    """What operators set with the CLI: paused kinds, limits (with what runs under each), kinds'
    default timeouts, batching policies, tenants' weights (with their usage), periodic jobs, quarantined
    GPUs. Small
    tables; a limit's count reads the leased partial indexes, the tenants' as ``admin.tenants``."""
    pool = fleet.pool
    return {"paused": await admin.paused(pool), "limits": await admin.limits(pool),
            "timeouts": await admin.kind_timeouts(pool), "batching": await admin.batching(pool),
            "tenants": await admin.tenants(pool), "half_life": await admin.half_life(pool),
            "schedules": await schedules.listing(pool), "quarantined": await quarantine.listing(pool)}


def when(at: datetime | None, seconds: bool = False) -> str:
    """A timestamp in UTC, to the millisecond (``seconds``: to the second)."""
    if at is None:
        return "–"
    at = at.astimezone(UTC)
    return at.strftime("%Y-%m-%d %H:%M:%S") + ("" if seconds else f".{at.microsecond // 1000:03d}") + " UTC"
