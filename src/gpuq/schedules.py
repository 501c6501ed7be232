"""Periodic jobs: a cron expression that enqueues a job of a kind on each tick.

Ticks are computed with ``croniter`` (a maintained parser; we do not write our
own) in the database's time zone-independent UTC. A sweeper fires what is due
in one statement that compares and sets each schedule's next run
(``schedules_fire``): each tick is enqueued once however many sweepers run,
and after downtime a schedule gets one catch-up job, then its next tick after
now, never one job per missed tick (docs/design.md, "Periodic jobs").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from croniter import croniter

from gpuq.jobs import NewJob
from gpuq.sql import DB, queries

DUE_BATCH = 100  # schedules fired per statement


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    cron: str
    kind: str
    payload: Any = None
    priority: int = 0
    max_attempts: int = 5

    def __post_init__(self) -> None:
        if not 1 <= len(self.name) <= 128:
            raise ValueError(f"bad schedule name {self.name!r}: 1-128 characters")
        if not croniter.is_valid(self.cron):
            raise ValueError(f"bad cron expression {self.cron!r}: five fields, e.g. '*/5 * * * *'")
        NewJob.from_mapping({"kind": self.kind, "payload": self.payload, "priority": self.priority,
                             "max_attempts": self.max_attempts})  # the job rules, as readable errors

    def next_after(self, moment: datetime) -> datetime:
        """The first tick strictly after ``moment``."""
        return croniter(self.cron, moment.astimezone(UTC)).get_next(datetime)


async def add(db: DB, schedule: Schedule, by: str, now: datetime | None = None) -> datetime:
    """Create a schedule; its first run is the first tick after now. ValueError if the name is taken."""
    first = schedule.next_after(now or datetime.now(UTC))
    payload = None if schedule.payload is None else json.dumps(schedule.payload)
    added = await db.fetchval(queries["schedule_add"], schedule.name, schedule.cron, schedule.kind, payload,
                              schedule.priority, schedule.max_attempts, first, by)
    if added is None:
        raise ValueError(f"schedule {schedule.name!r} exists: remove it first")
    return first


async def remove(db: DB, name: str) -> bool:
    return await db.fetchval(queries["schedule_remove"], name) is not None


async def listing(db: DB) -> list[dict[str, Any]]:
    rows = await db.fetch(queries["schedule_list"])
    return [{**dict(r), "payload": None if r["payload"] is None else json.loads(r["payload"])} for r in rows]


async def fire_due(db: DB, batch: int = DUE_BATCH) -> int:
    """Enqueue one job for each due schedule and move it to its next tick; the jobs enqueued."""
    due = await db.fetch(queries["schedules_due"], batch)
    if not due:
        return 0
    now = due[0]["now"]
    names = [r["name"] for r in due]
    nexts = [croniter(r["cron"], now.astimezone(UTC)).get_next(datetime) for r in due]
    return len(await db.fetch(queries["schedules_fire"], names, nexts, [r["next_run_at"] for r in due]))
