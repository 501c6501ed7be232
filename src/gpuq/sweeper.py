"""The sweeper: a small maintenance service, run alone (``gpuq sweep``) or in ``gpuq serve``.

Each tick, in bounded steps so no statement grows with the table:
1. expired leases go back to pending (or dead when out of attempts);
2. due ``scheduled`` rows (retries, delayed jobs) become pending;
3. with a retention, done/dead rows older than it are deleted, walking the
   primary key in fixed windows from the oldest id and stopping at the first
   window that holds rows younger than the retention.
Every move to pending NOTIFYs, so dispatchers pick the work up at once.
Several sweepers may run at once: SKIP LOCKED keeps them out of each other's way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio

from gpuq import logs, metrics, queue
from gpuq.db import RETRYABLE_ERRORS

log = logs.get("sweeper")


@dataclass(frozen=True)
class SweeperConfig:
    interval_seconds: float = 2.0
    batch: int = 1000  # rows per statement
    max_batches: int = 10  # statements per step per tick (bounds one tick's work)
    retention_seconds: float | None = None  # None: keep history forever
    prune_window: int = 5000  # ids examined per retention statement


@dataclass
class SweepReport:
    reclaimed: int = 0
    dead: int = 0
    promoted: int = 0
    pruned: int = 0
    reclaimed_ids: list[int] = field(default_factory=list)
    dead_ids: list[int] = field(default_factory=list)

    def any(self) -> bool:
        return bool(self.reclaimed or self.dead or self.promoted or self.pruned)


@dataclass
class Sweeper:
    db: Any  # asyncpg Pool (or Connection)
    config: SweeperConfig = field(default_factory=SweeperConfig)
    _prune_cursor: int | None = None  # next id to examine; None = start from the oldest

    async def tick(self) -> SweepReport:
        report = SweepReport()
        for _ in range(self.config.max_batches):
            moved = await queue.reclaim_expired(self.db, self.config.batch)
            report.reclaimed += len(moved.pending)
            report.dead += len(moved.dead)
            report.reclaimed_ids += moved.pending
            report.dead_ids += moved.dead
            if len(moved.pending) + len(moved.dead) < self.config.batch:
                break
        for _ in range(self.config.max_batches):
            moved = await queue.promote_due(self.db, self.config.batch)
            report.promoted += len(moved.pending)
            if len(moved.pending) < self.config.batch:
                break
        if self.config.retention_seconds is not None:
            report.pruned = await self._prune(self.config.retention_seconds)
        metrics.SWEEP_RECLAIMED.inc(report.reclaimed)
        metrics.SWEEP_DEAD.inc(report.dead)
        metrics.SWEEP_PROMOTED.inc(report.promoted)
        metrics.SWEEP_PRUNED.inc(report.pruned)
        return report

    async def _prune(self, retention_seconds: float) -> int:
        deleted = 0
        for _ in range(self.config.max_batches):
            if self._prune_cursor is None:
                self._prune_cursor = await queue.min_job_id(self.db)
                if self._prune_cursor is None:
                    return deleted  # empty table
            n, reached_young, max_id = await queue.prune_window(
                self.db, self._prune_cursor, self.config.prune_window, retention_seconds
            )
            deleted += n
            self._prune_cursor += self.config.prune_window
            if reached_young or max_id is None or self._prune_cursor > max_id:
                # The rest is younger than the retention: start over next tick
                # (rows skipped while live get their turn once they finish).
                self._prune_cursor = None
                break
        return deleted

    async def run(self) -> None:
        """Tick forever; a database outage is logged and retried, never fatal."""
        log.info("sweeper.started", interval_seconds=self.config.interval_seconds,
                 retention_seconds=self.config.retention_seconds)
        while True:
            try:
                report = await self.tick()
            except RETRYABLE_ERRORS as exc:
                log.warning("sweeper.tick_failed", error=str(exc))
            else:
                if report.reclaimed:
                    log.info("job.reclaimed", count=report.reclaimed, job_ids=report.reclaimed_ids[:100])
                if report.dead:
                    log.info("job.dead", count=report.dead, job_ids=report.dead_ids[:100],
                             reason="lease expired after the last attempt")
                if report.promoted or report.pruned:
                    log.info("sweeper.tick", promoted=report.promoted, pruned=report.pruned)
            await anyio.sleep(self.config.interval_seconds)
